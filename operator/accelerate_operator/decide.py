"""Plan: from what a pass observed to what it must do. One pure function, `plan_pass`.

It renders the accelerate config (resolving the topology the spec leaves to the YAML), builds
every missing child (the rendered ConfigMap, the headless Service, the PodDisruptionBudget when
spec.runPolicy.podDisruptionBudget asks for one, the pods) with the builders in resources/,
asks decision.plan_reconcile for the new status and the pods to create and delete, and says which
logs to archive, which events to post and whether the job's TTL has passed. For a job queued
with Kueue it also builds the Workload, places the pods as admitted (the flavors' node labels
and tolerations) and the writes to the Workload's status (kueue.py). No clock (`now` is an
argument), no API calls: observe.py gathers the Observed, apply.py carries the Actions out. A
pod the API server refused in an earlier pass is one more observation here, not a second
planning call."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from accelerate_trainer.config import ConfigError

from .api import JobSpec, SpecError
from .constants import FINISHED_PHASES
from .decision import Activity, Plan, plan_reconcile
from .kueue import (
    TopologyError,
    build_active_patch,
    build_condition_apply,
    build_quota_release,
    pods_ready_reason,
    priority_class,
    queue_name,
    read_pod_set_updates,
    read_topology_assignment,
    read_workload,
)
from .naming import (
    configmap_name,
    pdb_name,
    service_name,
    trainer_container_name,
    workload_name,
)
from .observed import Observed, group_attempt
from .queueing import FLAVOR_WAIT_SECONDS, QueueState
from .resources.configmap import prepare_config, with_report_ca
from .resources.pdb import build_pdb
from .resources.pods import build_pod
from .resources.service import build_service
from .resources.workload import Placement, build_placement, build_workload, with_placement
from .status import build_status_write
from .timefmt import format_time

# The operator's own field managers for the Workload conditions it sets (Kueue's UpdateStatus
# names them <controller>-<condition>).
FINISHED_MANAGER = "accelerate-operator-Finished"
PODS_READY_MANAGER = "accelerate-operator-PodsReady"


@dataclass(frozen=True)
class Archive:
    """Keep the last log lines of these pods of `attempt` before they are deleted."""

    attempt: int
    pods: tuple[str, ...]
    container: str | None


@dataclass(frozen=True)
class Actions:
    """Everything one pass changes, in the order apply.py does it: the planner's decision
    (`plan`: the pods to delete, force-delete and tell the attempt, the events, the job's own
    deletion, when to look again) and what it takes built (manifests, the status write)."""

    plan: Plan = field(default_factory=Plan)
    archive: Archive | None = None
    children: tuple[dict[str, Any], ...] = ()  # ConfigMap and Service manifests
    pods: tuple[dict[str, Any], ...] = ()  # Pod manifests
    status: dict[str, Any] | None = None  # what to write, progress included; None: unchanged
    workload: dict[str, Any] | None = None  # the Kueue Workload to create
    workload_writes: tuple[WorkloadWrite, ...] = ()


@dataclass(frozen=True)
class WorkloadWrite:
    """One write to the job's Workload: `spec` a merge patch of spec.active (and the
    annotation recording it), `status-merge` a JSON merge patch of /status carrying the
    Workload's resourceVersion (409: the next pass plans again), `status` a server-side apply of
    the operator's own conditions under `manager` (the operator's, never Kueue's)."""

    name: str
    part: str  # "spec", "status-merge" or "status"
    body: dict[str, Any]
    manager: str = ""


def plan_pass(seen: Observed, now: datetime) -> Actions:
    job, children, config_error = _missing_children(seen)
    reason = "InvalidConfig"
    if seen.refused is not None and not config_error:
        config_error, reason = seen.refused.message, seen.refused.reason
    queue = _queue_state(seen)
    placement = _admitted_placement(seen, job) if queue is not None else None
    if isinstance(placement, str) and not config_error:
        config_error, reason = placement, "AdmissionNotApplicable"
    plan = plan_reconcile(job, seen.status, seen.pods, now, config_error=config_error,
                          config_error_reason=reason, queue=queue,
                          activity=Activity(seen.last_activity, seen.last_step),
                          lost_nodes=seen.lost_nodes)
    finishing = not seen.finished and plan.status.get("phase") in FINISHED_PHASES
    pods = tuple(build_pod(job, index, plan.group, plan.attempt, seen.report_endpoint)
                 for index in plan.create)
    if pods and queue is not None:
        if not isinstance(placement, Placement):  # a flavor the index does not show yet
            pods, plan = (), replace(plan, requeue_after=FLAVOR_WAIT_SECONDS)
        else:
            pods = tuple(with_placement(pod, placement, index)
                         for pod, index in zip(pods, plan.create, strict=True))
    return Actions(
        plan=plan,
        archive=_archive(seen, plan),
        children=() if finishing else tuple(children),
        pods=pods,
        status=build_status_write(seen, plan.status, now),
        workload=_workload_to_create(seen, job, plan),
        workload_writes=_workload_writes(seen, plan, now),
    )


def _queue_state(seen: Observed) -> QueueState | None:
    """The job's queue and Workload, when the Kueue integration is on and the job is labelled."""
    name = queue_name(seen.body) if seen.queue is not None else None
    if name is None:
        return None
    workload = seen.queue.workload
    return QueueState(name, read_workload(workload) if workload else None,
                      missing_flavors=seen.queue.missing_flavors)


def _admitted_placement(seen: Observed, job: JobSpec) -> Placement | str | None:
    """Where Kueue's admission puts the pods (flavors, admission checks' pod-set updates,
    topology), None while the Workload is not admitted or one of its ResourceFlavors is not
    known yet, or a string saying why the admission cannot be applied (the job is refused,
    loudly, rather than placed where Kueue did not count it)."""
    workload = seen.queue.workload
    live = [p for p in seen.pods if not p.deleting and not p.finished]
    if workload is None or seen.finished or len(live) >= job.num_nodes:
        return None  # a running group is not judged again
    view = read_workload(workload)
    if not view.admitted or view.evicted is not None:
        return None
    specs = [seen.queue.flavors.get(name) for name in view.flavors]
    if any(spec is None for spec in specs):
        return None
    try:
        topology = read_topology_assignment(workload, job.num_nodes)
        return build_placement(specs, read_pod_set_updates(workload), topology,
                               build_pod(job, 0, 0))
    except (TopologyError, ValueError) as error:
        return f"Kueue admitted workload {view.name}, but its admission cannot be applied: {error}"


def _workload_to_create(seen: Observed, job: JobSpec, plan: Plan) -> dict[str, Any] | None:
    if not plan.queue.create or seen.has("Workload", workload_name(job.name, job.uid)):
        return None
    priority = priority_class(seen.body)
    value = seen.queue.priorities.get(priority) if priority else None
    return build_workload(job, queue_name(seen.body), priority, value, seen.queue.version)


def _workload_writes(seen: Observed, plan: Plan, now: datetime) -> tuple[WorkloadWrite, ...]:
    writes, workload = plan.queue, (seen.queue.workload if seen.queue else None)
    if workload is None:
        return ()
    name, stamp, out = workload["metadata"]["name"], format_time(now), []
    if writes.active is not None:
        out.append(WorkloadWrite(name, "spec", build_active_patch(writes.active)))
    if writes.release:
        out.append(WorkloadWrite(name, "status-merge", build_quota_release(workload, stamp)))
    if writes.pods_ready is not None:
        reason, message = pods_ready_reason(read_workload(workload), writes.pods_ready)
        out.append(WorkloadWrite(name, "status", build_condition_apply(
            workload, "PodsReady", writes.pods_ready, reason, message, stamp),
            PODS_READY_MANAGER))
    if writes.finished is not None:
        reason, message = writes.finished
        out.append(WorkloadWrite(name, "status", build_condition_apply(
            workload, "Finished", True, reason, message, stamp), FINISHED_MANAGER))
    return tuple(out)


def _missing_children(seen: Observed) -> tuple[JobSpec, list[dict[str, Any]], str | None]:
    """The job with its topology resolved against its accelerate YAML, the ConfigMap and Service
    to (re)create, or why the job cannot run. A finished job gets none back; a child deleted by
    hand is recreated by the next pass that sees it missing."""
    job = seen.job
    if seen.finished:
        return job, [], None
    if seen.config_error:
        return job, [], seen.config_error
    children = []
    rendered = seen.has("ConfigMap", configmap_name(job.name))
    if not rendered or not job.topology_resolved:
        try:
            job, configmap = prepare_config(job, seen.config_source)
        except (ConfigError, SpecError) as error:
            return seen.job, [], str(error)
        if not rendered:
            children.append(with_report_ca(configmap, seen.report_ca))
    if not seen.has("Service", service_name(job.name)):
        children.append(build_service(job))
    if job.run_policy.pod_disruption_budget and not seen.has("PodDisruptionBudget",
                                                             pdb_name(job.name)):
        children.append(build_pdb(job))
    return job, children, None


def _archive(seen: Observed, plan: Plan) -> Archive | None:
    """A restart deletes the group of the previous attempt: keep what its pods printed (the
    attempts they ran in place too)."""
    previous = int(seen.status.get("attempt") or 0)
    group = group_attempt(seen.status)
    if plan.attempt <= previous or not (plan.delete or plan.force_delete):
        return None
    names = sorted({p.name for p in seen.pods if p.attempt == group}
                   & set(plan.delete + plan.force_delete))
    if not names:
        return None
    return Archive(previous, tuple(names), trainer_container_name(seen.job.template))
