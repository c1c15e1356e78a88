"""Goodput: the share of a job's wall time spent on training that was kept.

Derived, pass by pass, from what the operator already sees (the phase, the attempt, pod 0's
progress reports and when they arrived) and kept in status.goodput, so a restarted operator goes
on from the stored ledger. Wall time runs from the job's creation to now (or to its end), and
splits into productive time and time lost, by cause:

- waiting: until the group runs (the scheduler, Kueue's quota, image pulls), and while the job is
  suspended;
- startup: from the group running to the first step it reports (imports, rendezvous, loading);
- recovery: from a fault (the last step the stopped group reported; the restart itself when it
  had reported none) to the first step of the next group. A fault is a restart, whatever its
  cause, or a Kueue eviction: each counts as one interruption;
- recomputed: time spent on steps at or below the highest step already reported, which a resume
  from an older checkpoint trains again (read from two consecutive reports of one group).

productive = wall - lost. A step's time is when pod 0 saw its progress line (the report says;
else when the operator read it), and pod 0 pushes a group's first progress at once, so a
boundary is as precise as the clocks' agreement; between reports it is as fine as their
spacing (a few seconds). Until a job's first report, the
operator cannot tell a long startup from a script that reports nothing: a job that never
reports counts its running time as productive, and its recovery ends when the new group runs.
Pure: no clock, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from .constants import FAILED, FINISHED_PHASES, PENDING, QUEUED, RESTARTING, RUNNING, SUSPENDED
from .timefmt import format_time, parse_time

WAITING, STARTUP, TRAINING, RECOVERY, DONE = "Waiting", "Startup", "Training", "Recovery", "Done"
CAUSES = {WAITING: "waiting", STARTUP: "startup", RECOVERY: "recovery"}
LOST_KEYS = ("waiting", "startup", "recovery", "recomputed")


@dataclass(frozen=True)
class Moment:
    """What one pass changed that goodput counts: the phase and attempt before and after it, and
    the step of a report it writes (None: none) with when pod 0 saw it."""

    now: datetime
    created: datetime
    phase_before: str | None
    phase_after: str | None
    attempt_before: int
    attempt_after: int
    step: int | None = None
    step_time: datetime | None = None
    # Restarted in place: the last step of the attempt before, and when pod 0 saw it.
    previous_step: int | None = None
    previous_time: datetime | None = None


@dataclass(frozen=True)
class Ledger:
    """status.goodput's bookkeeping: closed lost time by cause, the open segment (what the job
    is doing since `since`), and the newest report (its step, when it was read, the highest step
    ever reported)."""

    lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOST_KEYS, 0.0))
    segment: str = WAITING
    since: datetime | None = None
    interruptions: int = 0
    last_recovery: float | None = None
    highest: int | None = None
    last_step: int | None = None
    last_step_time: datetime | None = None
    ended: datetime | None = None

    def close(self, now: datetime, segment: str, since: datetime | None = None, *,
              first_step: bool = False) -> Ledger:
        """End the open segment at `now` (adding its time to its cause) and open `segment`. A
        startup counts once some step was reported (`first_step`: this one)."""
        lost = dict(self.lost)
        cause = CAUSES.get(self.segment)
        counted = cause is not None and (self.segment != STARTUP or self.highest is not None
                                         or first_step)
        if counted and self.since is not None:
            lost[cause] += max((now - self.since).total_seconds(), 0.0)
        last_recovery = self.last_recovery
        if self.segment == RECOVERY and self.since is not None:
            last_recovery = max((now - self.since).total_seconds(), 0.0)
        return replace(self, lost=lost, segment=segment, since=since or now,
                       last_recovery=last_recovery)


def update_goodput(stored: Mapping[str, Any] | None, moment: Moment) -> dict[str, Any]:
    """status.goodput after this pass: the stored ledger moved by `moment`, then shown."""
    ledger = read_ledger(stored, moment.created) if stored else _first_ledger(moment)
    ledger = _ran(ledger, moment)
    ledger = _recovery_began(ledger, moment)
    # A report comes from the group the pass observed: a step it brings was trained before
    # whatever fault the same pass acts on.
    if moment.step is not None:
        ledger = _reported(ledger, moment.step, _step_time(ledger, moment))
    ledger = _stopped(ledger, moment)
    if moment.phase_after in FINISHED_PHASES and ledger.segment != DONE:
        # A job that failed before any step was reported kept nothing: its startup is lost.
        failed = moment.phase_after == FAILED
        ledger = replace(ledger.close(moment.now, DONE, first_step=failed), ended=moment.now)
    return show(ledger, moment.created, moment.now)


def _first_ledger(moment: Moment) -> Ledger:
    """A job's first ledger: waiting since its creation. A job that is past that already (it ran
    under an operator that kept no goodput) starts from now, its earlier time counted
    productive: nothing says how it went."""
    phase = moment.phase_before
    if phase in (None, PENDING, QUEUED):
        return Ledger(since=moment.created)
    segment = {RUNNING: TRAINING, RESTARTING: RECOVERY, SUSPENDED: WAITING}.get(phase, DONE)
    return Ledger(segment=segment, since=moment.now,
                  ended=moment.now if segment == DONE else None)


def _stopped(ledger: Ledger, moment: Moment) -> Ledger:
    """A new group after a fault (a restart, a Kueue eviction): recovery runs from the stopped
    group's last report. A suspension: waiting."""
    fault = (moment.attempt_after > moment.attempt_before
             and moment.phase_after in (RESTARTING, QUEUED))
    if fault:
        if ledger.segment == RECOVERY:  # a fault before the last one's recovery ended
            return replace(ledger, interruptions=ledger.interruptions + 1)
        since = ledger.last_step_time if ledger.segment == TRAINING else None
        closed = ledger.close(since or moment.now, RECOVERY, since)
        return replace(closed, interruptions=ledger.interruptions + 1)
    if moment.phase_after == SUSPENDED and moment.phase_before != SUSPENDED:
        return ledger.close(moment.now, WAITING)
    return ledger


def _recovery_began(ledger: Ledger, moment: Moment) -> Ledger:
    """A recovery opens at the last step the operator had seen, which pod 0's pushes (at most
    every 8 s) leave behind the last one trained. Restarted in place, pod 0's report names the
    true last step of the attempt before: the recovery began there, and the steps up to it were
    trained (the ones after the checkpoint are then computed again)."""
    when = moment.previous_time
    if ledger.segment != RECOVERY or when is None or ledger.since is None \
            or not ledger.since < when <= moment.now:
        return ledger
    highest = moment.previous_step if ledger.highest is None or moment.previous_step is None \
        else max(ledger.highest, moment.previous_step)
    return replace(ledger, since=when, highest=highest)


def _step_time(ledger: Ledger, moment: Moment) -> datetime:
    """When the reported step happened: pod 0's time for it, kept between the ledger's last
    boundary and now (another clock may disagree a little)."""
    earliest = max(t for t in (ledger.since, ledger.last_step_time, moment.created)
                   if t is not None)
    return min(max(moment.step_time or moment.now, earliest), moment.now)


def _ran(ledger: Ledger, moment: Moment) -> Ledger:
    """The group runs: waiting ends and startup begins. A job that has reported no step yet
    ends its recovery here (it may never report one)."""
    if moment.phase_after != RUNNING or moment.phase_before == RUNNING:
        return ledger
    if ledger.segment == WAITING:
        return ledger.close(moment.now, STARTUP)
    if ledger.segment == RECOVERY and ledger.highest is None:
        return ledger.close(moment.now, TRAINING)
    return ledger


def _reported(ledger: Ledger, step: int, now: datetime) -> Ledger:
    """A report of `step`: the first one ends startup or recovery; later ones below the highest
    step already reported are recomputation."""
    if ledger.segment in (WAITING, STARTUP, RECOVERY):
        ledger = ledger.close(now, TRAINING, first_step=True)
    elif ledger.segment == TRAINING and ledger.last_step_time is not None:
        ledger = replace(ledger, lost={**ledger.lost, "recomputed": ledger.lost["recomputed"]
                                       + _recomputed(ledger, step, now)})
    highest = step if ledger.highest is None else max(ledger.highest, step)
    return replace(ledger, highest=highest, last_step=step, last_step_time=now)


def _recomputed(ledger: Ledger, step: int, now: datetime) -> float:
    """The seconds since the previous report spent below the highest step: all of them when
    this report is still at or below it, the share of the steps below it when it crossed it."""
    seconds = max((now - ledger.last_step_time).total_seconds(), 0.0)
    previous, highest = ledger.last_step or 0, ledger.highest
    if highest is None or previous >= highest:
        return 0.0
    if step <= highest:
        return seconds
    return seconds * (highest - previous) / (step - previous)


def show(ledger: Ledger, created: datetime, now: datetime) -> dict[str, Any]:
    """status.goodput: the totals as of `now` (the open segment counted up to it), and the
    ledger the next pass goes on from."""
    end = ledger.ended or now
    wall = max((end - created).total_seconds(), 0.0)
    lost = ledger.close(end, ledger.segment).lost if ledger.segment != DONE else ledger.lost
    lost_total = min(sum(lost.values()), wall)
    percent = round(100.0 * (wall - lost_total) / wall, 1) if wall > 0 else 0.0
    shown = {
        "percent": percent, "summary": f"{percent:.1f}%",
        "wallSeconds": _seconds(wall), "productiveSeconds": _seconds(wall - lost_total),
        "lostSeconds": {key: _seconds(value) for key, value in lost.items()},
        "interruptions": ledger.interruptions,
        "lastRecoverySeconds": _seconds(ledger.last_recovery),
    }
    return {**{k: v for k, v in shown.items() if v is not None}, "ledger": _stored(ledger)}


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _stamp(moment: datetime | None) -> str | None:
    return None if moment is None else format_time(moment, precise=True)


def _stored(ledger: Ledger) -> dict[str, Any]:
    stored = {"lost": {k: round(v, 3) for k, v in ledger.lost.items()},
              "segment": ledger.segment, "since": _stamp(ledger.since),
              "highestStep": ledger.highest, "lastStep": ledger.last_step,
              "lastStepTime": _stamp(ledger.last_step_time), "ended": _stamp(ledger.ended)}
    return {k: v for k, v in stored.items() if v is not None}


def read_ledger(stored: Mapping[str, Any] | None, created: datetime) -> Ledger:
    """The ledger status.goodput holds, or a fresh one: waiting since the job's creation."""
    stored = stored or {}
    kept = stored.get("ledger") or {}
    if not kept:
        return Ledger(since=created)
    lost = {key: float((kept.get("lost") or {}).get(key) or 0.0) for key in LOST_KEYS}
    return Ledger(lost=lost, segment=kept.get("segment") or WAITING,
                  since=parse_time(kept.get("since")) or created,
                  interruptions=int(stored.get("interruptions") or 0),
                  last_recovery=stored.get("lastRecoverySeconds"),
                  highest=kept.get("highestStep"), last_step=kept.get("lastStep"),
                  last_step_time=parse_time(kept.get("lastStepTime")),
                  ended=parse_time(kept.get("ended")))
