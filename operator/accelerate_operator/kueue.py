"""Kueue's side of a queued job, read and written as plain dicts. Pure: no API calls.

A job labelled `kueue.x-k8s.io/queue-name` gets one Kueue Workload (resources/workload.py builds
it); Kueue reserves quota for all of its pods at once and says so in the Workload's status. This
module reads that status into a `WorkloadView` the planner decides on, and builds the two status
writes the operator owes Kueue, as Kueue's own job integrations make them
(pkg/controller/jobframework/reconciler.go, pkg/workload):
- after an eviction, once no pod of the job runs any more, the quota is released: QuotaReserved
  False (reason Pending), the admission cleared, Admitted False, Requeued set, all applied
  server-side under Kueue's admission field manager, as `UnsetQuotaReservationWithCondition` +
  `ApplyAdmissionStatus` do;
- when the job finishes, Finished True frees the quota for good; PodsReady follows the group.
What to do and when is the planner's (status.py); apply.py writes what is built here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta1"
KUEUE_API_VERSION = f"{KUEUE_GROUP}/{KUEUE_VERSION}"
QUEUE_LABEL = f"{KUEUE_GROUP}/queue-name"
PRIORITY_LABEL = f"{KUEUE_GROUP}/priority-class"
WORKLOAD_PRIORITY_SOURCE = f"{KUEUE_GROUP}/workloadpriorityclass"
POD_SET = "main"

# Kueue's field manager for the admission and the conditions that go with it: releasing the quota
# under it (forced) removes the admission, as Kueue's ApplyAdmissionStatus does.
ADMISSION_MANAGER = "kueue-admission"
# The conditions Kueue keeps under ADMISSION_MANAGER (pkg/workload admissionManagedConditions):
# an apply under that manager must repeat those it does not change, or they would be removed.
ADMISSION_CONDITIONS = ("QuotaReserved", "BlockedOnPreemptionGates", "Evicted", "Admitted",
                        "Preempted", "Requeued", "DeactivationTarget", "Finished", "PodsReady")
# Kueue sets Requeued True only for evictions after which the workload is queued again at once.
REQUEUED_REASONS = frozenset({"Preempted", "EvictedByPreemption", "NodeFailures",
                              "EvictedDueToNodeFailures"})


def queue_name(body: Mapping[str, Any]) -> str | None:
    """The LocalQueue the job asks for, or None: the job is not Kueue's to admit."""
    labels = (body.get("metadata") or {}).get("labels") or {}
    return labels.get(QUEUE_LABEL) or None


def priority_class(body: Mapping[str, Any]) -> str | None:
    labels = (body.get("metadata") or {}).get("labels") or {}
    return labels.get(PRIORITY_LABEL) or None


@dataclass(frozen=True)
class QueueContext:
    """Kueue's objects for one job: its Workload as the operator's store shows it (None until
    it exists), and what observe.py read when needed: the specs of the ResourceFlavors it was
    admitted with, the value of its WorkloadPriorityClass (before the Workload is created)."""

    workload: Mapping[str, Any] | None = None
    flavors: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    priorities: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Condition:
    type: str
    reason: str
    message: str
    last_transition: str


@dataclass(frozen=True)
class WorkloadView:
    """A Workload's status as the planner needs it."""

    name: str
    active: bool = True
    reserved: bool = False  # QuotaReserved True, or an admission still recorded
    admitted: bool = False  # Admitted True with an admission: the group may start
    finished: bool = False
    pods_ready: bool | None = None
    evicted: Condition | None = None  # Evicted True: stop the group, then release the quota
    pending: Condition | None = None  # QuotaReserved False: why Kueue does not admit it (yet)
    cluster_queue: str | None = None
    flavors: tuple[str, ...] = ()  # the ResourceFlavors assigned to the pod set, sorted


def _conditions(workload: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c.get("type"): c for c in (workload.get("status") or {}).get("conditions") or []}


def _condition(raw: Mapping[str, Any]) -> Condition:
    return Condition(raw.get("type", ""), raw.get("reason") or "", raw.get("message") or "",
                     raw.get("lastTransitionTime") or "")


def read_workload(workload: Mapping[str, Any]) -> WorkloadView:
    status = workload.get("status") or {}
    conditions = _conditions(workload)
    is_true = lambda name: (conditions.get(name) or {}).get("status") == "True"  # noqa: E731
    admission = status.get("admission") or None
    flavors: set[str] = set()
    for assignment in (admission or {}).get("podSetAssignments") or []:
        flavors.update((assignment.get("flavors") or {}).values())
    quota = conditions.get("QuotaReserved")
    ready = conditions.get("PodsReady")
    return WorkloadView(
        name=workload["metadata"]["name"],
        active=(workload.get("spec") or {}).get("active", True) is not False,
        reserved=is_true("QuotaReserved") or admission is not None,
        admitted=is_true("Admitted") and admission is not None,
        finished=is_true("Finished"),
        pods_ready=None if ready is None else ready.get("status") == "True",
        evicted=_condition(conditions["Evicted"]) if is_true("Evicted") else None,
        pending=_condition(quota) if quota and quota.get("status") == "False" else None,
        cluster_queue=(admission or {}).get("clusterQueue"),
        flavors=tuple(sorted(flavors)),
    )


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


def _base(workload: Mapping[str, Any]) -> dict[str, Any]:
    """What identifies the Workload in an apply (Kueue's BaseSSAWorkload, strict): the
    resourceVersion makes the write fail on a Workload changed since it was read."""
    metadata = workload["metadata"]
    return {
        "apiVersion": workload.get("apiVersion", KUEUE_API_VERSION),
        "kind": "Workload",
        "metadata": {key: metadata[key] for key in ("name", "namespace", "uid",
                                                    "resourceVersion") if key in metadata},
    }


def build_quota_release(workload: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The apply (under ADMISSION_MANAGER, forced) that gives an evicted Workload's quota back:
    QuotaReserved False (Pending, with the eviction's message), no admission, Admitted False,
    Requeued True after a preemption (False otherwise), every other admission condition kept."""
    status = workload.get("status") or {}
    generation = int(workload["metadata"].get("generation") or 1)
    evicted = _conditions(workload).get("Evicted") or {}
    reason, message = evicted.get("reason") or "Evicted", evicted.get("message") or ""
    conditions = [dict(c) for c in status.get("conditions") or []
                  if c.get("type") in ADMISSION_CONDITIONS]
    _set_condition(conditions, "Requeued", reason in REQUEUED_REASONS, reason, message, now,
                   generation)
    _set_condition(conditions, "QuotaReserved", False, "Pending", message, now, generation)
    if any(c["type"] == "Admitted" for c in conditions):
        _set_condition(conditions, "Admitted", False, "NoReservation",
                       "The workload has no reservation", now, generation)
    patch = _base(workload)
    patch["status"] = {"conditions": conditions}
    for key in ("requeueState", "resourceRequests", "accumulatedPastExexcutionTimeSeconds",
                "accumulatedPastExecutionTimeSeconds", "schedulingStats"):
        if status.get(key) is not None:
            patch["status"][key] = status[key]
    return patch


def build_condition_apply(workload: Mapping[str, Any], type_: str, status: bool, reason: str,
                          message: str, now: str) -> dict[str, Any]:
    """One condition, applied under a field manager of its own (Kueue's UpdateStatus): Finished
    when the job ends, PodsReady as the group starts and stops."""
    generation = int(workload["metadata"].get("generation") or 1)
    conditions: list[dict[str, Any]] = []
    _set_condition(conditions, type_, status, reason, message, now, generation)
    current = _conditions(workload).get(type_)
    if current and current.get("status") == conditions[0]["status"]:
        conditions[0]["lastTransitionTime"] = current.get("lastTransitionTime", now)
    patch = _base(workload)
    patch["metadata"].pop("resourceVersion", None)
    patch["status"] = {"conditions": conditions}
    return patch
