"""The reads from the API server a pass needs beyond kopf's indexes, through kube/, each only
while the pass needs it, completing the Snapshot. They decide nothing and record nothing:
decide.py decides, from the completed Snapshot.

- The user's ConfigMap named by spec.accelerateConfigFrom (the YAML and the files beside it),
  while the rendered config has yet to be created or the topology still depends on that YAML
  (no status.topology yet).
- For a queued job, Kueue's cluster-scoped objects (kueue.read_kueue): the
  WorkloadPriorityClass its label names until its Workload exists, the ResourceFlavors its
  admission names until its group is all there.
- The Node of a pod whose state says its node may be lost (PodState.waits_on_node), once per
  node and pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from .kube import ConfigMapMissing, Kube
from .kueue import read_kueue
from .naming import configmap_name
from .pod_state import NodeState, PodState, read_node_state
from .snapshot import Snapshot


async def read(kube: Kube, seen: Snapshot) -> Snapshot:
    """The snapshot completed with what this pass must read."""
    if seen.kueue is not None and seen.kueue.queue and not seen.finished:
        kueue, error = await read_kueue(seen.kueue, seen.job, seen.pods, kube.read_kueue_object)
        seen = replace(seen, kueue=kueue, config_error=error)
    seen = replace(seen, lost_nodes=await read_lost_nodes(kube, seen.pods, seen.now))
    return await read_config_source(kube, seen)


async def read_lost_nodes(kube: Kube, pods: Sequence[PodState], now: datetime
                          ) -> dict[str, NodeState]:
    """The nodes of the pods that may be lost with them, those not Ready (group.py decides)."""
    lost = {}
    for name in sorted({p.node for p in pods if p.waits_on_node(now)}):
        node = read_node_state(name, await kube.read_node(name))
        if node is not None:
            lost[name] = node
    return lost


async def read_config_source(kube: Kube, seen: Snapshot) -> Snapshot:
    """The ConfigMap spec.accelerateConfigFrom names, while the pass needs it."""
    job = seen.job
    rendered = seen.has("ConfigMap", configmap_name(job.name))
    if seen.finished or not job.config_from or (rendered and job.topology_resolved):
        return seen
    ref = job.config_from
    try:
        source = await kube.read_config_source(job.namespace, ref.name, ref.key)
    except ConfigMapMissing as error:
        return replace(seen, config_error=str(error))
    return replace(seen, config_source=source)
