"""Observe: everything one pass needs to know about a parsed job, gathered before planning.

The pods and children come from kopf's indexes (passed in: no API call), completed by what this
operator created that the indexes do not show yet; the status is the server's, unless our own
last write is newer. The only read that calls the API server, through kube.py, is the user's
ConfigMap named by spec.accelerateConfigFrom (the YAML and the files beside it), and only while
the rendered config has yet to be created or the topology still depends on that YAML (no
status.topology yet). Observing decides nothing: that is plan.py's."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from .api import JobSpec
from .kube import ConfigMapMissing, Kube
from .memory import Memory
from .naming import configmap_name
from .plan import Observed
from .status import PodState


async def observe(kube: Kube, memory: Memory, body: Mapping[str, Any], job: JobSpec,
                  pods: Iterable[PodState],
                  children: Iterable[tuple[str, str]] = ()) -> Observed:
    uid = job.uid
    status = memory.written.latest(uid, body.get("status") or {})
    attempt = int(status.get("attempt") or 0)
    all_pods, all_children = memory.in_flight.add_to(uid, attempt, list(pods),
                                                     frozenset(children))
    seen = Observed(body=body, job=job, status=status, pods=tuple(all_pods),
                    children=all_children, refused=memory.refusals.get(uid))
    rendered = seen.has("ConfigMap", configmap_name(job.name))
    if seen.finished or not job.config_from or (rendered and job.topology_resolved):
        return seen
    ref = job.config_from
    try:
        source = await kube.read_config_source(job.namespace, ref.name, ref.key)
    except ConfigMapMissing as error:
        return replace(seen, config_error=str(error))
    return replace(seen, config_source=source)

