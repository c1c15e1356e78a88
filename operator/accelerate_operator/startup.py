"""The steps of a pass while the group's pods start (decision._Pass): the Waiting condition and its
Warning events, which repeat what the scheduler or the kubelet wrote on a pod that cannot start
(waiting.py), and spec.runPolicy.waitingTimeoutSeconds, which fails a job whose pods have not all
started that long after they were created.

The Waiting condition is True from the first pass that sees a pod of the current attempt stuck
(an image it cannot pull, a missing ConfigMap or Secret, no node that fits, an unbound PVC, an
init container crash-looping) until every pod of the group has started or the attempt ends. One
Warning event is posted per cause: the kubelet alternating ErrImagePull and ImagePullBackOff is
one cause, a pod that is scheduled at last and then cannot pull its image is a second one."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from .constants import PENDING, RESTARTING, WAITING
from .observed import PodState
from .status import Event
from .timefmt import parse_time
from .waiting import family

if TYPE_CHECKING:
    from .decision import Plan

WAITING_TIMEOUT_REASON = "WaitingTimeoutExceeded"
STARTED_REASON = "PodsStarted"


def _waiting(current: Sequence[PodState]) -> list[PodState]:
    """The pods of the group that have not started, by index."""
    return sorted((p for p in current if p.phase == PENDING and not p.deleting),
                  key=lambda p: p.index)


def _describe(pods: Sequence[PodState]) -> str:
    """The first pod's reason and message, and how many more wait."""
    first = pods[0]
    text = first.waiting.describe(first.name) if first.waiting else f"pod {first.name} is Pending"
    return text + (f" ({len(pods) - 1} more pod(s) of the group wait too)" if len(pods) > 1
                   else "")


class StartSteps:
    """The start-up steps of the pass (decision._Pass)."""

    wait_due: datetime | None

    def waiting(self, current: Sequence[PodState]) -> None:
        """Set the Waiting condition from the pods that cannot start, with one Warning event per
        cause; clear it once none of the group's pods waits any more. A pod that is between two
        tries (an init container running again) leaves the condition as it was."""
        pending = _waiting(current)
        stuck = [p for p in pending if p.waiting is not None and p.waiting.stuck]
        before = self.out.conditions.get(WAITING) or {}
        was = before.get("reason") if before.get("status") == "True" else None
        if not stuck:
            if not pending and was is not None:
                self.out.condition(WAITING, False, STARTED_REASON,
                                   "every pod of the group has started")
            return
        reason = stuck[0].waiting.reason  # type: ignore[union-attr]
        message = _describe(stuck)
        self.out.condition(WAITING, True, reason, message)
        if was is None or family(was) != family(reason):
            self.out.events.append(Event("Warning", reason, message))

    def waiting_timeout(self, current: Sequence[PodState]) -> Plan | None:
        """Fail the job when a pod of the group has not started waitingTimeoutSeconds after the
        group's pods were created; until then, that time is the clock's requeue."""
        timeout = self.job.run_policy.waiting_timeout_seconds
        started = parse_time(self.status.get("attemptStartTime"))
        pending = _waiting(current)
        if not timeout or started is None or not pending \
                or self.out.previous_phase not in (PENDING, RESTARTING):
            return None
        due = started + timedelta(seconds=timeout)
        if self.now < due:
            self.wait_due = due
            return None
        stuck = [p for p in pending if p.waiting is not None and p.waiting.stuck] or pending
        return self.fail(WAITING_TIMEOUT_REASON,
                         f"not started {timeout}s after the group's pods were created "
                         f"(spec.runPolicy.waitingTimeoutSeconds; 0 waits forever): "
                         f"{_describe(stuck)}")
