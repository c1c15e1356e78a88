"""Turn pod 0's report to the operator's endpoint (report_server.py: the object
accelerate_trainer.report_push sends from rank 0's `ACCELERATE_PROGRESS {json}` lines, or a
KEP-2779 trainerStatus made into one) into the job's status.progress, and the library versions
the report carries (the trainer read them at its start) into status.trainer. No pod log is read
while a job runs: the report is the one channel from the trainer.

Pure: text and a clock in, dicts out. Everything here comes from the user's program, through a
pod: a report that is malformed or too big is ignored (the status stays as it was), never an
error, and every value is checked again before it reaches the status."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from accelerate_trainer.contract import MAX_BODY_BYTES

from .timefmt import format_time, parse_time


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _count(value: Any) -> int | None:
    number = _finite(value)
    return int(number) if number is not None and number >= 0 and number == int(number) else None


# The operator's own key in a report it keeps (report_store.py): when it took the report.
# report_checks.keep_report drops any field of that name a pod sends.
RECEIVED_KEY = "receivedTime"


@dataclass(frozen=True)
class PushedReport:
    """Pod 0's report: its newest progress object (None before the first), and when rank 0's
    container last wrote anything (naive UTC; for stall detection)."""

    progress: Mapping[str, Any] | None
    last_output: datetime | None
    # When pod 0 saw the progress line (naive UTC): the step's time, for goodput.
    progress_time: datetime | None = None
    # The attempt whose launch printed it (None: a report that does not say).
    attempt: int | None = None
    # Restarted in place: the last step of the attempt before, and when pod 0 saw it.
    previous_step: int | None = None
    previous_time: datetime | None = None
    # The library versions the trainer runs with (read_versions), None when the report has none.
    versions: Mapping[str, str] | None = None
    # When the operator took the report (naive UTC, its own clock: RECEIVED_KEY).
    received: datetime | None = None

    @property
    def step(self) -> int | None:
        return _count((self.progress or {}).get("step"))

    @property
    def last_step_done(self) -> bool:
        """Whether the script said its last step is done (step >= total_steps)."""
        total = _count((self.progress or {}).get("total_steps"))
        return bool(total) and (self.step or 0) >= total


def parse_report(text: str | None) -> PushedReport | None:
    """The report a pod sent (JSON text), or None when it holds none that is valid."""
    if not text or len(text.encode()) > MAX_BODY_BYTES:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    progress = value.get("progress")
    if not isinstance(progress, dict) or _count(progress.get("step")) is None:
        progress = None
    last_output = parse_time(value.get("lastOutputTime"))
    versions = read_versions(value.get("versions"))
    if progress is None and last_output is None and versions is None:
        return None
    stamp = value.get("progressTime") if progress is not None else None
    previous = value.get("previous") if isinstance(value.get("previous"), dict) else {}
    return PushedReport(progress, last_output, parse_time(stamp), _count(value.get("attempt")),
                        _count(previous.get("step")), parse_time(previous.get("progressTime")),
                        versions, parse_time(value.get(RECEIVED_KEY)))


# status.progress.metrics: the latest numbers the script logged (learning_rate, grad_norm...),
# from transformers (KEP-2779 trainerStatus). The log is the user's output: keep a few short ones.
MAX_METRICS = 16
MAX_METRIC_NAME = 64


def build_metrics(value: Any) -> dict[str, float] | None:
    """The finite numbers of a report's `metrics` object, at most MAX_METRICS with short names,
    or None when there are none."""
    if not isinstance(value, dict):
        return None
    metrics = {}
    for name, number in value.items():
        finite = _finite(number)
        if finite is not None and isinstance(name, str) and 0 < len(name) <= MAX_METRIC_NAME:
            metrics[name] = finite
        if len(metrics) == MAX_METRICS:
            break
    return metrics or None


def format_duration(seconds: int) -> str:
    """`45s`, `1m20s`, `2h05m`, `3d4h`: as short as kubectl's AGE column."""
    seconds = max(int(seconds), 0)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s" if seconds else f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m" if minutes else f"{hours}h"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours}h" if hours else f"{days}d"


def format_summary(step: int, total_steps: int | None) -> str:
    if not total_steps:
        return f"step {step}"
    percent = min(100, step * 100 // total_steps)
    return f"{step}/{total_steps} ({percent}%)"


def build_progress_status(report: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """status.progress as the CRD documents it, from one parsed report; fields the report lacks
    (or holds as nonsense) are left out. `updateTime` is `now`: when the operator took the
    report (RECEIVED_KEY), so its age is how far the status is behind pod 0."""
    step = _count(report.get("step")) or 0
    total = _count(report.get("total_steps")) or None
    eta_seconds = _count(report.get("eta_seconds"))
    if total is not None and step >= total:
        eta_seconds = 0
    progress: dict[str, Any] = {"step": step}
    if total is not None:
        progress["totalSteps"] = total
    for key, name in (("epoch", "epoch"), ("loss", "loss"),
                      ("samples_per_second", "samplesPerSecond")):
        value = _finite(report.get(key))
        if value is not None:
            progress[name] = value
    if eta_seconds is not None:
        progress["etaSeconds"] = eta_seconds
        progress["eta"] = format_duration(eta_seconds)
    metrics = build_metrics(report.get("metrics"))
    if metrics:
        progress["metrics"] = metrics
    progress["summary"] = format_summary(step, total)
    progress["updateTime"] = format_time(now)
    return progress


def progress_changed(current: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether writing `new` over `current` tells the user anything (updateTime aside)."""
    def strip(progress: Mapping[str, Any] | None) -> dict[str, Any]:
        return {k: v for k, v in (progress or {}).items() if k != "updateTime"}
    return strip(current) != strip(new)


# A version string is short; anything longer is not one (the report is the pod's own writing).
MAX_VERSION_LENGTH = 64
MAX_VERSIONS = 16


def read_versions(value: Any) -> dict[str, str] | None:
    """A report's `versions` ({"accelerate": "1.15.0", ...}), at most MAX_VERSIONS short ones;
    None when it has none."""
    if not isinstance(value, dict):
        return None
    versions = {str(name)[:MAX_VERSION_LENGTH]: version
                for name, version in list(value.items())[:MAX_VERSIONS]
                if isinstance(version, str) and 0 < len(version) <= MAX_VERSION_LENGTH}
    return versions or None


def build_trainer_status(versions: Mapping[str, str], attempt: int, image: str | None,
                         current: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """status.trainer for the group of `attempt`: the trainer image and the versions its pod 0
    reported, as a merge patch over `current` (an earlier group's versions it lacks go)."""
    before = (current or {}).get("versions") or {}
    return {"attempt": attempt, "image": image,
            "versions": {**{name: None for name in before if name not in versions},
                         **versions}}
