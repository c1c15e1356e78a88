"""Writing status: the conditions, phase, node counts and events a pass builds (StatusBuilder)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .api import JobSpec, build_topology_status
from .constants import (
    CONDITION_TYPES,
    CREATED,
    FAILED,
    PENDING,
    QUEUED,
    RESTARTING,
    RUNNING,
    SUCCEEDED,
    SUSPENDED,
    WAITING,
)
from .goodput import Moment, update_goodput
from .observed import Observed, PodState, group_attempt
from .progress import build_progress_status, build_trainer_status, progress_changed
from .timefmt import format_time, parse_time

# True while the job's accelerate config holds values accelerate would drop harmlessly (the
# render's JobSpec.config_warnings); listed after the phase conditions. Set on the pass that
# renders the config and kept from the status afterwards, since later passes do not render it.
CONFIG_WARNINGS = "ConfigWarnings"
CONFIG_WARNINGS_REASON = "IgnoredConfigValues"


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


class StatusBuilder:
    """Accumulates the new status and the events its transitions deserve."""

    def __init__(self, job: JobSpec, status: Mapping[str, Any], now: datetime):
        self.job = job
        self.now = now
        self.status = copy.deepcopy(dict(status))
        self.status["observedGeneration"] = job.generation
        if job.topology_resolved:
            self.status["topology"] = build_topology_status(job)
        self.previous_phase = status.get("phase")
        self.events: list[Event] = []
        self.conditions = {c["type"]: dict(c) for c in status.get("conditions") or []}

    def condition(self, type_: str, value: bool, reason: str, message: str) -> bool:
        """Set a condition; returns whether its status changed."""
        wanted = "True" if value else "False"
        current = self.conditions.get(type_)
        if current is None and not value:
            return False  # a condition that never happened is simply absent
        changed = current is None or current.get("status") != wanted
        if changed:
            transition = format_time(self.now)
        else:
            transition = current.get("lastTransitionTime", format_time(self.now))
        self.conditions[type_] = {
            "type": type_,
            "status": wanted,
            "reason": reason,
            "message": message,
            "lastTransitionTime": transition,
            "observedGeneration": self.job.generation,
        }
        return changed

    def phase(self, phase: str, reason: str, message: str, warning: bool = False) -> None:
        """Enter `phase`: set its condition True, clear the other live ones, emit an event.
        The message is said once, in the phase's condition: a cleared condition only names the
        phase (a failure's text, up to a few KiB, was in every condition)."""
        self.status["phase"] = phase
        if phase != PENDING:
            self.condition(phase, True, reason, message)
        for other in (QUEUED, WAITING, RUNNING, RESTARTING, SUSPENDED):
            if other != phase and other in self.conditions:
                self.condition(other, False, reason, f"the job is {phase} now ({reason})")
        if phase != self.previous_phase or (
            warning and self.status.get("lastFailure") != message
        ):
            self.events.append(Event("Warning" if warning else "Normal", reason, message))

    def counts(self, pods: Sequence[PodState]) -> None:
        active = [p for p in pods if not p.finished and not p.deleting]
        ready = [p for p in active if p.phase == RUNNING and p.ready]
        self.status["nodes"] = {
            "active": len(active),
            "ready": len(ready),
            "succeeded": sum(p.phase == SUCCEEDED for p in pods),
            "failed": sum(p.phase == FAILED for p in pods),
        }
        self.status["readyNodes"] = f"{len(ready)}/{self.job.num_nodes}"

    def finish(self) -> dict[str, Any]:
        self.status["conditions"] = [
            self.conditions[t] for t in (*CONDITION_TYPES, CONFIG_WARNINGS)
            if t in self.conditions
        ]
        self.status.setdefault("restarts", 0)
        self.status.setdefault("restartsCounted", self.status["restarts"])
        self.status.pop("reason", None)
        reason = self.reason()
        if reason:
            self.status["reason"] = reason
        return self.status

    def reason(self) -> str | None:
        """status.reason, the REASON column of `kubectl get`: why a job not yet running waits
        (the Waiting condition's reason, Kubernetes' own), else its phase condition's reason
        (Kueue's for a Queued job), else the Created condition's for a Pending one."""
        phase = self.status.get("phase")
        waiting = self.conditions.get(WAITING) or {}
        if phase in (PENDING, RESTARTING) and waiting.get("status") == "True":
            return waiting.get("reason")
        for type_ in (phase, CREATED if phase == PENDING else None):
            condition = self.conditions.get(type_) if type_ else None
            if condition and condition.get("status") == "True":
                return condition.get("reason")
        return None


# Status keys from what pod 0 reported (observe.py), and the goodput they move: written only when
# this pass writes, never put back from an older copy, and not compared with the planned status.
READER_KEYS = ("progress", "trainer", "goodput")


def build_status_write(seen: Observed, planned: Mapping[str, Any], now: datetime
                  ) -> dict[str, Any] | None:
    """The one status write of this pass: the planned status when it changed, plus pod 0's
    progress and versions when this pass has new ones; None when there is nothing new."""
    status = _changed(seen.status, planned)
    readings: dict[str, Any] = {}
    if seen.progress_report is not None:
        current = seen.status.get("progress") or {}
        new = build_progress_status(seen.progress_report, now)
        if progress_changed(current, new):
            # A merge patch keeps keys it does not name: null out those the new report lacks.
            readings["progress"] = {**{key: None for key in current if key not in new}, **new}
    if seen.trainer_info_read:
        containers = (seen.job.template.get("spec") or {}).get("containers") or [{}]
        readings["trainer"] = build_trainer_status(
            seen.trainer_versions, group_attempt(seen.status), containers[0].get("image"))
    if status is None and not readings:
        return None
    return {**(status or {}), **readings,
            "goodput": _goodput(seen, planned, (readings.get("progress") or {}).get("step"), now)}


def _goodput(seen: Observed, planned: Mapping[str, Any], step: int | None,
             now: datetime) -> dict[str, Any]:
    """status.goodput, moved by this pass (goodput.py); written only with a status write that
    happens anyway, so it costs no request of its own."""
    created = parse_time(seen.body["metadata"].get("creationTimestamp")) or now
    moment = Moment(now, created, seen.status.get("phase"), planned.get("phase"),
                    int(seen.status.get("attempt") or 0), int(planned.get("attempt") or 0), step,
                    seen.progress_time if step is not None else None,
                    seen.previous_step, seen.previous_time)
    return update_goodput(seen.status.get("goodput"), moment)


def _changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any] | None:
    """The status to write, or None when it says nothing new. status.progress and
    status.trainer are not the planner's (only what pod 0 reports writes them), so they are
    neither written nor compared."""
    public = {k: v for k, v in new.items() if k not in READER_KEYS}
    previous = {k: v for k, v in old.items() if k not in READER_KEYS}
    return public if public != previous else None
