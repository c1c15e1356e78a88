"""transformers' Kubeflow progress (KEP-2779's `trainerStatus`) read into our progress report:
validation and mapping, pure, for the operator's report endpoint to import (contract.py, "the
report endpoint"). Standard library only, like the contract.

Since transformers 5, `TrainingArguments` adds its `KubeflowCallback` whenever
`KUBEFLOW_TRAINER_SERVER_URL` is set, and rank 0 then POSTs `{"trainerStatus":
{progressPercentage, estimatedRemainingSeconds, metrics: [{name, value}], lastUpdatedTime}}`
there, at most every 5 s, with the bearer token read from the file
`KUBEFLOW_TRAINER_SERVER_TOKEN` names and the CA `KUBEFLOW_TRAINER_SERVER_CA_CERT` names. The
operator points those at its own endpoint on pod 0 (contract.ENV_KUBEFLOW_*).

Bad input is refused (BadReport, an HTTP 400), never shown (the body itself, its size and its
JSON, the endpoint checks first: accelerate_operator.report_checks): percentages outside 0-100,
negative or absurd step counts and ETAs, non-finite metric values, more than MAX_METRICS metrics
or names that are not plain.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_METRICS = 32              # transformers sends about ten
MAX_METRIC_NAME = 64
MAX_STEPS = 10**12            # far past any real run; past it a number is garbage
MAX_ETA_SECONDS = 10 * 365 * 86400
METRIC_NAME = re.compile(r"^[A-Za-z0-9_./-]{1,64}$")
# transformers' names for what our progress line carries as fields of its own.
STEP_METRIC = "current_step"
TOTAL_METRIC = "total_steps"
EPOCH_METRICS = ("current_epoch", "epoch")
SAMPLES_METRICS = ("samples_per_second", "train_samples_per_second")
# Bookkeeping, not metrics: already carried as step/total/epoch.
NOT_METRICS = {STEP_METRIC, TOTAL_METRIC, "current_epoch", "epoch", "total_flos"}


class BadReport(ValueError):
    """A trainerStatus to refuse (400); the message says what is wrong."""


@dataclass(frozen=True)
class TrainerStatus:
    """One validated `trainerStatus` body."""
    progress_percentage: float | None
    eta_seconds: int | None
    metrics: dict[str, float] = field(default_factory=dict)


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool):
        raise BadReport(f"{name} is not a number")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise BadReport(f"{name} is not a number") from None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadReport(f"{name} is not a finite number")
    return float(value)


def trainer_status(status: Mapping[str, Any]) -> TrainerStatus:
    """Validate one trainerStatus object (a POST body's). Raises BadReport naming what is
    wrong."""
    percentage = None
    if status.get("progressPercentage") is not None:
        percentage = _finite(status["progressPercentage"], "progressPercentage")
        if not 0 <= percentage <= 100:
            raise BadReport("progressPercentage outside 0-100")
    eta = None
    if status.get("estimatedRemainingSeconds") is not None:
        eta_value = _finite(status["estimatedRemainingSeconds"], "estimatedRemainingSeconds")
        if not 0 <= eta_value <= MAX_ETA_SECONDS:
            raise BadReport("estimatedRemainingSeconds out of range")
        eta = int(eta_value)
    raw_metrics = status.get("metrics") or []
    if not isinstance(raw_metrics, list) or len(raw_metrics) > MAX_METRICS:
        raise BadReport(f"metrics is not a list of at most {MAX_METRICS} entries")
    metrics: dict[str, float] = {}
    for entry in raw_metrics:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise BadReport("a metric is not {name, value}")
        name = entry["name"]
        if not METRIC_NAME.match(name):
            raise BadReport(f"metric name {name[:MAX_METRIC_NAME]!r} is not a plain name")
        metrics[name] = _finite(entry.get("value"), f"metric {name}")
    for name in (STEP_METRIC, TOTAL_METRIC):
        if name in metrics and not (0 <= metrics[name] <= MAX_STEPS
                                    and metrics[name] == int(metrics[name])):
            raise BadReport(f"metric {name} is not a step count")
    return TrainerStatus(percentage, eta, metrics)


class KubeflowProgress:
    """What one run has reported so far: transformers' last POST (at train end) carries no step
    counts, so the latest ones are remembered to report 100 % as total/total. One per job (or
    per attempt): it holds the run's last step."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.total_steps: int | None = None

    def build_report(self, status: TrainerStatus) -> dict[str, Any] | None:
        """The progress report (what an ACCELERATE_PROGRESS line carries: contract.py) for one
        POST, or None when it says nothing a progress line can carry (no step known yet).
        Raises BadReport when it contradicts itself (a step past the total)."""
        metrics = status.metrics
        total = int(metrics[TOTAL_METRIC]) if TOTAL_METRIC in metrics else self.total_steps
        step = int(metrics[STEP_METRIC]) if STEP_METRIC in metrics else None
        if step is None and status.progress_percentage is not None and total:
            # train begin (0 %) and train end (100 %) come without a step
            if status.progress_percentage == 100:
                step = total
            elif status.progress_percentage == 0 and self.step is None:
                step = 0
            else:
                step = self.step
        if step is None:
            return None
        if total is not None and total > 0 and step > total:
            raise BadReport("current_step is past total_steps")
        self.step, self.total_steps = step, (total or None)
        epoch = next((metrics[name] for name in EPOCH_METRICS if name in metrics), None)
        samples = next((metrics[name] for name in SAMPLES_METRICS if name in metrics), None)
        eta = 0 if total and step >= total else status.eta_seconds
        # six significant digits, as transformers itself logs them: a short line
        extra = {name: float(f"{value:.6g}") for name, value in metrics.items()
                 if name not in NOT_METRICS}
        return {
            "step": step,
            "total_steps": self.total_steps,
            "epoch": round(epoch, 4) if epoch is not None else None,
            "loss": extra.get("loss"),
            "samples_per_second": round(samples, 2) if samples is not None else None,
            "eta_seconds": eta,
            "metrics": extra or None,
        }
