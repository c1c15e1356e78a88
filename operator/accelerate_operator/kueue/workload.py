"""Kueue's Workload as the operator reads it: the API versions served, the job's queue and
priority labels, and a Workload's status read into a `WorkloadStatus` (admitted, evicted,
deactivated, PodsReady, the flavors, the admission checks' pod-set updates, a topology
assignment). Pure, plain dicts in.

Two API versions are served by the Kueue releases we support (v0.14 to v0.20): v1beta1 (up to
v0.19) and v1beta2 (from v0.15; the only one from v0.20). `choose_kueue_version` picks one from
the API server's discovery document; everything here reads both shapes."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

KUEUE_GROUP = "kueue.x-k8s.io"
V1BETA1, V1BETA2 = "v1beta1", "v1beta2"
SUPPORTED_VERSIONS = (V1BETA2, V1BETA1)  # in order of preference
# The default until discovery says otherwise (and the version of a Workload with no apiVersion).
KUEUE_VERSION = V1BETA1
KUEUE_API_VERSION = f"{KUEUE_GROUP}/{KUEUE_VERSION}"
PRIORITY_LABEL = f"{KUEUE_GROUP}/priority-class"
WORKLOAD_PRIORITY_SOURCE = f"{KUEUE_GROUP}/workloadpriorityclass"
POD_SET = "main"
# What the operator last asked spec.active to be, kept on the Workload itself (written with
# spec.active in the same patch): a Workload inactive while this says "true" was deactivated by
# Kueue, and the operator leaves it so.
REQUESTED_ACTIVE_ANNOTATION = "accelerate-operator.io/requested-active"
# Kueue sets Requeued True only for evictions after which the workload is queued again at once.
REQUEUED_REASONS = frozenset({"Preempted", "EvictedByPreemption", "NodeFailures",
                              "EvictedDueToNodeFailures"})
# Evicted reasons that mean "Kueue deactivated the Workload" (pkg/workload: WorkloadDeactivated
# "Deactivated", from v0.9 "DeactivatedDueTo<DeactivationTarget reason>"; before v0.9
# "InactiveWorkload").
DEACTIVATED_PREFIXES = ("Deactivated", "InactiveWorkload")

# PodsReady reasons, Kueue v0.14+ (apis/kueue/v1beta1/workload_types.go: WorkloadStarted,
# WorkloadWaitForStart, WorkloadWaitForRecovery, WorkloadRecovered) and the messages
# jobframework's reconciler writes with them.
PODS_READY_STARTED = ("Started", "All pods reached readiness and the workload is running")
PODS_READY_RECOVERED = ("Recovered", "All pods reached readiness and the workload is running")
PODS_READY_WAIT_FOR_START = ("WaitForStart", "Not all pods are ready or succeeded")
PODS_READY_WAIT_FOR_RECOVERY = ("WaitForRecovery",
                                "At least one pod has failed, waiting for recovery")


class KueueVersionError(ValueError):
    """The API server serves kueue.x-k8s.io in no version this operator writes."""


def choose_kueue_version(group: Mapping[str, Any] | None) -> str | None:
    """The Workload version to use, from `GET /apis/kueue.x-k8s.io` (an APIGroup): v1beta2 when
    served (its fields are the ones Kueue keeps), else v1beta1; None when the group is not
    served at all (Kueue not installed). A group served only in versions we do not know is an
    error naming them."""
    if not group:
        return None
    served = [v.get("version") for v in group.get("versions") or []]
    if not served:
        return None
    for version in SUPPORTED_VERSIONS:
        if version in served:
            return version
    raise KueueVersionError(
        f"the API server serves {KUEUE_GROUP} in {', '.join(map(str, served))}; this operator "
        f"writes Workloads in {' or '.join(SUPPORTED_VERSIONS)} (Kueue v0.14 to v0.20): "
        "install a supported Kueue, or upgrade the operator")


def api_version(version: str) -> str:
    return f"{KUEUE_GROUP}/{version}"


def priority_class(body: Mapping[str, Any]) -> str | None:
    labels = (body.get("metadata") or {}).get("labels") or {}
    return labels.get(PRIORITY_LABEL) or None


@dataclass(frozen=True)
class KueueView:
    """Kueue as one pass sees a job: the LocalQueue and WorkloadPriorityClass its labels name
    (None: not Kueue's to admit), its Workload as the operator's index shows it (None until it
    exists), the Workload API version the server serves (a Workload is created in it), and what
    the pass read when needed (kueue.read_kueue): the value of the priority class before the
    Workload is created, the specs of the ResourceFlavors it was admitted with, and those the
    API server does not have (deleted since the admission)."""

    workload: Mapping[str, Any] | None = None
    version: str = KUEUE_VERSION
    queue: str | None = None
    priority_class: str | None = None
    priority: int | None = None
    flavors: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    missing_flavors: tuple[str, ...] = ()

    @cached_property
    def workload_status(self) -> WorkloadStatus | None:
        return read_workload(self.workload) if self.workload is not None else None


@dataclass(frozen=True)
class Condition:
    type: str
    reason: str
    message: str
    last_transition: str


@dataclass(frozen=True)
class PodSetUpdate:
    """What one admission check asks of the pods (status.admissionChecks[].podSetUpdates[])."""

    check: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class WorkloadStatus:
    """A Workload's status as the Kueue policy needs it."""

    name: str
    active: bool = True
    reserved: bool = False  # QuotaReserved True, or an admission still recorded
    admitted: bool = False  # Admitted True with an admission: the group may start
    finished: bool = False
    pods_ready: bool | None = None
    pods_ready_reason: str = ""
    # PodsReady has been True since the current quota reservation: a group stopped now is
    # "waiting for recovery", not "waiting for start" (Kueue times the two differently).
    was_ready: bool = False
    evicted: Condition | None = None  # Evicted True: stop the group, then release the quota
    pending: Condition | None = None  # QuotaReserved False: why Kueue does not admit it (yet)
    cluster_queue: str | None = None
    flavors: tuple[str, ...] = ()  # the ResourceFlavors assigned to the pod set, sorted
    # What the operator last wrote to spec.active (REQUESTED_ACTIVE_ANNOTATION), None if unknown.
    requested_active: bool | None = None
    # Kueue's reason and message when Kueue (not the operator) deactivated the Workload.
    deactivated: Condition | None = None


def conditions_by_type(workload: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c.get("type"): c for c in (workload.get("status") or {}).get("conditions") or []}


def _condition(raw: Mapping[str, Any]) -> Condition:
    return Condition(raw.get("type", ""), raw.get("reason") or "", raw.get("message") or "",
                     raw.get("lastTransitionTime") or "")


def _requested_active(workload: Mapping[str, Any]) -> bool | None:
    value = ((workload.get("metadata") or {}).get("annotations") or {}).get(
        REQUESTED_ACTIVE_ANNOTATION)
    return None if value is None else value == "true"


def _deactivation(workload: Mapping[str, Any], active: bool, requested: bool | None
                  ) -> Condition | None:
    """Kueue's reason for an inactive Workload the operator did not deactivate: the
    DeactivationTarget condition (set first, pkg/workload, v0.9+) or an Evicted condition whose
    reason says deactivated. An inactive Workload with the operator's own "false" on record is
    the user's suspend, not Kueue's."""
    if active or requested is False:
        return None
    conditions = conditions_by_type(workload)
    evicted = conditions.get("Evicted") or {}
    target = conditions.get("DeactivationTarget") or {}
    if target.get("status") == "True":
        found = _condition(target)
    elif evicted.get("status") == "True" and str(evicted.get("reason") or "").startswith(
            DEACTIVATED_PREFIXES):
        found = _condition(evicted)
    elif requested is True:  # we asked for active, someone else turned it off
        found = Condition("Deactivated", "Deactivated",
                          "the Workload's spec.active was set to false", "")
    else:
        return None
    if not found.reason.startswith("Deactivated"):
        found = Condition(found.type, f"DeactivatedDueTo{found.reason}" if found.reason
                          else "Deactivated", found.message, found.last_transition)
    return found


def read_workload(workload: Mapping[str, Any]) -> WorkloadStatus:
    """Both API versions: the status fields read here are the same in v1beta1 and v1beta2."""
    status = workload.get("status") or {}
    conditions = conditions_by_type(workload)
    is_true = lambda name: (conditions.get(name) or {}).get("status") == "True"  # noqa: E731
    admission = status.get("admission") or None
    flavors: set[str] = set()
    for assignment in (admission or {}).get("podSetAssignments") or []:
        flavors.update((assignment.get("flavors") or {}).values())
    quota = conditions.get("QuotaReserved")
    ready = conditions.get("PodsReady")
    active = (workload.get("spec") or {}).get("active", True) is not False
    requested = _requested_active(workload)
    was_ready = bool(ready) and (
        ready.get("status") == "True"
        or ready.get("reason") in ("Started", "Recovered", "WaitForRecovery", "PodsReady")
    ) and (not quota or quota.get("status") != "True"
           or str(ready.get("lastTransitionTime") or "")
           >= str(quota.get("lastTransitionTime") or ""))
    return WorkloadStatus(
        name=workload["metadata"]["name"],
        active=active,
        reserved=is_true("QuotaReserved") or admission is not None,
        admitted=is_true("Admitted") and admission is not None,
        finished=is_true("Finished"),
        pods_ready=None if ready is None else ready.get("status") == "True",
        pods_ready_reason=(ready or {}).get("reason") or "",
        was_ready=was_ready,
        evicted=_condition(conditions["Evicted"]) if is_true("Evicted") else None,
        pending=_condition(quota) if quota and quota.get("status") == "False" else None,
        cluster_queue=(admission or {}).get("clusterQueue"),
        flavors=tuple(sorted(flavors)),
        requested_active=requested,
        deactivated=_deactivation(workload, active, requested),
    )


def read_pod_set_updates(workload: Mapping[str, Any], pod_set: str = POD_SET
                         ) -> tuple[PodSetUpdate, ...]:
    """The admission checks' updates for our pod set, in the checks' order (v1beta1 and
    v1beta2 both: status.admissionChecks[].podSetUpdates[] {name, labels, annotations,
    nodeSelector, tolerations})."""
    out = []
    for check in (workload.get("status") or {}).get("admissionChecks") or []:
        for update in check.get("podSetUpdates") or []:
            if update.get("name") != pod_set:
                continue
            out.append(PodSetUpdate(
                check=check.get("name") or "",
                labels=dict(update.get("labels") or {}),
                annotations=dict(update.get("annotations") or {}),
                node_selector=dict(update.get("nodeSelector") or {}),
                tolerations=tuple(dict(t) for t in update.get("tolerations") or [])))
    return tuple(out)


class TopologyError(ValueError):
    """A topology assignment the operator cannot apply: the job is refused, saying why."""


def read_topology_assignment(workload: Mapping[str, Any], count: int, pod_set: str = POD_SET
                             ) -> tuple[dict[str, str], ...] | None:
    """The node selector of each pod (by index) from Kueue's topology-aware scheduling, or None
    when the admission has no topologyAssignment for our pod set.

    Read: the form of apis/kueue/v1beta1/workload_types.go (TopologyAssignment{levels,
    domains[{values, count}]}, v0.9 to v0.19): domain i's values name the node labels of
    `levels`, and its `count` pods are placed there, in index order, as Kueue's TAS ungater
    does with the pods it ungates (pkg/controller/tas/topology_ungater.go). Any other form
    (v1beta2's compressed `slices`, or counts not adding up to the pod set) raises TopologyError:
    the job is refused loudly rather than placed where Kueue did not count it."""
    admission = (workload.get("status") or {}).get("admission") or {}
    for assignment in admission.get("podSetAssignments") or []:
        if assignment.get("name") != pod_set or not assignment.get("topologyAssignment"):
            continue
        topology = assignment["topologyAssignment"]
        levels, domains = topology.get("levels"), topology.get("domains")
        if not isinstance(levels, list) or not isinstance(domains, list) or not levels:
            raise TopologyError(
                "Kueue assigned a topology (status.admission.podSetAssignments[].topology"
                f"Assignment with keys {sorted(topology)}) in a form this operator does not "
                "read (it reads {levels, domains}); run the job without topology-aware "
                "scheduling (no kueue.x-k8s.io/podset-*-topology annotation, a flavor without "
                "topologyName) or upgrade the operator")
        selectors: list[dict[str, str]] = []
        for domain in domains:
            values = domain.get("values") or []
            if len(values) != len(levels):
                raise TopologyError(
                    f"Kueue's topology domain {values} does not match its levels {levels}")
            selectors += [dict(zip(levels, values, strict=True))] * int(domain.get("count", 0))
        if len(selectors) != count:
            raise TopologyError(
                f"Kueue's topology assignment places {len(selectors)} pod(s), the job has "
                f"{count} node(s)")
        return tuple(selectors)
    return None


def pods_ready_reason(view: WorkloadStatus, ready: bool) -> tuple[str, str]:
    """Kueue's PodsReady reason and message (pkg/controller/jobframework/reconciler.go, v0.14+):
    True is Started the first time, Recovered after a WaitForRecovery; False is WaitForStart
    until the group was ever ready under this reservation, WaitForRecovery after."""
    if ready:
        if view.pods_ready:  # already True: its reason stays
            return (PODS_READY_RECOVERED if view.pods_ready_reason == PODS_READY_RECOVERED[0]
                    else PODS_READY_STARTED)
        return PODS_READY_RECOVERED if view.was_ready else PODS_READY_STARTED
    return PODS_READY_WAIT_FOR_RECOVERY if view.was_ready else PODS_READY_WAIT_FOR_START


def lean_workload(body: Mapping[str, Any], metadata: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator's index keeps of a Workload (`metadata` already made lean): its
    version, spec.active and status, all a pass reads of it."""
    return {"apiVersion": body.get("apiVersion") or KUEUE_API_VERSION, "metadata": dict(metadata),
            "spec": {"active": (body.get("spec") or {}).get("active", True)},
            "status": body.get("status") or {}}
