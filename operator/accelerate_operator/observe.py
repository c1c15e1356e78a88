"""Observe: everything one pass needs to know about a parsed job, gathered before planning.

The pods and children come from the informers' stores (passed in: no API call), completed by
what this operator created that the stores do not show yet; the status is the server's, unless
our own last write is newer. The reads that call the API server, through kube.py: the user's
ConfigMap named by spec.accelerateConfigFrom (the YAML and the files beside it), only while the
rendered config has yet to be created or the topology still depends on that YAML (no
status.topology yet); and for a queued job, the WorkloadPriorityClass its label names (until its
Workload exists) and the ResourceFlavors its admission names (until its group is all there). The
job's Workload itself comes from a store, passed in as a QueueContext. While the job runs, rank
0's progress (the tail of pod `<job>-0`'s log, every PROGRESS_SECONDS and whenever a pod of the
group has ended, so the last report is caught) and, once per attempt, the versions its trainer
printed (the head of that log): read here, so the pass writes them with the rest of the status,
in one write. Observing decides nothing: that is plan.py's."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from .api import JobSpec
from .constants import RUNNING
from .kube import ConfigMapMissing, Kube
from .kueue import QueueContext, priority_class, queue_name, read_workload
from .naming import configmap_name, pod_name, trainer_container_name
from .plan import Observed
from .progress import parse_progress, parse_trainer_info, split_log_timestamps
from .state import JobState
from .status import PodState

log = logging.getLogger("accelerate_operator")

# How often a running job's progress is read (rank 0 prints a report at most every ~2 s).
PROGRESS_SECONDS = 5.0
# Rank 0 prints a progress line every 2-5 s (transformers' callback posts at most every 5 s);
# the newest one must be in the tail read. A tqdm bar in a log that is not a terminal writes up
# to 3 lines per step, so a Trainer at 25 steps/s puts ~375 lines between two reports: 200
# lines would often miss the last one. 2,000 lines cover 5 s at ~130 steps/s, about 120 KiB per
# read of a running job every PROGRESS_SECONDS.
PROGRESS_TAIL_LINES = 2000
# The trainer prints its versions first thing; pip's output may come before a second line.
TRAINER_INFO_BYTES = 64 * 1024


async def observe(kube: Kube, state: JobState, body: Mapping[str, Any], job: JobSpec,
                  pods: Iterable[PodState],
                  children: Iterable[tuple[str, str]] = (),
                  queue: QueueContext | None = None, clock: float = 0.0) -> Observed:
    """`clock` is the operator's monotonic time, for what is due (in-flight expiry, the next
    progress read)."""
    status = state.latest_status(body.get("status") or {})
    attempt = int(status.get("attempt") or 0)
    children = frozenset(children)
    if queue is not None and queue.workload is not None:
        children |= {("Workload", queue.workload["metadata"]["name"])}
    all_pods, all_children = state.with_in_flight(attempt, list(pods), children, clock)
    seen = Observed(body=body, job=job, status=status, pods=tuple(all_pods),
                    children=all_children, queue=queue)
    if queue is not None and queue_name(body) and not seen.finished:
        seen = await _read_kueue(kube, seen, queue)
    if status.get("phase") == RUNNING or state.progress_read_failed:
        # A read that failed (a slow node agent) is tried again even once the job has finished:
        # the pass that finished it may have missed rank 0's last report.
        seen = await _read_rank0_log(kube, state, seen, attempt, clock)
    if state.activity_attempt == attempt:
        seen = replace(seen, last_activity=state.last_activity, last_step=state.last_step)
    rendered = seen.has("ConfigMap", configmap_name(job.name))
    if seen.finished or not job.config_from or (rendered and job.topology_resolved):
        return seen
    ref = job.config_from
    try:
        source = await kube.read_config_source(job.namespace, ref.name, ref.key)
    except ConfigMapMissing as error:
        return replace(seen, config_error=str(error))
    return replace(seen, config_source=source)


async def _read_rank0_log(kube: Kube, state: JobState, seen: Observed, attempt: int,
                          clock: float) -> Observed:
    """Rank 0's latest progress report when it is due (or a pod of the group has ended: the job
    may finish in this pass), and its trainer's versions once per attempt. Best effort: a node
    agent that does not answer costs the report, never the pass."""
    ended = any(p.finished for p in seen.pods if p.attempt == attempt)
    if not ended and not state.progress_read_failed and clock < state.next_progress_read:
        return seen
    state.next_progress_read = clock + PROGRESS_SECONDS
    namespace, name = seen.job.namespace, seen.job.name
    container = trainer_container_name(seen.job.template)
    found: dict[str, Any] = {}
    try:
        if (seen.status.get("trainer") or {}).get("attempt") != attempt:
            head = await kube.read_pod_log(namespace, pod_name(name, 0), None,
                                           container=container, limit_bytes=TRAINER_INFO_BYTES)
            if head:  # nothing logged yet: the next read tries again
                found.update(trainer_info_read=True, trainer_versions=parse_trainer_info(head))
        stamped = await kube.read_pod_log(namespace, pod_name(name, 0), PROGRESS_TAIL_LINES,
                                          container=container, timestamps=True)
        tail, newest = split_log_timestamps(stamped)
        report = found["progress_report"] = parse_progress(tail)
        # For stall detection (spec.runPolicy.stallTimeoutSeconds): rank 0's last sign of life
        # in this attempt, and the last step it reported.
        if state.activity_attempt != attempt:
            state.activity_attempt, state.last_activity, state.last_step = attempt, None, None
        if newest is not None:
            state.last_activity = newest
        if report is not None and report.get("step") is not None:
            state.last_step = int(report["step"])
        state.progress_read_failed = False
    except Exception as error:  # noqa: BLE001 - best effort, like any progress read
        log.warning("could not read rank 0's log of %s/%s: %s", namespace, name, error)
        state.progress_read_failed = True
    return replace(seen, **found)


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
    flavors = {}
    for name in view.flavors:
        found = await kube.read_kueue_object("resourceflavors", name)
        if found is not None:
            flavors[name] = found.get("spec") or {}
    return replace(seen, queue=replace(queue, flavors=flavors))
