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
  from an older checkpoint trains again (read from two consecutive reports of one group);
- idle: training time in which no step advanced: between two reports of the same step, and from
  the last reported step to the job's end or suspension.

productive = wall - lost: the time between reports whose steps advanced, and no other. A job
that never reports a step (a wrong script path, a script that prints no progress) kept nothing.
Time trained by an elastic job's group at a reduced size counts as productive, and is shown
apart (reducedSeconds). A step's time is when pod 0 saw its progress line (the report says;
else when the operator read it), and pod 0 pushes a group's first progress at once, so a
boundary is as precise as the clocks' agreement; between reports it is as fine as their
spacing (a few seconds). Pure: no clock, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from .constants import FINISHED_PHASES, PENDING, QUEUED, RESTARTING, RUNNING, SUSPENDED
from .timefmt import format_time, parse_time

WAITING, STARTUP, TRAINING, RECOVERY, DONE = "Waiting", "Startup", "Training", "Recovery", "Done"
CAUSES = {WAITING: "waiting", STARTUP: "startup", RECOVERY: "recovery"}
LOST_KEYS = ("waiting", "startup", "recovery", "recomputed", "idle")


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
    # The group that reported runs at a reduced size (an elastic job, status.elastic).
    reduced: bool = False


@dataclass(frozen=True)
class Ledger:
    """status.goodput's bookkeeping: closed lost time by cause, the open segment (what the job
    is doing since `since`), and the newest report (its step, when it was read, the highest step
    ever reported); the training time at a reduced size, closed, and whether the open training
    segment is at one."""

    lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOST_KEYS, 0.0))
    segment: str = WAITING
    since: datetime | None = None
    interruptions: int = 0
    last_recovery: float | None = None
    highest: int | None = None
    last_step: int | None = None
    last_step_time: datetime | None = None
    ended: datetime | None = None
    reduced: float = 0.0
    reduced_open: bool = False

    def close(self, now: datetime, segment: str, since: datetime | None = None) -> Ledger:
        """End the open segment at `now` (adding its time to its cause) and open `segment`."""
        lost, cause = dict(self.lost), CAUSES.get(self.segment)
        seconds = max((now - self.since).total_seconds(), 0.0) if self.since else 0.0
        if cause is not None:
            lost[cause] += seconds
        last_recovery = seconds if self.segment == RECOVERY and self.since else \
            self.last_recovery
        reduced = self.reduced + (seconds if self.segment == TRAINING and self.reduced_open
                                  else 0.0)
        return replace(self, lost=lost, segment=segment, since=since or now,
                       last_recovery=last_recovery, reduced=reduced)

    def idle_until(self, now: datetime, segment: str) -> Ledger:
        """End a training segment at its last step, the time after it idle, and open
        `segment` at `now`."""
        if self.segment != TRAINING or self.last_step_time is None:
            return self.close(now, segment)
        closed = self.close(self.last_step_time, segment, now)
        idle = max((now - self.last_step_time).total_seconds(), 0.0)
        return replace(closed, lost={**closed.lost, "idle": closed.lost["idle"] + idle})


def update_goodput(stored: Mapping[str, Any] | None, moment: Moment) -> dict[str, Any]:
    """status.goodput after this pass: the stored ledger moved by `moment`, then shown."""
    ledger = read_ledger(stored, moment.created) if stored else _first_ledger(moment)
    ledger = _ran(ledger, moment)
    ledger = _recovery_began(ledger, moment)
    # A report comes from the group the pass observed: a step it brings was trained before
    # whatever fault the same pass acts on.
    if moment.step is not None:
        ledger = _reported(ledger, moment.step, _step_time(ledger, moment), moment.reduced)
    ledger = _stopped(ledger, moment)
    if moment.phase_after in FINISHED_PHASES and ledger.segment != DONE:
        ledger = replace(ledger.idle_until(moment.now, DONE), ended=moment.now)
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
        return ledger.idle_until(moment.now, WAITING)
    return ledger


def _recovery_began(ledger: Ledger, moment: Moment) -> Ledger:
    """A recovery opens at the last step the operator had seen, which pod 0's pushes (at the
    pace of the job's progress writes) leave behind the last one trained. Restarted in place,
    pod 0's report names the true last step of the attempt before: the recovery began there, and
    the steps up to it were trained (the ones after the checkpoint are then computed again)."""
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
    """The group runs: waiting ends and startup begins (a recovery goes on to the first step)."""
    if moment.phase_after != RUNNING or moment.phase_before == RUNNING:
        return ledger
    if ledger.segment == WAITING:
        return ledger.close(moment.now, STARTUP)
    return ledger


def _reported(ledger: Ledger, step: int, now: datetime, reduced: bool = False) -> Ledger:
    """A report of `step`: the first one ends startup or recovery (training opens, at a reduced
    size or not); a later one that did not advance was idle, one below the highest step already
    reported recomputation."""
    if ledger.segment in (WAITING, STARTUP, RECOVERY):
        ledger = replace(ledger.close(now, TRAINING), reduced_open=reduced)
    elif ledger.segment == TRAINING and ledger.last_step_time is not None:
        seconds = max((now - ledger.last_step_time).total_seconds(), 0.0)
        cause = "idle" if ledger.last_step is not None and step <= ledger.last_step \
            else "recomputed"
        counted = seconds if cause == "idle" else _recomputed(ledger, step, now)
        ledger = replace(ledger, lost={**ledger.lost, cause: ledger.lost[cause] + counted})
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
    now_closed = ledger.close(end, ledger.segment) if ledger.segment != DONE else ledger
    lost = now_closed.lost
    lost_total = min(sum(lost.values()), wall)
    productive = wall - lost_total
    percent = round(100.0 * productive / wall, 1) if wall > 0 else 0.0
    reduced = min(now_closed.reduced, productive)
    summary = f"{percent:.1f}%"
    if reduced > 0:
        summary += f" ({100.0 * reduced / productive:.0f}% reduced)"
    shown = {
        "percent": percent, "summary": summary,
        "wallSeconds": _seconds(wall), "productiveSeconds": _seconds(productive),
        "reducedSeconds": _seconds(reduced) if reduced > 0 else None,
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
              "lastStepTime": _stamp(ledger.last_step_time), "ended": _stamp(ledger.ended),
              "reduced": round(ledger.reduced, 3) or None}
    # Always written, false too: status writes are merge patches, and a key left out would
    # keep a reduced segment open after the group grew back.
    return {**{k: v for k, v in stored.items() if v is not None},
            "reducedOpen": ledger.reduced_open}


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
                  ended=parse_time(kept.get("ended")), reduced=float(kept.get("reduced") or 0.0),
                  reduced_open=bool(kept.get("reducedOpen")))
