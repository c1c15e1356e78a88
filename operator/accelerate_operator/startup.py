"""The start-up policy: while the group's pods start, the Waiting condition and its Warning events
repeat what the scheduler or the kubelet wrote on a pod that cannot start (not_started.py), and
spec.runPolicy.waitingTimeoutSeconds fails a job whose pods have not all started that long after
they were created.

The Waiting condition is True from the first pass that sees a pod of the current attempt stuck
(an image it cannot pull, a missing ConfigMap or Secret, no node that fits, an unbound PVC, an
init container crash-looping) until every pod of the group has started or the attempt ends. One
Warning event is posted per cause: the kubelet alternating ErrImagePull and ImagePullBackOff is
one cause, a pod that is scheduled at last and then cannot pull its image is a second one."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from .constants import PENDING, RESTARTING, WAITING
from .not_started import BACK_OFFS, family
from .pod_state import PodState
from .status import Event, StatusBuilder

WAITING_TIMEOUT_REASON = "WaitingTimeoutExceeded"
STARTED_REASON = "PodsStarted"


def pending(current: Sequence[PodState]) -> list[PodState]:
    """The pods of the group that have not started, by index."""
    return sorted((p for p in current if p.phase == PENDING and not p.deleting),
                  key=lambda p: p.index)


def _stuck(pods: Sequence[PodState]) -> list[PodState]:
    return [p for p in pods if p.not_started is not None and p.not_started.stuck]


def _describe(pods: Sequence[PodState]) -> str:
    """The first pod's reason and message, and how many more have not started."""
    first = pods[0]
    text = (first.not_started.describe(first.name) if first.not_started
            else f"pod {first.name} is Pending")
    return text + (f" ({len(pods) - 1} more pod(s) of the group wait too)" if len(pods) > 1
                   else "")


def set_waiting(out: StatusBuilder, current: Sequence[PodState]) -> None:
    """Set the Waiting condition from the pods that cannot start, with one Warning event per
    cause; clear it once none of the group's pods waits any more. A pod that is between two
    tries (an init container running again) leaves the condition as it was."""
    waiting = pending(current)
    stuck = _stuck(waiting)
    before = out.conditions.get(WAITING) or {}
    was = before.get("reason") if before.get("status") == "True" else None
    if not stuck:
        if not waiting and was is not None:
            out.condition(WAITING, False, STARTED_REASON, "every pod of the group has started")
        return
    reason = stuck[0].not_started.reason  # type: ignore[union-attr]
    message = _describe(stuck)
    if reason in BACK_OFFS and was is not None and family(was) == family(reason):
        message = before.get("message") or message  # the error it backs off from says more
    out.condition(WAITING, True, reason, message)
    if was is None or family(was) != family(reason):
        out.events.append(Event("Warning", reason, message))


def waiting_timeout(timeout: int | None, attempt_started: datetime | None,
                    previous_phase: str | None, current: Sequence[PodState],
                    now: datetime, said: str | None = None) -> tuple[str | None, datetime | None]:
    """(why the job fails, None) when a pod of the group has not started `timeout` seconds
    (spec.runPolicy.waitingTimeoutSeconds) after the group's pods were created
    (status.attemptStartTime), with what the Waiting condition `said` (set_waiting keeps the
    error a back-off waits after) or else the pods' reasons; until then (None, the time it
    will)."""
    waiting = pending(current)
    if not timeout or attempt_started is None or not waiting \
            or previous_phase not in (PENDING, RESTARTING):
        return None, None
    due = attempt_started + timedelta(seconds=timeout)
    if now < due:
        return None, due
    return (f"not started {timeout}s after the group's pods were created "
            f"(spec.runPolicy.waitingTimeoutSeconds; 0 waits forever): "
            f"{said or _describe(_stuck(waiting) or waiting)}"), None


def waiting_message(out: StatusBuilder) -> str | None:
    """What the Waiting condition says while it is True."""
    condition = out.conditions.get(WAITING) or {}
    return condition.get("message") if condition.get("status") == "True" else None

