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
from .pod_state import PodState
from .status import attempt_of, merge_patch

# How long an object this operator created counts as existing when no index shows it yet.
IN_FLIGHT_SECONDS = 30.0


@dataclass(frozen=True)
class Refusal:
    """The API server's refusal of one of the job's children, in an earlier pass: the job fails
    with the server's message, under the reason `<kind>Rejected`."""

    kind: str
    message: str

    @property
    def reason(self) -> str:
        return f"{self.kind}Rejected"


@dataclass(frozen=True)
class _Created:
    attempt: int | None
    index: int | None
    when: float


@dataclass
class JobState:
    """One job's caches.

    - `written`: the last status this operator wrote. kopf's view of the job may lag behind our
      own writes, and deciding from a stale attempt number would recreate a group just deleted.
    - `in_flight`: children and pods created that the indexes do not show yet (controller-
      runtime's "expectations"). Without them a pass run before the indexes catch up would
      create those pods again (a 409 each) and write the status twice. An entry goes when a
      pass finds the object in an index, when the object's DELETED event comes, when the job
      moves to another attempt, or after IN_FLIGHT_SECONDS.
    - `next_progress_write`: the earliest time (the operator's clock) status.progress may be
      written again, however often pod 0 reports (report_settings.PROGRESS_WRITE_SECONDS).
    - `refused`: the API server refused one of the job's children for good: the next pass
      fails the job with its reason (reconciler.Applier).
    - `placeholder_refused`: why the API server last refused an elastic job's placeholder pod
      (its Warning event is posted once per cause: reconciler.Applier).
    - `check_exists`: a deletion asked for the next pass (controller.py, the grace check).
    - `terminating_until`: no pass before this (the operator's clock): the namespace refused a
      create for being deleted.

    Written only after what they record has happened (reconciler.Applier, controller.py); a
    pass reads them into its Snapshot.
    """

    uid: str
    written: dict[str, Any] | None = None
    in_flight: dict[tuple[str, str], _Created] = field(default_factory=dict)
    next_progress_write: float = 0.0
    refused: Refusal | None = None
    placeholder_refused: str | None = None
    check_exists: bool = False
    terminating_until: float = 0.0

    def latest_status(self, status: Mapping[str, Any]) -> dict[str, Any]:
        """The job's status as of our last write, unless the server already shows a newer one."""
        written = self.written
        if written and attempt_of(written) >= attempt_of(status):
            return {**dict(status), **written}
        return dict(status)

    def remember_status(self, patch: Mapping[str, Any]) -> None:
        """The status patch a pass wrote, merged as the API server merges it."""
        self.written = merge_patch(self.written, patch)

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
                       children: frozenset[tuple[str, str]], now: float
                       ) -> tuple[list[PodState], frozenset[tuple[str, str]]]:
        """The pods and children the indexes show, plus those in flight (pods as Pending) for
        the group of `attempt`. Reads only: prune_in_flight forgets what they show."""
        seen_pods = {(p.name, p.attempt) for p in pods}
        extra_pods, extra_children = [], set()
        for (kind, name), created in self.in_flight.items():
            if _settled(kind, name, created, attempt, seen_pods, children, now):
                continue
            if kind == "Pod":
                extra_pods.append(PodState(name=name, index=created.index, attempt=attempt,
                                           phase=PENDING))
            else:
                extra_children.add((kind, name))
        return [*pods, *extra_pods], children | extra_children

    def prune_in_flight(self, attempt: int, pods: Sequence[PodState],
                        children: frozenset[tuple[str, str]], now: float) -> None:
        """Forget what the indexes now show, what is too old, and pods of another group than
        `attempt`'s (the one the pass left the job at)."""
        seen_pods = {(p.name, p.attempt) for p in pods}
        for (kind, name), created in list(self.in_flight.items()):
            if _settled(kind, name, created, attempt, seen_pods, children, now):
                del self.in_flight[(kind, name)]


def _settled(kind: str, name: str, created: _Created, attempt: int,
             pods: set[tuple[str, int | None]], children: frozenset[tuple[str, str]],
             now: float) -> bool:
    """Whether an entry in flight is no longer: shown by the indexes, past IN_FLIGHT_SECONDS,
    or a pod of another group."""
    if kind == "Pod":
        return (name, created.attempt) in pods or created.attempt != attempt \
            or now - created.when > IN_FLIGHT_SECONDS
    return (kind, name) in children or now - created.when > IN_FLIGHT_SECONDS


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
