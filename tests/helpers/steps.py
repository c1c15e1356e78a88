"""Step tables for the operator as it runs against the real API server (model: jobset's
test/integration/controller/jobset_controller_test.go): each step is an action on the cluster
(create the job, set a pod's state, evict it, suspend the job, admit its Workload...) and what
the job and its children must then show. The pods never run: the job's template names a
scheduler no cluster has (`JobBuilder.unscheduled`), so no node takes them, and a step sets
their status through the pods' `status` subresource, as a kubelet would. Everything is read
and written through the API server (the official client), nothing of the operator's own."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import kubernetes
from accelerate_trainer.contract import REPORT_BODY_KEY
from kubernetes.client.rest import ApiException

from devtools.cluster import wait_for
from tests.helpers.jobs import JobBuilder
from tests.helpers.report_post import job_ca, pod_token, post

GROUP, VERSION, PLURAL = "accelerate-operator.io", "v1alpha1", "acceleratejobs"
JOB_LABEL = "accelerate-operator.io/job-name"
ATTEMPT_LABEL = "accelerate-operator.io/attempt"
RUN_ATTEMPT_ANNOTATION = "accelerate-operator.io/run-attempt"
KUEUE_GROUP = "kueue.x-k8s.io"
MERGE = "application/merge-patch+json"


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Cluster:
    """One namespace of the API server, through the official client."""

    def __init__(self, kubeconfig: str, namespace: str, kueue_version: str = "v1beta2",
                 report_port: int | None = None):
        self.kubeconfig, self.report_port = kubeconfig, report_port  # the operator's endpoint
        client = kubernetes.config.new_client_from_config(config_file=kubeconfig)
        self.core = kubernetes.client.CoreV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.admission = kubernetes.client.AdmissionregistrationV1Api(client)
        self.namespace = namespace
        self.kueue_version = kueue_version

    def job(self, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace,
                                                            PLURAL, name)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def patch_job(self, name: str, patch: Mapping[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                   name, patch)

    def pods(self, job: str) -> list[dict[str, Any]]:
        found = self.core.list_namespaced_pod(self.namespace, label_selector=f"{JOB_LABEL}={job}")
        return [self.core.api_client.sanitize_for_serialization(p) for p in found.items]

    def children(self, job: str) -> set[str]:
        """The job's ConfigMaps and Services, as `kind/name`."""
        selector = f"{JOB_LABEL}={job}"
        maps = self.core.list_namespaced_config_map(self.namespace, label_selector=selector)
        services = self.core.list_namespaced_service(self.namespace, label_selector=selector)
        return ({f"configmap/{c.metadata.name}" for c in maps.items}
                | {f"service/{s.metadata.name}" for s in services.items})

    def event_reasons(self, job: str) -> set[str]:
        found = self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={job}")
        return {e.reason for e in found.items}

    def workload(self, job: str) -> dict[str, Any] | None:
        found = self.custom.list_namespaced_custom_object(
            KUEUE_GROUP, self.kueue_version, self.namespace, "workloads",
            label_selector=f"{JOB_LABEL}={job}")["items"]
        return found[0] if found else None


# ---- actions -------------------------------------------------------------------------------

Action = Callable[[Cluster, str], None]


def create(builder: JobBuilder) -> Action:
    def act(cluster: Cluster, job: str) -> None:
        body = builder.for_server().build()
        body["metadata"].update(name=job, namespace=cluster.namespace)
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, cluster.namespace, PLURAL,
                                                       body)
    return act


def group_attempt(status: Mapping[str, Any]) -> int:
    """The attempt the job's current pods were created for (in-place restarts keep them)."""
    return int(status.get("groupAttempt", status.get("attempt", 0)))


def _current_pod(cluster: Cluster, job: str, index: int) -> dict[str, Any]:
    """Pod `index` of the job's current group (a step acts on no pod of an earlier one)."""
    attempt = str(group_attempt((cluster.job(job) or {}).get("status", {})))
    pod = next((p for p in cluster.pods(job) if p["metadata"]["name"] == f"{job}-{index}"), None)
    assert pod is not None, f"pod {job}-{index} does not exist"
    assert pod["metadata"]["labels"][ATTEMPT_LABEL] == attempt, (
        f"pod {job}-{index} is of attempt {pod['metadata']['labels'][ATTEMPT_LABEL]}, "
        f"the job's is {attempt}")
    return pod


def _set_status(cluster: Cluster, job: str, index: int, status: Mapping[str, Any]) -> None:
    pod = _current_pod(cluster, job, index)
    cluster.core.patch_namespaced_pod_status(pod["metadata"]["name"], cluster.namespace,
                                             {"status": status}, _content_type=MERGE)


def _container(pod: Mapping[str, Any], state: Mapping[str, Any], ready: bool) -> dict:
    container = pod["spec"]["containers"][0]
    return {"name": container["name"], "image": container["image"], "imageID": "",
            "ready": ready, "restartCount": 0, "started": ready, "state": dict(state)}


def pods_running(*indexes: int) -> Action:
    """The pods started and are ready, as the kubelet reports it."""
    def act(cluster: Cluster, job: str) -> None:
        for index in indexes:
            pod = _current_pod(cluster, job, index)
            at = now()
            _set_status(cluster, job, index, {
                "phase": "Running", "startTime": at,
                "conditions": [{"type": t, "status": "True", "lastTransitionTime": at}
                               for t in ("PodScheduled", "Initialized", "ContainersReady",
                                         "Ready")],
                "containerStatuses": [_container(pod, {"running": {"startedAt": at}}, True)]})
    return act


def pod_waits(index: int, reason: str, message: str) -> Action:
    """The kubelet cannot start the pod's container (ErrImagePull, CreateContainerConfigError...),
    as it reports it: scheduled, the container waiting with its reason and message."""
    def act(cluster: Cluster, job: str) -> None:
        pod = _current_pod(cluster, job, index)
        at = now()
        _set_status(cluster, job, index, {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": at},
                           {"type": "Ready", "status": "False", "reason": "ContainersNotReady",
                            "lastTransitionTime": at}],
            "containerStatuses": [_container(pod, {"waiting": {"reason": reason,
                                                               "message": message}}, False)]})
    return act


def pod_unschedulable(index: int, message: str) -> Action:
    """The scheduler found no node for the pod, as it reports it."""
    def act(cluster: Cluster, job: str) -> None:
        _set_status(cluster, job, index, {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": message, "lastTransitionTime": now()}]})
    return act


def pod_exits(index: int, code: int, message: str = "") -> Action:
    """The pod's container ended with `code` (restartPolicy Never: the pod ends with it)."""
    def act(cluster: Cluster, job: str) -> None:
        pod = _current_pod(cluster, job, index)
        at = now()
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                      "message": message, "startedAt": at, "finishedAt": at}
        _set_status(cluster, job, index, {
            "phase": "Succeeded" if code == 0 else "Failed",
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": at}],
            "containerStatuses": [_container(pod, {"terminated": terminated}, False)]})
    return act


def launch_fails(index: int, code: int, message: str = "") -> Action:
    """Pod `index`'s supervisor reports that its launch of the job's current attempt ended
    with `code`, as accelerate_trainer.supervise sends it: a POST to the operator's report
    endpoint (on cluster.report_port), with a token bound to the pod; the pod runs on."""
    def act(cluster: Cluster, job: str) -> None:
        pod = _current_pod(cluster, job, index)
        attempt = (cluster.job(job) or {}).get("status", {}).get("attempt", 0)
        report = {"progress": None, "lastOutputTime": None, "attempt": attempt, "exit": {
            "attempt": attempt, "exitCode": code, "time": now(), "message": message}}
        token = pod_token(cluster.kubeconfig, cluster.namespace, pod["metadata"]["name"],
                          pod["metadata"]["uid"])
        ca = job_ca(cluster.kubeconfig, cluster.namespace, job)
        answer = post(cluster.report_port, ca, cluster.namespace, job, token,
                      {REPORT_BODY_KEY: report})
        assert answer[0] == 200, answer
    return act


def pods_succeed(*indexes: int) -> Action:
    def act(cluster: Cluster, job: str) -> None:
        for index in indexes:
            pod_exits(index, 0)(cluster, job)
    return act


def evict(index: int) -> Action:
    """What `kubectl drain` does to each pod of the node: the Eviction API."""
    def act(cluster: Cluster, job: str) -> None:
        name = _current_pod(cluster, job, index)["metadata"]["name"]
        cluster.core.create_namespaced_pod_eviction(name, cluster.namespace, {
            "apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": name, "namespace": cluster.namespace}})
    return act


def disrupt(index: int, reason: str = "PreemptionByScheduler") -> Action:
    """The DisruptionTarget condition Kubernetes puts on a pod it is about to end for reasons
    of its own (preemption, the taint manager, node shutdown)."""
    def act(cluster: Cluster, job: str) -> None:
        pod = _current_pod(cluster, job, index)
        conditions = [c for c in pod["status"].get("conditions") or []
                      if c["type"] != "DisruptionTarget"]
        conditions.append({"type": "DisruptionTarget", "status": "True", "reason": reason,
                           "message": f"{reason}: the pod is being ended",
                           "lastTransitionTime": now()})
        _set_status(cluster, job, index, {"conditions": conditions})
    return act


def ghost_node(cluster: Cluster, name: str) -> None:
    """A Node object with no kubelet behind it, Ready as a kubelet would report it, tainted and
    cordoned so the scheduler places nothing on it: pods get there only by a step's binding."""
    cluster.core.create_node({"metadata": {"name": name}, "spec": {
        "unschedulable": True,
        "taints": [{"key": "accelerate-operator.io/test", "effect": "NoSchedule"}]}})
    node_ready(cluster, name, "True", now())


def node_ready(cluster: Cluster, name: str, ready: str, since: str) -> None:
    cluster.core.patch_node_status(name, {"status": {"conditions": [
        {"type": "Ready", "status": ready, "reason": "KubeletReady" if ready == "True"
         else "NodeStatusUnknown", "lastHeartbeatTime": since, "lastTransitionTime": since}]}})


def bind(node: str, *indexes: int) -> Action:
    """The pods are placed on `node` (the binding a scheduler posts)."""
    def act(cluster: Cluster, job: str) -> None:
        for index in indexes:
            name = _current_pod(cluster, job, index)["metadata"]["name"]
            cluster.core.create_namespaced_binding(cluster.namespace, {
                "metadata": {"name": name},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}},
                _preload_content=False)
    return act


def node_lost(node: str, seconds_ago: int) -> Action:
    """The node controller stopped hearing from the node's kubelet `seconds_ago`: the node's
    Ready goes Unknown, and every pod on it goes not Ready (MarkPodsNotReady). The operator may
    restart the group (deleting its pods) between the node's write and a pod's."""
    def act(cluster: Cluster, job: str) -> None:
        since = datetime.now(timezone.utc) - timedelta(seconds=seconds_ago)
        node_ready(cluster, node, "Unknown", since.strftime("%Y-%m-%dT%H:%M:%SZ"))
        for pod in cluster.pods(job):
            if pod["spec"].get("nodeName") != node:
                continue
            conditions = [{**c, "status": "False"} if c["type"] == "Ready" else c
                          for c in pod["status"].get("conditions") or []]
            try:
                cluster.core.patch_namespaced_pod_status(
                    pod["metadata"]["name"], cluster.namespace,
                    {"status": {"conditions": conditions}}, _content_type=MERGE)
            except ApiException as error:
                if error.status != 404:  # the operator, seeing the node lost, deleted it first
                    raise
    return act


def delete_pod(index: int) -> Action:
    def act(cluster: Cluster, job: str) -> None:
        cluster.core.delete_namespaced_pod(f"{job}-{index}", cluster.namespace)
    return act


def delete_configmap(suffix: str = "-accelerate-config") -> Action:
    def act(cluster: Cluster, job: str) -> None:
        cluster.core.delete_namespaced_config_map(f"{job}{suffix}", cluster.namespace)
    return act


def suspend(value: bool = True) -> Action:
    def act(cluster: Cluster, job: str) -> None:
        cluster.patch_job(job, {"spec": {"runPolicy": {"suspend": value}}})
    return act


def delete_job() -> Action:
    def act(cluster: Cluster, job: str) -> None:
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.namespace, PLURAL,
                                                       job, propagation_policy="Background")
    return act


def nothing() -> Action:
    """Only time passes (a deadline, a TTL)."""
    return lambda cluster, job: None


def _webhook_name(cluster: Cluster) -> str:
    return f"accelerate-steps-down-{cluster.namespace}"


def pod_webhook_down() -> Action:
    """A validating webhook on pod creation in this namespace whose service is gone, failing
    closed: every pod creation is answered with the API server's 500."""
    def act(cluster: Cluster, job: str) -> None:
        cluster.admission.create_validating_webhook_configuration({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": _webhook_name(cluster)},
            "webhooks": [{
                "name": "down.steps.accelerate-operator.io", "admissionReviewVersions": ["v1"],
                "sideEffects": "None", "failurePolicy": "Fail", "timeoutSeconds": 1,
                "namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": cluster.namespace}},
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                           "resources": ["pods"]}],
                "clientConfig": {"service": {"namespace": cluster.namespace,
                                             "name": "no-such-webhook", "port": 443}}}]})
    return act


def pod_webhook_back() -> Action:
    def act(cluster: Cluster, job: str) -> None:
        remove_pod_webhook(cluster)
    return act


def remove_pod_webhook(cluster: Cluster) -> None:
    try:
        cluster.admission.delete_validating_webhook_configuration(_webhook_name(cluster))
    except ApiException as error:
        if error.status != 404:
            raise


def _workload_conditions(cluster: Cluster, job: str, **conditions: tuple[str, str]) -> None:
    """Kueue's side: set conditions (type=(status, reason)) on the job's Workload."""
    workload = cluster.workload(job)
    assert workload is not None, f"job {job} has no Workload"
    kept = {c["type"]: c for c in (workload.get("status") or {}).get("conditions") or []}
    for type_, (status, reason) in conditions.items():
        kept[type_] = {"type": type_, "status": status, "reason": reason,
                       "message": f"{reason} (set by the test as Kueue would)",
                       "lastTransitionTime": now()}
    status: dict[str, Any] = {"conditions": list(kept.values())}
    if conditions.get("QuotaReserved", ("",))[0] == "True":
        count = workload["spec"]["podSets"][0]["count"]
        # The pods request no resources: Kueue assigns them no ResourceFlavor.
        status["admission"] = {"clusterQueue": "team-cq", "podSetAssignments": [
            {"name": workload["spec"]["podSets"][0]["name"], "count": count, "flavors": {}}]}
    cluster.custom.patch_namespaced_custom_object_status(
        KUEUE_GROUP, cluster.kueue_version, cluster.namespace, "workloads",
        workload["metadata"]["name"], {"status": status}, _content_type=MERGE)


def kueue_admits() -> Action:
    """Kueue reserves quota for every pod of the Workload and admits it."""
    def act(cluster: Cluster, job: str) -> None:
        _workload_conditions(cluster, job, QuotaReserved=("True", "QuotaReserved"),
                             Admitted=("True", "Admitted"), Evicted=("False", "QuotaReserved"))
    return act


def kueue_evicts(reason: str = "Preempted") -> Action:
    """Kueue evicts the admitted Workload (preempted by a higher priority, say)."""
    def act(cluster: Cluster, job: str) -> None:
        _workload_conditions(cluster, job, Evicted=("True", reason))
    return act


# ---- expectations ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Expect:
    """What the job must show after a step. `pods`: how many of its pods exist, not being
    deleted, every one of the job's current attempt. `reasons`: condition type -> reason of a
    condition that is True. `events`: reasons among the job's events. `workload`: Workload
    condition type -> status (None: the Workload exists, without that condition)."""

    phase: str | None = None
    attempt: int | None = None
    restarts: int | None = None
    counted: int | None = None
    reasons: Mapping[str, str] = field(default_factory=dict)
    pods: int | None = None
    children: Sequence[str] = ()
    events: Sequence[str] = ()
    workload: Mapping[str, str] = field(default_factory=dict)
    evictions: int | None = None
    gone: bool = False
    told: int | None = None  # the attempt every live pod was told to run (in place)

    def mismatches(self, cluster: Cluster, job: str) -> list[str]:
        body = cluster.job(job)
        if self.gone:
            left = [p["metadata"]["name"] for p in cluster.pods(job)]
            return ([f"job {job} still exists"] if body else []) + (
                [f"pods left: {left}"] if left else [])
        if body is None:
            return [f"job {job} does not exist"]
        status = body.get("status") or {}
        wrong = [f"{key}={status.get(key)!r}, want {want!r}" for key, want in (
            ("phase", self.phase), ("attempt", self.attempt), ("restarts", self.restarts),
            ("restartsCounted", self.counted)) if want is not None and status.get(key) != want]
        true = {c["type"]: c["reason"] for c in status.get("conditions") or []
                if c["status"] == "True"}
        wrong += [f"condition {t} reason {true.get(t)!r}, want {r!r}"
                  for t, r in self.reasons.items() if true.get(t) != r]
        if self.evictions is not None and (status.get("queue") or {}).get(
                "evictions", 0) != self.evictions:
            wrong.append(f"queue {status.get('queue')}, want {self.evictions} evictions")
        return wrong + self._children(cluster, job, status)

    def _children(self, cluster: Cluster, job: str, status: Mapping[str, Any]) -> list[str]:
        wrong = []
        if self.pods is not None:
            live = [p for p in cluster.pods(job) if not p["metadata"].get("deletionTimestamp")]
            attempts = {p["metadata"]["labels"][ATTEMPT_LABEL] for p in live}
            if len(live) != self.pods or attempts - {str(group_attempt(status))}:
                wrong.append(f"{len(live)} pods of attempts {sorted(attempts)}, want "
                             f"{self.pods} of attempt {group_attempt(status)}")
        if self.told is not None:
            told = [(p["metadata"].get("annotations") or {}).get(RUN_ATTEMPT_ANNOTATION)
                    for p in cluster.pods(job) if not p["metadata"].get("deletionTimestamp")]
            if set(told) != {str(self.told)}:
                wrong.append(f"pods told attempts {told}, want {self.told}")
        missing = set(self.children) - cluster.children(job)
        wrong += [f"no {child}" for child in sorted(missing)]
        if self.events:
            seen = cluster.event_reasons(job)
            wrong += [f"no {reason} event (events: {sorted(seen)})"
                      for reason in self.events if reason not in seen]
        if self.workload:
            found = cluster.workload(job)
            if found is None:
                return [*wrong, f"job {job} has no Workload"]
            conditions = {c["type"]: c["status"]
                          for c in (found.get("status") or {}).get("conditions") or []}
            wrong += [f"Workload condition {t}={conditions.get(t)}, want {s}"
                      for t, s in self.workload.items() if conditions.get(t) != s]
        return wrong


Step = tuple[str, Action, Expect]


def run_steps(cluster: Cluster, job: str, steps: Sequence[Step], timeout: float = 30) -> None:
    """Each step's action, then its expectation polled until it holds; a failure names the
    step, what differs and the job's last status."""
    for number, (what, action, expect) in enumerate(steps, 1):
        action(cluster, job)
        _await(cluster, job, expect, f"step {number} ({what}) of job {job}", timeout)


def _await(cluster: Cluster, job: str, expect: Expect, step: str, timeout: float) -> None:
    started = time.monotonic()
    last: list[str] = []

    def holds() -> bool:
        nonlocal last
        last = expect.mismatches(cluster, job)
        return not last

    try:
        wait_for(holds, timeout=timeout, interval=0.2, description=step)
    except AssertionError:
        status = (cluster.job(job) or {}).get("status")
        raise AssertionError(f"{step}: after {time.monotonic() - started:.0f}s "
                             f"{'; '.join(last)}\nthe job's status: {status}") from None
