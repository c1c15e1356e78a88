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
  node and pass.
- The Warning events of the first pod of the group whose container has been ContainerCreating
  for CREATING_GRACE_SECONDS: what keeps it (a volume it cannot mount or attach, a sandbox the
  network plugin cannot make) is written only there (pod_warning). One list per
  pass, the first such pod only: the Waiting condition names one pod."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from accelerate_trainer.contract import MAX_FIELD_CHARS, MAX_MESSAGE_CHARS, printable_text

from .apierrors import server_message
from .constants import PENDING
from .kube import ApiException, ConfigMapMissing, Kube
from .kueue import read_kueue
from .naming import configmap_name
from .not_started import NotStarted
from .pod_state import NodeState, PodState, read_node_state
from .snapshot import Snapshot
from .timefmt import parse_time

log = logging.getLogger("accelerate_operator.reads")

# A container may take this long to be created (volumes mounted, the sandbox made) before the
# pass asks the pod's events why it is not.
CREATING_GRACE_SECONDS = 30


async def read(kube: Kube, seen: Snapshot) -> Snapshot:
    """The snapshot completed with what this pass must read."""
    if seen.kueue is not None and seen.kueue.queue and not seen.finished:
        kueue, error = await read_kueue(seen.kueue, seen.job, seen.pods, kube.read_kueue_object)
        seen = replace(seen, kueue=kueue, config_error=error)
    seen = replace(seen, lost_nodes=await read_lost_nodes(kube, seen.pods, seen.now))
    seen = await read_creating_warning(kube, seen)
    return await read_config_source(kube, seen)


async def read_creating_warning(kube: Kube, seen: Snapshot) -> Snapshot:
    """The snapshot with why its first long-creating pod cannot start, when an event says."""
    creating = [(p, since) for p in seen.pods
                if (since := _creating_since(p, seen.group, seen.now)) is not None]
    if seen.finished or not creating:
        return seen
    first, since = min(creating, key=lambda pair: pair[0].index)
    try:
        events = await kube.list_pod_warnings(seen.job.namespace, first.uid)
    except ApiException as error:
        # Best effort, as the operator's own events: an install whose RBAC lacks list on
        # events (not the chart's) still runs its passes; the job says ContainerCreating.
        log.warning("could not read the events of pod %s: %s", first.name, server_message(error))
        return seen
    warning = pod_warning(events, since)
    if warning is None:
        return seen
    pods = tuple(replace(p, not_started=warning) if p is first else p for p in seen.pods)
    return replace(seen, pods=pods)


def _creating_since(pod: PodState, group: int, now: datetime) -> datetime | None:
    """Since when a pod of the group has waited on its node for its container to be created,
    once that is CREATING_GRACE_SECONDS or more; None otherwise."""
    waiting = pod.not_started
    since = parse_time(waiting.since) if waiting is not None else None
    if (waiting is None or waiting.stuck or pod.attempt != group or pod.phase != PENDING
            or pod.deleting or since is None):
        return None
    return since if now - since >= timedelta(seconds=CREATING_GRACE_SECONDS) else None


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


def pod_warning(events: Sequence[Mapping[str, Any]], since: datetime) -> NotStarted | None:
    """The newest of a pod's Warning events since it got its node (`since`: one before, the
    scheduler's FailedScheduling, is about what came first) as why it cannot start
    (FailedMount, FailedAttachVolume, FailedCreatePodSandBox...), its message as the kubelet or
    the controller wrote it, made printable and bounded; None for no such event."""
    def when(event: Mapping[str, Any]) -> datetime | None:
        return parse_time(event.get("lastTimestamp") or event.get("eventTime")
                          or (event.get("metadata") or {}).get("creationTimestamp"))
    timed = [(at, e) for e in events if e.get("type") == "Warning" and e.get("reason")
             and (at := when(e)) is not None and at >= since]
    if not timed:
        return None
    newest = max(timed, key=lambda pair: pair[0])[1]
    return NotStarted(printable_text(str(newest["reason"]), MAX_FIELD_CHARS),
                      printable_text(str(newest.get("message") or ""), MAX_MESSAGE_CHARS),
                      from_event=True)
