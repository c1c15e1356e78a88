"""Queueing with Kueue, without a cluster: the Workload and the status writes built as whole
objects, and a queued job's passes against the fake API while a stand-in for Kueue admits,
evicts and re-admits its Workload the way Kueue's scheduler writes the status."""

from __future__ import annotations

import asyncio
import copy
from datetime import datetime

from accelerate_operator.api import parse_job
from accelerate_operator.kueue import QueueContext, build_quota_release, read_workload
from accelerate_operator.reconciler import Reconciler
from accelerate_operator.resources.pods import build_pod
from accelerate_operator.resources.workload import build_workload, with_flavors
from accelerate_operator.state import JobState

from tests.helpers.fake_kube import FakeKube
from tests.helpers.jobs import JobBuilder

NOW = datetime(2026, 1, 1, 12, 0, 0)
STAMP = "2026-01-01T12:00:00Z"
GPU_FLAVOR = {"nodeLabels": {"cloud.example.com/gpu": "a100"},
              "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                               "effect": "NoSchedule"}]}


def queued_job(name: str = "llm", *, priority: str | None = None, **policy) -> dict:
    body = (JobBuilder(name).nodes(2).procs(1).run_policy(**policy)
            .container(resources={"requests": {"cpu": "1"}, "limits": {"nvidia.com/gpu": 1}})
            .build())
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    if priority:
        body["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] = priority
    return body


def condition(type_: str, status: bool, reason: str, message: str = "") -> dict:
    return {"type": type_, "status": "True" if status else "False", "reason": reason,
            "message": message, "lastTransitionTime": STAMP, "observedGeneration": 1}


# ---- builders, whole objects --------------------------------------------------------------

def test_the_workload_has_one_pod_set_of_all_nodes_with_the_pods_resources_and_priority():
    job = parse_job(queued_job(priority="high"))
    workload = build_workload(job, "team-a", "high", 1000)
    pod_spec = build_pod(job, 0, 0)["spec"]
    labels = {"app.kubernetes.io/name": "accelerate-job", "app.kubernetes.io/instance": "llm",
              "app.kubernetes.io/managed-by": "accelerate-operator",
              "accelerate-operator.io/job-name": "llm"}
    assert workload == {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "Workload",
        "metadata": {"name": "acceleratejob-llm-uid-llm", "namespace": "ml", "labels": labels,
                     "ownerReferences": [job.owner_reference]},
        "spec": {
            "queueName": "team-a",
            "active": True,
            "podSets": [{"name": "main", "count": 2,
                         "template": {"metadata": {"labels": labels}, "spec": pod_spec}}],
            "priorityClassName": "high",
            "priorityClassSource": "kueue.x-k8s.io/workloadpriorityclass",
            "priority": 1000,
        },
    }
    assert pod_spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}


def test_a_suspended_job_gets_an_inactive_workload_without_priority_fields():
    workload = build_workload(parse_job(queued_job(suspend=True)), "team-a")
    assert workload["spec"]["active"] is False
    assert "priority" not in workload["spec"]


def test_admitted_flavors_join_the_pods_node_selector_and_tolerations():
    pod = build_pod(parse_job(queued_job()), 1, 0)
    pod["spec"]["nodeSelector"] = {"zone": "a"}
    placed = with_flavors(pod, GPU_FLAVOR["nodeLabels"], GPU_FLAVOR["tolerations"])
    assert placed["spec"]["nodeSelector"] == {"zone": "a", "cloud.example.com/gpu": "a100"}
    assert placed["spec"]["tolerations"] == GPU_FLAVOR["tolerations"]
    assert "tolerations" not in pod["spec"]  # the input is not changed


def evicted_workload() -> dict:
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
        "metadata": {"name": "wl", "namespace": "ml", "uid": "u1", "resourceVersion": "7",
                     "generation": 1},
        "status": {
            "admission": {"clusterQueue": "cq", "podSetAssignments": [
                {"name": "main", "count": 2, "flavors": {"cpu": "default"}}]},
            "conditions": [
                condition("QuotaReserved", True, "QuotaReserved"),
                condition("Admitted", True, "Admitted"),
                condition("Evicted", True, "Preempted", "Preempted to accommodate a workload"),
                condition("Preempted", True, "InClusterQueue", "Preempted by ml/high"),
                condition("PodsReady", True, "PodsReady"),
            ],
            "requeueState": {"count": 1},
        },
    }


def test_releasing_an_evicted_workloads_quota_clears_the_admission_like_kueue_does():
    later = "2026-01-01T12:05:00Z"
    release = build_quota_release(evicted_workload(), later)
    message = "Preempted to accommodate a workload"
    assert release == {
        "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
        "metadata": {"name": "wl", "namespace": "ml", "uid": "u1", "resourceVersion": "7"},
        "status": {
            "conditions": [
                {**condition("QuotaReserved", False, "Pending", message),
                 "lastTransitionTime": later},
                {**condition("Admitted", False, "NoReservation",
                             "The workload has no reservation"), "lastTransitionTime": later},
                condition("Evicted", True, "Preempted", message),
                condition("Preempted", True, "InClusterQueue", "Preempted by ml/high"),
                condition("PodsReady", True, "PodsReady"),
                {**condition("Requeued", True, "Preempted", message),
                 "lastTransitionTime": later},
            ],
            "requeueState": {"count": 1},
        },
    }
    assert "admission" not in release["status"]


def test_a_workload_view_reads_admission_eviction_and_flavors():
    view = read_workload(evicted_workload())
    assert (view.admitted, view.reserved, view.cluster_queue, view.flavors) == (
        True, True, "cq", ("default",))
    assert view.evicted.reason == "Preempted"


# ---- passes against the fake API, with a stand-in for Kueue ---------------------------------

class Queue:
    """The fake API plus the job and its Workload, and Kueue's writes to the Workload."""

    def __init__(self, body: dict):
        self.kube = FakeKube()
        self.kube.kueue_objects[("resourceflavors", "gpu")] = {"spec": GPU_FLAVOR}
        self.body = body
        self.reconciler = Reconciler(self.kube)
        self.state = JobState(body["metadata"]["uid"])

    def reconcile(self) -> None:
        workloads = [o for (kind, _), o in self.kube.objects.items() if kind == "Workload"]
        context = QueueContext(workload=copy.deepcopy(workloads[0]) if workloads else None)
        asyncio.run(self.reconciler.reconcile(self.state, self.body, self.kube.pods(),
                                              self.kube.children(), context))
        for status in self.kube.statuses:
            self.body.setdefault("status", {}).update(status)
        self.kube.statuses.clear()

    def status(self, key: str):
        return (self.body.get("status") or {}).get(key)

    def conditions(self, *types: str) -> dict:
        status = self.kube.workload().get("status") or {}
        return {c["type"]: (c["status"], c["reason"]) for c in status.get("conditions") or []
                if c["type"] in types}

    # Kueue's side: the scheduler admits (QuotaReserved + admission, then Admitted), the
    # preemptor evicts.
    def admit(self) -> None:
        workload = self.kube.workload()
        status = workload.setdefault("status", {})
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [
            {"name": "main", "count": 2, "flavors": {"cpu": "gpu", "nvidia.com/gpu": "gpu"}}]}
        others = [c for c in status.get("conditions") or []
                  if c["type"] not in ("QuotaReserved", "Admitted", "Evicted")]
        status["conditions"] = others + [condition("QuotaReserved", True, "QuotaReserved"),
                                         condition("Admitted", True, "Admitted"),
                                         condition("Evicted", False, "QuotaReserved")]

    def evict(self, reason: str = "Preempted") -> None:
        status = self.kube.workload()["status"]
        status["conditions"] = [c for c in status["conditions"] if c["type"] != "Evicted"] + [
            condition("Evicted", True, reason, "Preempted to accommodate a higher priority")]


def test_a_queued_job_makes_its_workload_and_no_pod_until_kueue_admits_it():
    queue = Queue(queued_job())
    queue.reconcile()
    assert queue.kube.names("Workload") == ["acceleratejob-llm-uid-llm"]
    assert queue.kube.names("Pod") == []
    assert queue.status("phase") == "Queued"
    assert queue.status("queue") == {"name": "team-a"}
    queue.reconcile()
    assert queue.kube.names("Pod") == []
    assert queue.status("queue")["workload"] == "acceleratejob-llm-uid-llm"
    assert [e.reason for e in queue.kube.events] == ["WorkloadCreated"]


def test_an_admitted_job_starts_every_node_on_the_admitted_flavor():
    queue = Queue(queued_job())
    queue.reconcile()
    queue.admit()
    queue.reconcile()
    assert queue.kube.names("Pod") == ["llm-0", "llm-1"]
    for name in ("llm-0", "llm-1"):
        spec = queue.kube.objects[("Pod", name)]["spec"]
        assert spec["nodeSelector"] == {"cloud.example.com/gpu": "a100"}
        assert spec["tolerations"] == GPU_FLAVOR["tolerations"]
    assert queue.status("phase") == "Pending"
    assert queue.status("queue") == {"name": "team-a", "workload": "acceleratejob-llm-uid-llm",
                                     "clusterQueue": "cq", "flavors": ["gpu"]}
    assert "Admitted" in [e.reason for e in queue.kube.events]


def test_an_evicted_job_stops_its_group_releases_the_quota_and_restarts_when_readmitted():
    queue = Queue(queued_job(backoffLimit=0))
    queue.reconcile()
    queue.admit()
    queue.reconcile()
    for name in ("llm-0", "llm-1"):
        queue.kube.set_pod_phase(name, "Running")
    queue.reconcile()
    assert queue.status("phase") == "Running"
    assert queue.conditions("PodsReady") == {"PodsReady": ("True", "PodsReady")}

    queue.evict()
    queue.reconcile()  # deletes the group (the fake deletes at once) ...
    assert queue.kube.names("Pod") == []
    assert queue.status("phase") == "Queued"
    assert (queue.status("attempt"), queue.status("restarts")) == (1, 0)
    assert queue.status("queue")["evictions"] == 1
    assert queue.kube.events[-1].type == "Warning"
    assert queue.kube.events[-1].reason == "Preempted"
    queue.reconcile()  # ... and the next pass, with no pod left, gives the quota back
    assert "admission" not in queue.kube.workload()["status"]
    assert queue.conditions("QuotaReserved", "Admitted", "Requeued") == {
        "QuotaReserved": ("False", "Pending"), "Admitted": ("False", "NoReservation"),
        "Requeued": ("True", "Preempted")}
    queue.reconcile()
    assert queue.kube.names("Pod") == []

    queue.admit()
    queue.reconcile()
    assert queue.kube.names("Pod") == ["llm-0", "llm-1"]
    pod = queue.kube.objects[("Pod", "llm-0")]
    assert pod["metadata"]["labels"]["accelerate-operator.io/attempt"] == "1"
    for name in ("llm-0", "llm-1"):
        queue.kube.set_pod_phase(name, "Succeeded", exit_code=0)
    queue.reconcile()
    assert queue.status("phase") == "Succeeded"  # backoffLimit 0: the eviction used none
    assert queue.conditions("Finished") == {"Finished": ("True", "Succeeded")}


def test_a_users_suspend_wins_and_deactivates_the_workload():
    queue = Queue(queued_job())
    queue.reconcile()
    queue.admit()
    queue.reconcile()
    queue.body["spec"]["runPolicy"]["suspend"] = True
    queue.reconcile()
    assert queue.status("phase") == "Suspended"
    assert queue.kube.names("Pod") == []
    assert queue.kube.workload()["spec"]["active"] is False
    queue.evict("InactiveWorkload")  # Kueue evicts the inactive Workload ...
    queue.reconcile()  # ... and the operator gives its quota back, still Suspended
    assert queue.status("phase") == "Suspended"
    assert "admission" not in queue.kube.workload()["status"]
    queue.body["spec"]["runPolicy"]["suspend"] = False
    queue.reconcile()
    assert queue.kube.workload()["spec"]["active"] is True
    assert queue.status("phase") == "Queued"
    assert queue.kube.names("Pod") == []


def test_the_priority_class_value_is_copied_into_the_workload():
    queue = Queue(queued_job(priority="high"))
    queue.kube.kueue_objects[("workloadpriorityclasses", "high")] = {"value": 1000}
    queue.reconcile()
    assert queue.kube.workload()["spec"]["priority"] == 1000


def test_a_missing_priority_class_fails_the_job_saying_which():
    queue = Queue(queued_job(priority="urgent"))
    queue.reconcile()
    assert queue.status("phase") == "Failed"
    assert "WorkloadPriorityClass 'urgent'" in queue.status("conditions")[-1]["message"]


def test_jobs_without_the_queue_label_or_without_the_integration_ignore_kueue():
    unlabelled = Queue(JobBuilder("plain").nodes(2).build())
    unlabelled.reconcile()
    assert unlabelled.kube.names("Pod") == ["plain-0", "plain-1"]
    assert unlabelled.kube.names("Workload") == []
    kube = FakeKube()
    job = queued_job()
    asyncio.run(Reconciler(kube).reconcile(JobState(job["metadata"]["uid"]), job, [], set(), None))
    assert kube.names("Pod") == ["llm-0", "llm-1"]
