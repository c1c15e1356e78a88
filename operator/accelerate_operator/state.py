"""What the operator keeps in memory about each job, in one object, `JobState`, dropped in one
place, `JobStates.forget`. Caches only: losing them all (an operator restart, a standby taking
over) changes no outcome, since the API server and kopf's indexes hold the truth and the next
pass reads it, at worst after one more API call. Nothing here talks to the API server."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from accelerate_trainer.contract import ATTEMPT_LABEL, NODE_INDEX_LABEL

from .constants import PENDING
from .observed import PodState

# How long an object this operator created counts as existing when no index shows it yet.
IN_FLIGHT_SECONDS = 30.0


@dataclass(frozen=True)
class _Created:
    attempt: int | None
    index: int | None
    when: float


@dataclass
class JobState:
    """One job's caches.

    - `written`: the last status this operator wrote. kopf's view of the job may lag behind our
      own writes, and planning from a stale attempt number would recreate a group just deleted.
    - `in_flight`: children and pods created that the indexes do not show yet (controller-
      runtime's "expectations"). Without them a pass run before the indexes catch up would
      plan those pods again (a 409 each) and write the status twice. An entry goes when a
      pass finds the object in an index, when the object's DELETED event comes, when the job
      moves to another attempt, or after IN_FLIGHT_SECONDS.
    - `next_progress_write`: the earliest time (the operator's clock) status.progress may be
      written again, however often pod 0 reports; `next_info_read`: when the head of pod 0's
      log may be read again for its trainer's versions (observe.py).
    - `check_exists`: a deletion asked for the next pass (controller.py, the grace check).
    - `terminating_until`: no pass before this (the operator's clock): the namespace refused a
      create for being deleted.
    """

    uid: str
    written: dict[str, Any] | None = None
    in_flight: dict[tuple[str, str], _Created] = field(default_factory=dict)
    next_progress_write: float = 0.0
    next_info_read: float = 0.0
    check_exists: bool = False
    terminating_until: float = 0.0

    def latest_status(self, status: Mapping[str, Any]) -> dict[str, Any]:
        """The job's status as of our last write, unless the server already shows a newer one."""
        written = self.written
        if written and int(written.get("attempt", 0)) >= int(status.get("attempt") or 0):
            return {**dict(status), **written}
        return dict(status)

    def remember_status(self, status: Mapping[str, Any]) -> None:
        self.written = {**(self.written or {}), **status}

    def record_created(self, manifests: Iterable[Mapping[str, Any]], now: float) -> None:
        for manifest in manifests:
            labels = manifest["metadata"].get("labels") or {}
            attempt, index = labels.get(ATTEMPT_LABEL), labels.get(NODE_INDEX_LABEL)
            self.in_flight[(manifest["kind"], manifest["metadata"]["name"])] = _Created(
                int(attempt) if attempt is not None else None,
                int(index) if index is not None else None, now)

    def gone(self, kind: str, metadata: Mapping[str, Any]) -> None:
        """An object's DELETED event: it was there, so it is no longer in flight. Without this,
        one deleted before any pass saw it in the indexes would count as existing until
        IN_FLIGHT_SECONDS had passed, and its recreation wait that long. A pod of an earlier
        attempt (the same name) leaves the new one's entry alone."""
        created = self.in_flight.get((kind, metadata["name"]))
        attempt = (metadata.get("labels") or {}).get(ATTEMPT_LABEL)
        if created is not None and (created.attempt is None or attempt is None
                                    or created.attempt == int(attempt)):
            del self.in_flight[(kind, metadata["name"])]

    def with_in_flight(self, attempt: int, pods: Sequence[PodState],
                       children: frozenset[tuple[str, str]], now: float, ttl: float =
                       IN_FLIGHT_SECONDS) -> tuple[list[PodState], frozenset[tuple[str, str]]]:
        """The pods and children the indexes show, plus those in flight (pods as Pending)."""
        seen_pods = {(p.name, p.attempt) for p in pods}
        extra_pods, extra_children = [], set()
        for (kind, name), created in list(self.in_flight.items()):
            is_pod = kind == "Pod"
            shown = (name, created.attempt) in seen_pods if is_pod else (kind, name) in children
            stale = now - created.when > ttl or (is_pod and created.attempt != attempt)
            if shown or stale:
                del self.in_flight[(kind, name)]
            elif is_pod:
                extra_pods.append(PodState(name=name, index=created.index, attempt=attempt,
                                           phase=PENDING))
            else:
                extra_children.add((kind, name))
        return [*pods, *extra_pods], children | extra_children


class JobStates:
    """Every job's JobState, by key ((namespace, name)); a job created again under its name
    (another uid) starts from a fresh one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._states: dict[Hashable, JobState] = {}

    def get(self, key: Hashable, uid: str) -> JobState:
        state = self._states.get(key)
        if state is None or state.uid != uid:
            state = self._states[key] = JobState(uid)
        return state

    def peek(self, key: Hashable) -> JobState | None:
        return self._states.get(key)

    def forget(self, key: Hashable) -> None:
        self._states.pop(key, None)

    def __len__(self) -> int:
        return len(self._states)
