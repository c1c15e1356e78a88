"""The operator's in-memory state, per job: caches only.

Everything here may be lost (an operator restart, a second replica never shares it) without
changing any outcome: the API server and the informers' stores hold the truth, and the next pass
reads it, at worst after one more API call. Each cache says why. Nothing here talks to the API
server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accelerate_trainer.contract import ATTEMPT_LABEL, NODE_INDEX_LABEL

from .constants import PENDING
from .status import PodState

# How long an object this operator created stays "in flight" when no watch event shows it.
IN_FLIGHT_SECONDS = 30.0


class WrittenStatus:
    """The last status this operator wrote per job. The job's store may lag behind our own
    writes, and planning from a stale attempt number would recreate a group just deleted.
    Lost on restart: the start-up listing reads the status from the server, which has every
    write by then."""

    def __init__(self) -> None:
        self._written: dict[str, dict[str, Any]] = {}

    def remember(self, uid: str, status: Mapping[str, Any]) -> None:
        self._written[uid] = dict(status)

    def latest(self, uid: str, status: Mapping[str, Any]) -> dict[str, Any]:
        """The job's status as of our last write, unless the server already shows a newer one."""
        written = self._written.get(uid)
        if written and int(written.get("attempt", 0)) >= int(status.get("attempt") or 0):
            return {**dict(status), **written}
        return dict(status)

    def forget(self, uid: str) -> None:
        self._written.pop(uid, None)


@dataclass(frozen=True)
class _Created:
    attempt: int | None
    index: int | None
    when: float


class InFlight:
    """Children and pods this operator created that the stores do not show yet. Without them
    a pod event arriving first would plan those pods again (a 409 each) and patch the status
    twice (docs/benchmarks.md, finding 2). Entries go when a store shows the object, when the
    job moves to another attempt, or after IN_FLIGHT_SECONDS (so a pod deleted before the store
    saw it is not hidden for long). Lost on restart: the controller fills every store before
    any pass, so the stores then show everything created before."""

    def __init__(self, ttl: float = IN_FLIGHT_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl, self._clock = ttl, clock
        self._created: dict[str, dict[tuple[str, str], _Created]] = {}

    def record(self, uid: str, manifests: Iterable[Mapping[str, Any]]) -> None:
        entries = self._created.setdefault(uid, {})
        now = self._clock()
        for manifest in manifests:
            labels = manifest["metadata"].get("labels") or {}
            attempt, index = labels.get(ATTEMPT_LABEL), labels.get(NODE_INDEX_LABEL)
            entries[(manifest["kind"], manifest["metadata"]["name"])] = _Created(
                int(attempt) if attempt is not None else None,
                int(index) if index is not None else None, now)

    def add_to(self, uid: str, attempt: int, pods: Sequence[PodState],
               children: frozenset[tuple[str, str]]
               ) -> tuple[list[PodState], frozenset[tuple[str, str]]]:
        """The pods and children the stores show, plus those in flight (pods as Pending)."""
        entries = self._created.get(uid) or {}
        seen_pods = {(p.name, p.attempt) for p in pods}
        now = self._clock()
        extra_pods, extra_children = [], set()
        for (kind, name), created in list(entries.items()):
            is_pod = kind == "Pod"
            shown = (name, created.attempt) in seen_pods if is_pod else (kind, name) in children
            stale = now - created.when > self._ttl or (is_pod and created.attempt != attempt)
            if shown or stale:
                del entries[(kind, name)]
            elif is_pod:
                extra_pods.append(PodState(name=name, index=created.index, attempt=attempt,
                                           phase=PENDING))
            else:
                extra_children.add((kind, name))
        return [*pods, *extra_pods], children | extra_children

    def forget(self, uid: str) -> None:
        self._created.pop(uid, None)


class Refusals:
    """The API server's refusal of a job's pod (Pod Security, a quota, validation), kept for the
    next pass, which fails the job with the server's reason instead of retrying the same pod
    forever. Lost on restart: the next pass creates the pod again and is refused again."""

    def __init__(self) -> None:
        self._refused: dict[str, str] = {}

    def record(self, uid: str, message: str) -> None:
        self._refused[uid] = message

    def get(self, uid: str) -> str | None:
        return self._refused.get(uid)

    def forget(self, uid: str) -> None:
        self._refused.pop(uid, None)


class Memory:
    """Every per-job cache, and a lock per job: a job event and a pod event must not plan at
    once (the lock holds no data; a restart starts with none taken)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.written = WrittenStatus()
        self.in_flight = InFlight(clock=clock)
        self.refusals = Refusals()
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, uid: str) -> asyncio.Lock:
        return self._locks.setdefault(uid, asyncio.Lock())

    def holds(self, uid: str, lock: asyncio.Lock) -> bool:
        """Whether `lock` is still the job's: False once the job was forgotten meanwhile."""
        return self._locks.get(uid) is lock

    def forget(self, uid: str) -> None:
        """The job is gone: drop everything kept for it."""
        self._locks.pop(uid, None)
        for cache in (self.written, self.in_flight, self.refusals):
            cache.forget(uid)
