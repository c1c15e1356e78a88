"""What the operator writes to Kueue, built as whole objects: the job's Workload, and the writes
its status owes Kueue, as Kueue's own job integrations make them
(pkg/controller/jobframework/reconciler.go, pkg/workload/workload.go):
- after an eviction, once no pod of the job runs any more, the quota is released: QuotaReserved
  False (reason Pending), the admission cleared, Admitted False, Requeued set
  (`UnsetQuotaReservationWithCondition` + `SetRequeuedCondition`). It is written as a JSON merge
  patch on /status carrying the Workload's resourceVersion, never as Kueue's own field manager:
  a Workload changed since it was read answers 409 and the next pass decides again, and every
  field the patch does not name (admission checks, requeue state, gates) stays as Kueue left it;
- PodsReady follows the group with Kueue's reasons (Started, WaitForStart, WaitForRecovery,
  Recovered), Finished True frees the quota for good; both under the operator's own managers;
- spec.active follows the user's suspend, unless Kueue deactivated the Workload.

The Workload has one pod set, `main`, of numNodes pods: Kueue reserves quota for all of them at
once, or none. Its template is the pods' own (containers, init containers, overhead), so every
resource the pods request, GPUs included, is counted. Pure: the reconciler carries them out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..api import JobSpec
from ..constants import FINISHED_PHASES, RUNNING
from ..labels import job_labels
from ..naming import workload_name
from ..resources.pods import build_pod
from ..timefmt import format_time
from .workload import (
    KUEUE_API_VERSION,
    KUEUE_GROUP,
    KUEUE_VERSION,
    POD_SET,
    REQUESTED_ACTIVE_ANNOTATION,
    REQUEUED_REASONS,
    V1BETA1,
    WORKLOAD_PRIORITY_SOURCE,
    WorkloadStatus,
    api_version,
    conditions_by_type,
    pods_ready_reason,
    read_workload,
)

# The operator's own field managers for the Workload conditions it sets (Kueue's UpdateStatus
# names them <controller>-<condition>).
FINISHED_MANAGER = "accelerate-operator-Finished"
PODS_READY_MANAGER = "accelerate-operator-PodsReady"


@dataclass(frozen=True)
class WorkloadWrite:
    """One write to the job's Workload: `spec` a merge patch of spec.active (and the
    annotation recording it), `status-merge` a JSON merge patch of /status carrying the
    Workload's resourceVersion (409: the next pass decides again), `status` a server-side
    apply of the operator's own conditions under `manager` (the operator's, never Kueue's)."""

    name: str
    part: str  # "spec", "status-merge" or "status"
    body: dict[str, Any]
    manager: str = ""


def build_workload(job: JobSpec, queue: str, priority_class: str | None = None,
                   priority: int | None = None, version: str = KUEUE_VERSION) -> dict[str, Any]:
    """`priority` is the value of WorkloadPriorityClass `priority_class` (Kueue's jobframework
    copies it into the Workload the same way). `version` is the one the server serves: v1beta1
    names the class in spec.priorityClassName + priorityClassSource, v1beta2 in
    spec.priorityClassRef {group, kind, name} (apis/kueue/v1beta2/workload_types.go, v0.15+)."""
    pod = build_pod(job, 0, 0)
    template = {"metadata": {"labels": job_labels(job.name)}, "spec": pod["spec"]}
    active = not job.run_policy.suspend
    spec: dict[str, Any] = {
        "queueName": queue,
        "active": active,
        "podSets": [{"name": POD_SET, "count": job.num_nodes, "template": template}],
    }
    if priority_class:
        if version == V1BETA1:
            spec["priorityClassName"] = priority_class
            spec["priorityClassSource"] = WORKLOAD_PRIORITY_SOURCE
        else:
            spec["priorityClassRef"] = {"group": KUEUE_GROUP, "kind": "WorkloadPriorityClass",
                                        "name": priority_class}
        spec["priority"] = int(priority or 0)
    return {
        "apiVersion": api_version(version),
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job.name, job.uid),
            "namespace": job.namespace,
            "labels": job_labels(job.name),
            "annotations": {REQUESTED_ACTIVE_ANNOTATION: str(active).lower()},
            "ownerReferences": [job.owner_reference],
        },
        "spec": spec,
    }


def _set_condition(conditions: list[dict[str, Any]], type_: str, status: bool, reason: str,
                   message: str, now: str, generation: int) -> None:
    """apimeta.SetStatusCondition: the transition time moves only when the status changes."""
    wanted = "True" if status else "False"
    for condition in conditions:
        if condition.get("type") == type_:
            if condition.get("status") != wanted:
                condition["lastTransitionTime"] = now
            condition.update(status=wanted, reason=reason, message=message[:32768],
                             observedGeneration=generation)
            return
    conditions.append({"type": type_, "status": wanted, "reason": reason,
                       "message": message[:32768], "lastTransitionTime": now,
                       "observedGeneration": generation})


def build_quota_release(workload: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The JSON merge patch on /status that gives an evicted Workload's quota back:
    QuotaReserved False (Pending, with the eviction's message), `admission: null`, Admitted
    False, Requeued True after a preemption (False otherwise). `conditions` is a list, which a
    merge patch replaces whole: every condition the Workload has is repeated, changed or not.
    `metadata.resourceVersion` makes the server refuse (409) a write over a Workload changed
    since it was read. Nothing else is named, so admission checks, requeue state and the rest
    stay as they are (pkg/workload/workload.go UnsetQuotaReservationWithCondition)."""
    status = workload.get("status") or {}
    generation = int(workload["metadata"].get("generation") or 1)
    evicted = conditions_by_type(workload).get("Evicted") or {}
    reason, message = evicted.get("reason") or "Evicted", evicted.get("message") or ""
    conditions = [dict(c) for c in status.get("conditions") or []]
    _set_condition(conditions, "Requeued", reason in REQUEUED_REASONS, reason, message, now,
                   generation)
    _set_condition(conditions, "QuotaReserved", False, "Pending", message, now, generation)
    if any(c["type"] == "Admitted" for c in conditions):
        _set_condition(conditions, "Admitted", False, "NoReservation",
                       "The workload has no reservation", now, generation)
    return {"metadata": {"resourceVersion": workload["metadata"].get("resourceVersion")},
            "status": {"conditions": conditions, "admission": None}}


def build_active_patch(active: bool) -> dict[str, Any]:
    """The merge patch of the user's suspend: spec.active and, with it, the record of what the
    operator asked (REQUESTED_ACTIVE_ANNOTATION)."""
    return {"metadata": {"annotations": {REQUESTED_ACTIVE_ANNOTATION: str(active).lower()}},
            "spec": {"active": active}}


def build_condition_apply(workload: Mapping[str, Any], type_: str, status: bool, reason: str,
                          message: str, now: str) -> dict[str, Any]:
    """One condition, applied under a field manager of the operator's own (never Kueue's):
    Finished when the job ends, PodsReady as the group starts and stops. The apiVersion is
    the Workload's own, v1beta1 or v1beta2."""
    generation = int(workload["metadata"].get("generation") or 1)
    conditions: list[dict[str, Any]] = []
    _set_condition(conditions, type_, status, reason, message, now, generation)
    current = conditions_by_type(workload).get(type_)
    if current and current.get("status") == conditions[0]["status"]:
        conditions[0]["lastTransitionTime"] = current.get("lastTransitionTime", now)
    metadata = workload["metadata"]
    return {
        "apiVersion": workload.get("apiVersion", KUEUE_API_VERSION),
        "kind": "Workload",
        "metadata": {key: metadata[key] for key in ("name", "namespace", "uid")
                     if key in metadata},
        "status": {"conditions": conditions},
    }


def active_write(workload: WorkloadStatus, wants_active: bool) -> bool | None:
    """The spec.active to write, or None. Written only when the user's suspend differs from
    what the operator last asked (the Workload's requested-active annotation): a Workload Kueue
    deactivated stays deactivated until the user suspends and resumes the job, or reactivates
    the Workload. A Workload with no record (made by an older operator) is written when it
    differs, unless Kueue's conditions say Kueue deactivated it."""
    if workload.finished:
        return None
    if workload.requested_active is not None:
        return wants_active if workload.requested_active != wants_active else None
    if workload.active == wants_active or workload.deactivated is not None:
        return None
    return wants_active


def pods_ready_write(workload: WorkloadStatus, phase: str | None) -> bool | None:
    """PodsReady to set (True while the group runs), or None when it says so already."""
    running = phase == RUNNING
    if not workload.admitted or workload.finished or phase in FINISHED_PHASES:
        return None
    if workload.pods_ready is None and not running:
        return None
    if workload.pods_ready == running and \
            workload.pods_ready_reason == pods_ready_reason(workload, running)[0]:
        return None
    return running


def finished_write(workload: WorkloadStatus, status: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) of the Finished condition once the job has finished."""
    phase = status.get("phase")
    if phase not in FINISHED_PHASES or workload.finished:
        return None
    condition = next((c for c in status.get("conditions") or [] if c["type"] == phase), {})
    return phase, condition.get("message") or phase


def workload_writes(workload: Mapping[str, Any], job: JobSpec, status: Mapping[str, Any],
                    release: bool, now: datetime) -> tuple[WorkloadWrite, ...]:
    """What the job's Workload must be told after a pass that decided `status`: spec.active
    (the user's suspend), the quota back (`release`), PodsReady, Finished."""
    view, name, stamp = read_workload(workload), workload["metadata"]["name"], format_time(now)
    out = []
    active = active_write(view, not job.run_policy.suspend)
    if active is not None:
        out.append(WorkloadWrite(name, "spec", build_active_patch(active)))
    if release:
        out.append(WorkloadWrite(name, "status-merge", build_quota_release(workload, stamp)))
    ready = pods_ready_write(view, status.get("phase"))
    if ready is not None:
        reason, message = pods_ready_reason(view, ready)
        out.append(WorkloadWrite(name, "status", build_condition_apply(
            workload, "PodsReady", ready, reason, message, stamp), PODS_READY_MANAGER))
    finished = finished_write(view, status)
    if finished is not None:
        out.append(WorkloadWrite(name, "status", build_condition_apply(
            workload, "Finished", True, *finished, stamp), FINISHED_MANAGER))
    return tuple(out)
