"""One reconcile pass, in four named steps: parse (api.py), observe (observe.py), plan (plan.py,
pure), apply (apply.py, through kube.py). One pass per job at a time, and at most one waiting:
events that arrive while a pass waits join it (it starts from the newest state), so a burst of
events of one job (its pods created, scheduled, started) costs one or two passes, not one each.

Level-triggered: a pass starts from what is there, never from what happened, so any event of a
job, or the clock, may run it, and a pass with nothing to change makes no API call."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .api import JobSpec, SpecError, parse_job
from .apply import Applier, utcnow
from .kube import Kube
from .kueue import QueueContext
from .memory import Memory
from .observe import observe
from .plan import plan_pass
from .status import PodState

log = logging.getLogger("accelerate_operator")

# A pass whose pod the API server refused is followed by one more, which plans with the refusal.
MAX_PASSES = 2


def parse_spec(body: Mapping[str, Any], status: Mapping[str, Any]) -> JobSpec | None:
    """The parsed job, or None (logged) when it cannot be parsed or is being deleted (its
    children go with it). `status` is the latest one (our own last write may be newer than the
    body's): its topology, once resolved, is not read from the ConfigMap again."""
    metadata = body["metadata"]
    try:
        job = parse_job(body, status)
    except SpecError as error:
        log.warning("job %s/%s cannot be parsed: %s", metadata.get("namespace"),
                    metadata["name"], error)
        return None
    return None if metadata.get("deletionTimestamp") else job


# What the stores show when a pass starts: the pods, the children, and Kueue's view (or None);
# None instead when the job is gone by then (deleted while the pass waited to start).
Indexed = Callable[[], tuple[Iterable[PodState], Iterable[tuple[str, str]], QueueContext | None]
                   | None]


@dataclass
class _WaitingPass:
    body: Mapping[str, Any]
    result: asyncio.Future


class Reconciler:
    def __init__(self, kube: Kube, memory: Memory | None = None):
        self.kube = kube
        self.memory = memory or Memory()
        self.applier = Applier(kube, self.memory)
        self._waiting: dict[str, _WaitingPass] = {}

    async def reconcile(self, body: Mapping[str, Any], pods: Iterable[PodState],
                        children: Iterable[tuple[str, str]] = (),
                        queue: QueueContext | None = None) -> float | None:
        """Bring one job's children and status in line with its spec. `pods` and `children`
        ((kind, name) of its ConfigMaps and Services) are what the stores show, `queue`
        what they show of Kueue (None: the Kueue integration is off). Returns when time alone
        will next change the job (seconds), for the clock, or None."""
        return await self.reconcile_latest(body, lambda: (pods, children, queue))

    async def reconcile_latest(self, body: Mapping[str, Any], indexed: Indexed) -> float | None:
        """As reconcile, with the pods and children read from the stores (`indexed()`) only
        when the pass starts. A call while a pass of the job waits to start joins that pass,
        handing it this (newer) body, and returns its result."""
        uid = body["metadata"]["uid"]
        waiting = self._waiting.get(uid)
        if waiting is not None:
            waiting.body = body
            return await asyncio.shield(waiting.result)
        waiting = _WaitingPass(body, asyncio.get_running_loop().create_future())
        self._waiting[uid] = waiting
        result = None
        shown = None
        lock = self.memory.lock(uid)
        try:
            async with lock:
                if self._waiting.get(uid) is waiting:
                    del self._waiting[uid]
                shown = indexed()
                if shown is not None:
                    pods, children, queue = shown
                    result = await self._passes(waiting.body, list(pods), frozenset(children),
                                                queue)
            return result
        finally:
            if self._waiting.get(uid) is waiting:
                del self._waiting[uid]
            if shown is None or not self.memory.holds(uid, lock):
                # The job was gone when the pass would have started, or was deleted
                # (forgotten) while it ran: what the pass recorded would stay for good.
                self.memory.forget(uid)
            waiting.result.set_result(result)  # those who joined never see our exception

    async def _passes(self, body: Mapping[str, Any], pods: list[PodState],
                      children: frozenset[tuple[str, str]],
                      queue: QueueContext | None) -> float | None:
        uid = body["metadata"]["uid"]
        for _ in range(MAX_PASSES):
            job = parse_spec(body, self.memory.written.latest(uid, body.get("status") or {}))
            if job is None:
                return None
            seen = await observe(self.kube, self.memory, body, job, pods, children, queue)
            now = utcnow()
            actions = plan_pass(seen, now)
            if await self.applier.apply(seen, actions, now):
                return actions.requeue_after
        return None

    async def refresh_progress(self, body: Mapping[str, Any]) -> None:
        await self.applier.refresh_progress(body)

    def forget(self, uid: str) -> None:
        self.memory.forget(uid)
