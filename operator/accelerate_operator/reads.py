"""Observe: everything one pass needs to know about a parsed job, gathered before planning.

The pods and children come from the informers' stores (passed in: no API call), completed by
what this operator created that the stores do not show yet; the status is the server's, unless
our own last write is newer. Pod 0's report (taken by the report endpoint, which queues the
job's pass; the controller puts it on the PodState) gives rank 0's progress and its last sign
of life; a new progress is handed to the plan at most once every PROGRESS_WRITE_SECONDS,
however often the pod reports.
The reads that call the API server, through kube.py: the user's ConfigMap named by
spec.accelerateConfigFrom (the YAML and the files beside it), only while the rendered config has
yet to be created or the topology still depends on that YAML (no status.topology yet); for a
queued job, the WorkloadPriorityClass its label names (until its Workload exists) and the
ResourceFlavors its admission names (until its group is all there); the Node of a pod whose state
says its node may be lost (PodState.waits_on_node), at most once per node and pass; and once per
attempt, the head of pod 0's log, for the versions its trainer printed first thing. The job's
Workload itself comes from a store, passed in as a QueueContext. Observing decides nothing: that
is plan.py's."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

from .api import JobSpec
from .constants import PENDING
from .kube import ConfigMapMissing, Kube
from .kueue import QueueContext, priority_class, queue_name, read_workload
from .naming import configmap_name, pod_name, trainer_container_name
from .observed import NodeState, Observed, PodState, Reporting, group_attempt
from .progress import build_progress_status, parse_report, parse_trainer_info, progress_changed
from .state import JobState
from .timefmt import parse_time

log = logging.getLogger("accelerate_operator")

# At most one status.progress write per job this often, however often its pods report. Chosen
# from bench/running.py (docs/performance.md, "Running jobs"): a progress write is the largest
# cost of a running job to the control plane (the API server's status PATCH, its watchers), so
# the interval is as long as it can be while the PROGRESS column stays within 15 s of pod 0's
# last report, with 5 s left for a pass delayed on a loaded operator.
PROGRESS_WRITE_SECONDS = 10.0
# The trainer prints its versions first thing; pip's output may come before a second line.
TRAINER_INFO_BYTES = 64 * 1024
# Until pod 0 has printed them, its log's head is read again this often.
TRAINER_INFO_RETRY_SECONDS = 5.0


async def observe(kube: Kube, state: JobState, body: Mapping[str, Any], job: JobSpec,
                  pods: Iterable[PodState],
                  children: Iterable[tuple[str, str]] = (),
                  queue: QueueContext | None = None, clock: float = 0.0,
                  now: datetime | None = None, reporting: Reporting | None = None) -> Observed:
    """`clock` is the operator's monotonic time, for what is due (in-flight expiry, the next
    progress write, the next read of the trainer's versions); `now` the wall clock the pass
    plans with (UTC), for pods overdue on their node; `reporting` where the pods report to."""
    status = state.latest_status(body.get("status") or {})
    attempt = group_attempt(status)  # the current pods' (in-place restarts keep them)
    children = frozenset(children)
    if queue is not None and queue.workload is not None:
        children |= {("Workload", queue.workload["metadata"]["name"])}
    all_pods, all_children = state.with_in_flight(attempt, list(pods), children, clock)
    seen = Observed(body=body, job=job, status=status, pods=tuple(all_pods),
                    children=all_children, queue=queue)
    if reporting is not None:
        seen = replace(seen, report_endpoint=reporting.endpoint, report_ca=reporting.ca())
    if queue is not None and queue_name(body) and not seen.finished:
        seen = await _read_kueue(kube, seen, queue)
    if now is not None:
        seen = await _read_lost_nodes(kube, seen, now)
    rank0 = next((p for p in seen.pods if p.index == 0 and p.attempt == attempt), None)
    if rank0 is not None:
        seen = with_report(state, seen, rank0, clock)
        seen = await _read_trainer_info(kube, state, seen, rank0, attempt, clock)
    rendered = seen.has("ConfigMap", configmap_name(job.name))
    if seen.finished or not job.config_from or (rendered and job.topology_resolved):
        return seen
    ref = job.config_from
    try:
        source = await kube.read_config_source(job.namespace, ref.name, ref.key)
    except ConfigMapMissing as error:
        return replace(seen, config_error=str(error))
    return replace(seen, config_source=source)


def with_report(state: JobState, seen: Observed, rank0: PodState, clock: float) -> Observed:
    """What pod 0 of the current attempt last pushed: its last sign of life and step (stall
    detection), and its progress when that changed and a write is due; when one is not due
    yet, when it will be. The pod's last report (it has ended) is never held back."""
    report = parse_report(rank0.report)
    if report is None:
        return seen
    seen = replace(seen, last_activity=report.last_output)
    if report.attempt is not None and report.attempt < int(seen.status.get("attempt") or 0):
        return seen  # the progress of an attempt restarted in place since: history
    seen = replace(seen, last_step=report.step, previous_step=report.previous_step,
                   previous_time=report.previous_time)
    if report.progress is None or not progress_changed(
            seen.status.get("progress"), build_progress_status(report.progress, datetime.min)):
        return seen
    if clock < state.next_progress_write and not rank0.finished:
        return replace(seen, due_in=_sooner(seen.due_in, state.next_progress_write - clock))
    state.next_progress_write = clock + PROGRESS_WRITE_SECONDS
    return replace(seen, progress_report=report.progress, progress_time=report.progress_time)


async def _read_trainer_info(kube: Kube, state: JobState, seen: Observed, rank0: PodState,
                             attempt: int, clock: float) -> Observed:
    """The versions pod 0's trainer printed, once per attempt, from the head of its log. Best
    effort: a node agent that does not answer costs the versions, never the pass."""
    if (seen.status.get("trainer") or {}).get("attempt") == attempt or rank0.phase == PENDING:
        return seen
    if clock < state.next_info_read:
        return replace(seen, due_in=_sooner(seen.due_in, state.next_info_read - clock))
    state.next_info_read = clock + TRAINER_INFO_RETRY_SECONDS
    container = trainer_container_name(seen.job.template)
    try:
        head = await kube.read_pod_log(seen.job.namespace, pod_name(seen.job.name, 0), None,
                                       container=container, limit_bytes=TRAINER_INFO_BYTES)
    except Exception as error:  # noqa: BLE001 - best effort, tried again
        log.warning("could not read the head of %s's log: %s", rank0.name, error)
        return replace(seen, due_in=_sooner(seen.due_in, TRAINER_INFO_RETRY_SECONDS))
    if not head and not rank0.finished:  # nothing printed yet
        return replace(seen, due_in=_sooner(seen.due_in, TRAINER_INFO_RETRY_SECONDS))
    return replace(seen, trainer_info_read=True, trainer_versions=parse_trainer_info(head))


async def _read_lost_nodes(kube: Kube, seen: Observed, now: datetime) -> Observed:
    """The nodes of the pods that may be lost with them, those not Ready (plan.py decides);
    and, for a pod being deleted, a pass when its grace period ends (nothing else may come: a
    lost node sends no event)."""
    names = sorted({p.node for p in seen.pods if p.waits_on_node(now)})
    lost = {}
    for name in names:
        node = read_node_state(name, await kube.read_node(name))
        if node is not None:
            lost[name] = node
    ends = [(p.gone_by - now).total_seconds() + 1.0 for p in seen.pods
            if p.node and p.gone_by is not None and p.gone_by > now and not p.finished]
    due = _sooner(seen.due_in, min(ends)) if ends else seen.due_in
    return replace(seen, lost_nodes=lost, due_in=due)


def read_node_state(name: str, node: Mapping[str, Any] | None) -> NodeState | None:
    """A Node (None: gone) as the planner needs it: None while it is Ready."""
    if node is None:
        return NodeState(name, None, reporting=False)
    ready = next((c for c in (node.get("status") or {}).get("conditions") or []
                  if c.get("type") == "Ready"), {})
    if ready.get("status") == "True":
        return None
    return NodeState(name, parse_time(ready.get("lastTransitionTime")),
                     reporting=ready.get("status") == "False")


def _sooner(current: float | None, other: float) -> float:
    return other if current is None else min(current, other)


async def _read_kueue(kube: Kube, seen: Observed, queue: QueueContext) -> Observed:
    """The WorkloadPriorityClass's value while the Workload is to be created, and the admitted
    ResourceFlavors while the group is not all there (its pods are about to be made)."""
    workload, priority = queue.workload, priority_class(seen.body)
    if workload is None and priority:
        found = await kube.read_kueue_object("workloadpriorityclasses", priority)
        if found is None:
            return replace(seen, config_error=(
                f"label kueue.x-k8s.io/priority-class names WorkloadPriorityClass {priority!r}, "
                "which does not exist; create it, or fix the label"))
        return replace(seen, queue=replace(queue, priorities={priority: int(found.get("value")
                                                                            or 0)}))
    live = [p for p in seen.pods if not p.deleting and not p.finished]
    if workload is None or len(live) >= seen.job.num_nodes:
        return seen
    view = read_workload(workload)
    if not view.admitted:
        return seen
    flavors, missing = {}, []
    for name in view.flavors:
        found = await kube.read_kueue_object("resourceflavors", name)
        if found is None:
            missing.append(name)
        else:
            flavors[name] = found.get("spec") or {}
    return replace(seen, queue=replace(queue, flavors=flavors, missing_flavors=tuple(missing)))
