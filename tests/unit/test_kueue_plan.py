"""Queueing with Kueue, without a cluster: the Workload and the status writes built as whole
objects, and a queued job's passes against the fake API while a stand-in for Kueue admits,
evicts and re-admits its Workload the way Kueue's scheduler writes the status."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass
from datetime import datetime

import pytest
from accelerate_operator.api import parse_job
from accelerate_operator.kueue import KueueVersionError, KueueView, choose_kueue_version
from accelerate_operator.kueue.placement import Placement, with_placement
from accelerate_operator.kueue.workload import (
    TopologyError,
    read_topology_assignment,
    read_workload,
)
from accelerate_operator.kueue.writes import build_quota_release, build_workload
from accelerate_operator.reconciler import Reconciler
from accelerate_operator.resources.pods import build_pod
from accelerate_operator.state import JobState

from tests.helpers.fake_kube import FakeKube
from tests.helpers.jobs import JobBuilder
from tests.helpers.kueue_crds import read_priority_class

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


# ---- Kueue's releases, as modelled from its source -------------------------------------------
#
# Written from kubernetes-sigs/kueue (no Kueue can run here: the Go module proxy refuses it):
# - served versions: config/components/crd/bases/kueue.x-k8s.io_workloads.yaml and CHANGELOG
#   (v1beta2 added in v0.15 with v1beta1 still served; CHANGELOG-0.20: v1beta1 no longer
#   served). The API server's discovery document prefers the highest version priority, v1beta2.
# - the priority class: apis/kueue/v1beta1/workload_types.go `priorityClassName` +
#   `priorityClassSource`; apis/kueue/v1beta2/workload_types.go `priorityClassRef`
#   {group, kind, name} (v0.15+).
# - deactivation: pkg/workload/workload.go (v0.9+): Kueue sets DeactivationTarget True with the
#   cause (RequeuingLimitExceeded, MaximumExecutionTimeExceeded, AdmissionCheck), turns
#   spec.active false, then evicts with reason "Deactivated" + "DueTo" + the cause
#   (pkg/controller/core/workload_controller.go); a Workload the user deactivated is evicted
#   with reason "Deactivated" alone.
# - PodsReady: pkg/controller/jobframework/reconciler.go (v0.14+) reasons Started, WaitForStart,
#   WaitForRecovery, Recovered (apis/kueue/v1beta1/workload_types.go constants).
# - TAS: apis/kueue/v1beta1/workload_types.go TopologyAssignment {levels, domains[{values,
#   count}]}; v1beta2 (v0.15+) keeps the assignment in a compressed form of its own.
@dataclass(frozen=True)
class KueueRelease:
    tag: str
    served: tuple[str, ...]  # API versions of kueue.x-k8s.io, in the server's priority order

    def api_group(self) -> dict:
        """`GET /apis/kueue.x-k8s.io` on a cluster running this release."""
        versions = [{"groupVersion": f"kueue.x-k8s.io/{v}", "version": v} for v in self.served]
        return {"kind": "APIGroup", "apiVersion": "v1", "name": "kueue.x-k8s.io",
                "versions": versions, "preferredVersion": versions[0]}

    @property
    def workload_version(self) -> str:
        return self.served[0]


RELEASES = [KueueRelease("v0.14", ("v1beta1",)), KueueRelease("v0.15", ("v1beta2", "v1beta1")),
            KueueRelease("v0.19", ("v1beta2", "v1beta1")), KueueRelease("v0.20", ("v1beta2",))]


# ---- version discovery ------------------------------------------------------------------------

@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.tag)
def test_the_workload_version_is_v1beta2_wherever_served_else_v1beta1(release):
    assert choose_kueue_version(release.api_group()) == release.workload_version


def test_no_kueue_means_no_version_and_an_unknown_one_is_an_error_naming_it():
    assert choose_kueue_version(None) is None
    assert choose_kueue_version({"kind": "APIGroup", "versions": []}) is None
    with pytest.raises(KueueVersionError, match="in v1; .*v1beta2 or v1beta1"):
        choose_kueue_version({"versions": [{"version": "v1"}]})


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
                     "annotations": {"accelerate-operator.io/requested-active": "true"},
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
    assert read_priority_class(workload) == "high"  # as Kueue reads it


def test_a_v1beta2_workload_names_its_priority_class_by_reference():
    job = parse_job(queued_job(priority="high"))
    v1beta1 = build_workload(job, "team-a", "high", 1000)
    workload = build_workload(job, "team-a", "high", 1000, "v1beta2")
    assert workload["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    spec = {k: v for k, v in v1beta1["spec"].items()
            if k not in ("priorityClassName", "priorityClassSource")}
    assert workload["spec"] == {**spec, "priorityClassRef": {
        "group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "high"}}
    assert workload["metadata"] == v1beta1["metadata"]
    assert read_priority_class(workload) == "high"


def test_a_suspended_job_gets_an_inactive_workload_without_priority_fields():
    workload = build_workload(parse_job(queued_job(suspend=True)), "team-a")
    assert workload["spec"]["active"] is False
    assert "priority" not in workload["spec"]


def test_admitted_flavors_join_the_pods_node_selector_and_tolerations():
    pod = build_pod(parse_job(queued_job()), 1, 0)
    pod["spec"]["nodeSelector"] = {"zone": "a"}
    placed = with_placement(pod, Placement(GPU_FLAVOR["nodeLabels"],
                                           tuple(GPU_FLAVOR["tolerations"])), 1)
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


def test_releasing_an_evicted_workloads_quota_is_a_merge_patch_with_the_resource_version():
    """pkg/workload/workload.go UnsetQuotaReservationWithCondition + SetRequeuedCondition
    (v0.14 to v0.20), written as a JSON merge patch: `admission: null` removes the admission,
    the whole condition list is repeated (a merge patch replaces lists), and nothing else is
    named, so admissionChecks and requeueState stay as Kueue left them."""
    later = "2026-01-01T12:05:00Z"
    workload = evicted_workload()
    workload["status"]["admissionChecks"] = [{"name": "prov", "state": "Ready"}]
    release = build_quota_release(workload, later)
    message = "Preempted to accommodate a workload"
    assert release == {
        "metadata": {"resourceVersion": "7"},
        "status": {
            "admission": None,
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
        },
    }


def test_a_workload_view_reads_admission_eviction_and_flavors():
    view = read_workload(evicted_workload())
    assert (view.admitted, view.reserved, view.cluster_queue, view.flavors) == (
        True, True, "cq", ("default",))
    assert view.evicted.reason == "Preempted"


# ---- passes against the fake API, with a stand-in for Kueue ---------------------------------

class Queue:
    """The fake API plus the job and its Workload, and Kueue's writes to the Workload."""

    def __init__(self, body: dict, release: KueueRelease = RELEASES[0]):
        self.kube = FakeKube()
        self.kube.kueue_objects[("resourceflavors", "gpu")] = {"spec": GPU_FLAVOR}
        self.body = body
        self.release = release
        self.reconciler = Reconciler(self.kube)
        self.state = JobState(body["metadata"]["uid"])

    def reconcile(self) -> float | None:
        """One pass; returns when it asks to be run again (None: on the next event)."""
        workloads = [o for (kind, _), o in self.kube.objects.items() if kind == "Workload"]
        context = KueueView(workload=copy.deepcopy(workloads[0]) if workloads else None,
                            version=choose_kueue_version(self.release.api_group()))
        again = asyncio.run(self.reconciler.reconcile(self.state, self.body, self.kube.pods(),
                                                      self.kube.children(), context))
        for status in self.kube.statuses:
            self.body.setdefault("status", {}).update(status)
        self.kube.statuses.clear()
        return again

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

    def evict(self, reason: str = "Preempted",
              message: str = "Preempted to accommodate a higher priority") -> None:
        status = self.kube.workload()["status"]
        status["conditions"] = [c for c in status["conditions"] if c["type"] != "Evicted"] + [
            condition("Evicted", True, reason, message)]

    def deactivate(self, cause: str, message: str) -> None:
        """Kueue's workload controller deactivating (pkg/workload, v0.9+): DeactivationTarget
        first, then spec.active false, then the eviction "DeactivatedDueTo<cause>"."""
        workload = self.kube.workload()
        status = workload.setdefault("status", {})
        status["conditions"] = [c for c in status.get("conditions") or []
                                if c["type"] != "DeactivationTarget"] + [
            condition("DeactivationTarget", True, cause, message)]
        workload["spec"]["active"] = False
        self.evict(f"DeactivatedDueTo{cause}", message)

    def reactivate(self) -> None:
        """What a user does to a Workload Kueue deactivated (Kueue's docs): spec.active true;
        Kueue drops DeactivationTarget and queues it again."""
        workload = self.kube.workload()
        workload["spec"]["active"] = True
        status = workload["status"]
        status["conditions"] = [c for c in status["conditions"]
                                if c["type"] != "DeactivationTarget"]

    def run_admitted(self) -> None:
        """The Workload made, Kueue admits it, the group is created and both pods run."""
        self.reconcile()
        self.admit()
        self.reconcile()
        for name in ("llm-0", "llm-1"):
            self.kube.set_pod_phase(name, "Running")
        self.reconcile()

    def pods_ready(self) -> tuple[str, str]:
        return self.conditions("PodsReady")["PodsReady"]


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


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.tag)
def test_an_evicted_job_stops_its_group_releases_the_quota_and_restarts_when_readmitted(release):
    queue = Queue(queued_job(backoffLimit=0), release)
    queue.run_admitted()
    assert queue.status("phase") == "Running"
    assert queue.kube.workload()["apiVersion"] == f"kueue.x-k8s.io/{release.workload_version}"
    assert queue.pods_ready() == ("True", "Started")

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
    assert ("apply", "Workload", "kueue-admission") not in queue.kube.calls  # never Kueue's
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
    queue.evict("Deactivated", "The workload is deactivated")  # Kueue evicts it ...
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


# ---- Kueue's deactivations -------------------------------------------------------------------

@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.tag)
@pytest.mark.parametrize("cause,message", [
    ("RequeuingLimitExceeded",
     "The workload is deactivated due to exceeding the maximum number of re-queuing retries"),
    ("MaximumExecutionTimeExceeded",
     "The workload is deactivated due to exceeding the maximum execution time"),
    ("AdmissionCheck", "Admission check(s): [prov], were rejected"),
])
def test_a_workload_kueue_deactivated_stays_inactive_and_the_job_is_held_saying_why(
        release, cause, message):
    queue = Queue(queued_job(), release)
    queue.run_admitted()
    queue.deactivate(cause, message)
    queue.reconcile()  # the group stops ...
    queue.reconcile()  # ... the quota goes back ...
    queue.reconcile()  # ... and the job stays held
    assert queue.kube.workload()["spec"]["active"] is False  # Kueue's decision kept
    assert not [c for c in queue.kube.calls if c[:2] == ("patch", "Workload")]
    assert "admission" not in queue.kube.workload()["status"]
    assert queue.kube.names("Pod") == []
    assert queue.status("phase") == "Queued"
    held = next(c for c in queue.status("conditions") if c["type"] == "Queued")
    assert held["reason"] == f"DeactivatedDueTo{cause}"
    assert message in held["message"] and "kubectl patch workload" in held["message"]
    warnings = [e for e in queue.kube.events if e.type == "Warning"]
    assert [e.reason for e in warnings] == [f"DeactivatedDueTo{cause}"]  # once, not per pass

    queue.reactivate()  # the user turns it back on; Kueue admits it again
    queue.admit()
    queue.reconcile()
    assert queue.kube.names("Pod") == ["llm-0", "llm-1"]
    assert queue.status("restarts") == 0


def test_a_users_suspend_and_resume_after_a_kueue_deactivation_reactivate_the_workload():
    queue = Queue(queued_job())
    queue.reconcile()
    queue.deactivate("RequeuingLimitExceeded", "too many retries")
    queue.reconcile()
    assert queue.kube.workload()["spec"]["active"] is False
    queue.body["spec"]["runPolicy"]["suspend"] = True
    queue.reconcile()
    assert queue.status("phase") == "Suspended"
    assert queue.kube.workload()["metadata"]["annotations"] == {
        "accelerate-operator.io/requested-active": "false"}
    queue.body["spec"]["runPolicy"]["suspend"] = False
    queue.reconcile()
    assert queue.kube.workload()["spec"]["active"] is True


def test_a_workload_made_inactive_by_someone_else_is_read_as_deactivated():
    workload = evicted_workload()
    workload["spec"] = {"active": False}
    workload["metadata"]["annotations"] = {"accelerate-operator.io/requested-active": "true"}
    assert read_workload(workload).deactivated.reason == "Deactivated"
    workload["metadata"]["annotations"]["accelerate-operator.io/requested-active"] = "false"
    assert read_workload(workload).deactivated is None  # the user's own suspend


# ---- PodsReady with Kueue's reasons ----------------------------------------------------------

def test_pods_ready_is_started_then_wait_for_recovery_after_a_failure_then_recovered():
    queue = Queue(queued_job(backoffLimit=3))
    queue.reconcile()
    queue.admit()
    queue.reconcile()
    queue.reconcile()
    assert "PodsReady" not in queue.conditions("PodsReady")  # Kueue's own: unset until ready
    for name in ("llm-0", "llm-1"):
        queue.kube.set_pod_phase(name, "Running")
    queue.reconcile()
    assert queue.pods_ready() == ("True", "Started")
    queue.kube.set_pod_phase("llm-1", "Failed", exit_code=1)
    queue.reconcile()  # the group restarts: Kueue must not time this from the admission
    assert queue.status("restarts") == 1
    assert queue.pods_ready() == ("False", "WaitForRecovery")
    queue.reconcile()
    for name in ("llm-0", "llm-1"):
        queue.kube.set_pod_phase(name, "Running")
    queue.reconcile()
    assert queue.pods_ready() == ("True", "Recovered")
    writes = len(queue.kube.calls)
    queue.reconcile()
    assert queue.pods_ready() == ("True", "Recovered")
    assert ("apply", "Workload", "accelerate-operator-PodsReady") not in queue.kube.calls[writes:]


def test_pods_ready_waits_for_start_again_under_a_new_admission():
    queue = Queue(queued_job())
    queue.run_admitted()
    queue.evict()
    queue.reconcile()
    queue.reconcile()
    ready = queue.kube.workload()["status"]["conditions"]
    for c in ready:  # Kueue re-admits later than the group was ready
        if c["type"] == "PodsReady":
            c["lastTransitionTime"] = "2026-01-01T11:00:00Z"
    queue.admit()
    queue.reconcile()
    assert queue.pods_ready() == ("False", "WaitForStart")


# ---- the quota release: never Kueue's manager, never a stale write -------------------------

def test_the_quota_release_keeps_admission_checks_and_a_stale_one_changes_nothing():
    queue = Queue(queued_job())
    queue.reconcile()
    queue.admit()
    queue.kube.workload()["status"]["admissionChecks"] = [
        {"name": "prov", "state": "Ready", "message": "", "lastTransitionTime": STAMP}]
    queue.reconcile()
    queue.evict()
    queue.reconcile()
    real_patch = queue.kube.patch_workload_status

    async def changed_meanwhile(namespace, name, patch):
        queue.kube._bump(queue.kube.workload())  # Kueue wrote after our read
        await real_patch(namespace, name, patch)

    queue.kube.patch_workload_status = changed_meanwhile
    queue.reconcile()
    assert ("conflict", "Workload", "acceleratejob-llm-uid-llm") in queue.kube.calls
    assert "admission" in queue.kube.workload()["status"]  # nothing written
    queue.kube.patch_workload_status = real_patch
    queue.reconcile()  # the next pass, from the newer Workload
    status = queue.kube.workload()["status"]
    assert "admission" not in status
    assert status["admissionChecks"][0]["name"] == "prov"


# ---- admission checks' pod-set updates and topology ------------------------------------------

def admitted_with(queue: Queue, **assignment) -> None:
    queue.reconcile()
    queue.admit()
    queue.kube.workload()["status"]["admission"]["podSetAssignments"][0].update(assignment)


def test_admission_check_pod_set_updates_reach_every_pod():
    queue = Queue(queued_job())
    admitted_with(queue)
    queue.kube.workload()["status"]["admissionChecks"] = [{
        "name": "prov", "state": "Ready", "podSetUpdates": [{
            "name": "main",
            "labels": {"provisioned": "yes"},
            "annotations": {"cluster-autoscaler.kubernetes.io/consume-provisioning-request":
                            "prov-req-1"},
            "nodeSelector": {"pool": "reserved"},
            "tolerations": [{"key": "reserved", "operator": "Exists"}]}]}]
    queue.reconcile()
    assert queue.kube.names("Pod") == ["llm-0", "llm-1"]
    for name in ("llm-0", "llm-1"):
        pod = queue.kube.objects[("Pod", name)]
        assert pod["metadata"]["labels"]["provisioned"] == "yes"
        assert pod["metadata"]["annotations"][
            "cluster-autoscaler.kubernetes.io/consume-provisioning-request"] == "prov-req-1"
        assert pod["spec"]["nodeSelector"] == {"cloud.example.com/gpu": "a100",
                                               "pool": "reserved"}
        assert pod["spec"]["tolerations"] == GPU_FLAVOR["tolerations"] + [
            {"key": "reserved", "operator": "Exists"}]


def test_an_admission_check_conflicting_with_the_flavor_fails_the_job_loudly():
    queue = Queue(queued_job())
    admitted_with(queue)
    queue.kube.workload()["status"]["admissionChecks"] = [{
        "name": "prov", "state": "Ready",
        "podSetUpdates": [{"name": "main", "nodeSelector": {"cloud.example.com/gpu": "h100"}}]}]
    queue.reconcile()
    assert queue.kube.names("Pod") == []
    assert queue.status("phase") == "Failed"
    failed = next(c for c in queue.status("conditions") if c["type"] == "Failed")
    assert failed["reason"] == "AdmissionNotApplicable"
    assert "'prov'" in failed["message"] and "'h100'" in failed["message"]
    assert "'a100'" in failed["message"]
    assert queue.kube.events[-1].type == "Warning"
    queue.reconcile()
    assert queue.conditions("Finished") == {"Finished": ("True", "Failed")}  # quota freed


def test_a_topology_assignment_pins_each_pod_to_its_domain():
    queue = Queue(queued_job())
    admitted_with(queue, topologyAssignment={
        "levels": ["cloud.example.com/block", "kubernetes.io/hostname"],
        "domains": [{"values": ["b1", "node-a"], "count": 1},
                    {"values": ["b1", "node-b"], "count": 1}]})
    queue.reconcile()
    selectors = [queue.kube.objects[("Pod", f"llm-{i}")]["spec"]["nodeSelector"]
                 for i in (0, 1)]
    assert selectors == [
        {"cloud.example.com/gpu": "a100", "cloud.example.com/block": "b1",
         "kubernetes.io/hostname": "node-a"},
        {"cloud.example.com/gpu": "a100", "cloud.example.com/block": "b1",
         "kubernetes.io/hostname": "node-b"}]
    pod = queue.kube.objects[("Pod", "llm-0")]
    assert "schedulingGates" not in pod["spec"]  # placed at creation, nothing to ungate


def test_a_topology_assignment_in_a_form_not_read_refuses_the_job():
    workload = evicted_workload()
    workload["status"]["admission"]["podSetAssignments"][0]["topologyAssignment"] = {
        "levels": ["kubernetes.io/hostname"], "slices": [{"domainCount": 2}]}
    with pytest.raises(TopologyError, match=r"keys \['levels', 'slices'\]"):
        read_topology_assignment(workload, 2)
    queue = Queue(queued_job())
    admitted_with(queue, topologyAssignment={"levels": ["kubernetes.io/hostname"],
                                             "domains": [{"values": ["a"], "count": 1}]})
    queue.reconcile()
    failed = next(c for c in queue.status("conditions") if c["type"] == "Failed")
    assert "places 1 pod(s), the job has 2 node(s)" in failed["message"]


def test_the_quota_of_an_evicted_job_is_kept_while_its_pods_are_still_terminating():
    """A pod in its grace period (saving a checkpoint) still holds its node's CPU and memory:
    the quota goes back once it is gone, so the next admitted group never shares the nodes."""
    queue = Queue(queued_job())
    queue.run_admitted()
    running = {key: copy.deepcopy(o) for key, o in queue.kube.objects.items() if key[0] == "Pod"}
    queue.evict()
    queue.reconcile()  # deletes the group; the fake deletes at once: put them back, terminating
    for key, pod in running.items():
        pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        queue.kube.objects[key] = pod
    queue.reconcile()
    assert queue.kube.workload()["status"].get("admission")  # still reserved
    assert queue.conditions("QuotaReserved")["QuotaReserved"][0] == "True"
    for key in running:
        del queue.kube.objects[key]
    queue.reconcile()
    assert "admission" not in queue.kube.workload()["status"]
    assert queue.conditions("QuotaReserved")["QuotaReserved"] == ("False", "Pending")


def test_an_admission_naming_a_flavor_that_is_gone_waits_and_says_why():
    """Kueue admitted the Workload with ResourceFlavor gpu, deleted since: no pod is made
    (where it belongs is not known), the job says why once, and starts when the flavor is
    back."""
    queue = Queue(queued_job())
    del queue.kube.kueue_objects[("resourceflavors", "gpu")]
    queue.reconcile()
    queue.admit()
    assert queue.reconcile() == 2.0  # nothing watches ResourceFlavors: looked at again soon
    queue.reconcile()
    assert queue.kube.names("Pod") == []
    assert queue.status("phase") == "Queued"
    queued = {c["type"]: c for c in queue.status("conditions")}["Queued"]
    assert (queued["status"], queued["reason"]) == ("True", "FlavorNotFound")
    assert "ResourceFlavor gpu, which does not exist" in queued["message"]
    warnings = [e for e in queue.kube.events if e.reason == "FlavorNotFound"]
    assert [e.type for e in warnings] == ["Warning"]

    queue.kube.kueue_objects[("resourceflavors", "gpu")] = {"spec": GPU_FLAVOR}
    queue.reconcile()
    assert queue.kube.names("Pod") == ["llm-0", "llm-1"]
    assert queue.status("phase") == "Pending"
    assert "Admitted" in [e.reason for e in queue.kube.events]
