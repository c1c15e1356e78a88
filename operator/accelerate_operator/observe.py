"""Observe: everything one pass needs to know about a parsed job, gathered before planning.

The pods and children come from the informers' stores (passed in: no API call), completed by
what this operator created that the stores do not show yet; the status is the server's, unless
our own last write is newer. The reads that call the API server, through kube.py: the user's
ConfigMap named by spec.accelerateConfigFrom (the YAML and the files beside it), only while the
rendered config has yet to be created or the topology still depends on that YAML (no
status.topology yet); and for a queued job, the WorkloadPriorityClass its label names (until its
Workload exists) and the ResourceFlavors its admission names (until its group is all there). The
job's Workload itself comes from a store, passed in as a QueueContext. Observing decides
nothing: that is plan.py's."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from .api import JobSpec
from .kube import ConfigMapMissing, Kube
from .kueue import QueueContext, priority_class, queue_name, read_workload
from .memory import Memory
from .naming import configmap_name
from .plan import Observed
from .status import PodState


async def observe(kube: Kube, memory: Memory, body: Mapping[str, Any], job: JobSpec,
                  pods: Iterable[PodState],
                  children: Iterable[tuple[str, str]] = (),
                  queue: QueueContext | None = None) -> Observed:
    uid = job.uid
    status = memory.written.latest(uid, body.get("status") or {})
    attempt = int(status.get("attempt") or 0)
    children = frozenset(children)
    if queue is not None and queue.workload is not None:
        children |= {("Workload", queue.workload["metadata"]["name"])}
    all_pods, all_children = memory.in_flight.add_to(uid, attempt, list(pods), children)
    seen = Observed(body=body, job=job, status=status, pods=tuple(all_pods),
                    children=all_children, refused=memory.refusals.get(uid), queue=queue)
    if queue is not None and queue_name(body) and not seen.finished:
        seen = await _read_kueue(kube, seen, queue)
    rendered = seen.has("ConfigMap", configmap_name(job.name))
    if seen.finished or not job.config_from or (rendered and job.topology_resolved):
        return seen
    ref = job.config_from
    try:
        source = await kube.read_config_source(job.namespace, ref.name, ref.key)
    except ConfigMapMissing as error:
        return replace(seen, config_error=str(error))
    return replace(seen, config_source=source)



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
