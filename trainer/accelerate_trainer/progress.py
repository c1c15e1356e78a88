"""Report training progress to the operator through rank 0's stdout: no API access, no files.

Global rank 0 prints one line `ACCELERATE_PROGRESS {json}` with step, total_steps, epoch, loss,
samples_per_second and eta_seconds; pod 0's supervisor (supervise.py, report_push.py) picks the
newest out of the output and pushes it onto the pod, and the operator writes it into the job's
status.progress (`kubectl get ajob` shows PROGRESS and ETA). The script itself never talks to the
API server.

Two ways to report, both no-ops on every rank but global rank 0 (env RANK, set by the launcher):

    from accelerate_trainer import progress
    progress.report(step=s, total_steps=n, epoch=e, loss=l, samples_per_second=r)

or, as an accelerate tracker:

    accelerator = Accelerator(log_with=[progress.ProgressTracker(total_steps=n)])
    accelerator.init_trackers("my-run")
    accelerator.log({"loss": l, "epoch": e}, step=s)

Lines are throttled to one every MIN_INTERVAL seconds (the first and the last step always print);
the ETA comes from the step rate over the last RATE_WINDOW seconds. This module must never raise
into the training loop over a bad value, and never writes anywhere but stdout.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from accelerate.tracking import GeneralTracker

from .contract import format_progress_line

MIN_INTERVAL = 2.0
RATE_WINDOW = 60.0


def _number(value: Any, digits: int) -> float | None:
    """A finite float rounded for a short line, or None (JSON has no NaN; tensors have .item())."""
    if value is None:
        return None
    try:
        number = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        return None
    return round(number, digits) if math.isfinite(number) else None


def is_reporting_rank(env: Mapping[str, str] = os.environ) -> bool:
    """Global rank 0 only: every other rank would repeat the same numbers into its own log."""
    return env.get("RANK", "0").strip() in ("", "0")


class ProgressReporter:
    """Throttles the lines and keeps the recent (time, step) samples the ETA is computed from."""

    def __init__(self, *, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic,
                 min_interval: float = MIN_INTERVAL, enabled: bool | None = None):
        self._stream = stream
        self._clock = clock
        self._min_interval = min_interval
        self._enabled = is_reporting_rank() if enabled is None else enabled
        self._samples: deque[tuple[float, int]] = deque()
        self._last_emit: float | None = None

    def _eta(self, now: float, step: int, total_steps: int | None) -> int | None:
        if total_steps is None:
            return None
        if step >= total_steps:
            return 0
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW:
            self._samples.popleft()
        first_time, first_step = self._samples[0]
        if now <= first_time or step <= first_step:
            return None
        rate = (step - first_step) / (now - first_time)
        return int(round((total_steps - step) / rate))

    def report(self, *, step: int, total_steps: int | None = None, epoch: float | None = None,
               loss: float | None = None, samples_per_second: float | None = None) -> bool:
        """Record a step; print a line unless one was printed less than min_interval ago.
        Returns whether a line was printed."""
        if not self._enabled:
            return False
        try:
            step = int(step)
            total_steps = int(total_steps) if total_steps is not None else None
        except (TypeError, ValueError):
            return False
        now = self._clock()
        if self._samples and step < self._samples[-1][1]:
            self._samples.clear()  # a resumed or restarted run: the old rate means nothing
        self._samples.append((now, step))
        last = total_steps is not None and step >= total_steps
        if not last and self._last_emit is not None and now - self._last_emit < self._min_interval:
            return False
        self._last_emit = now
        payload = {
            "step": step,
            "total_steps": total_steps,
            "epoch": _number(epoch, 4),
            "loss": _number(loss, 6),
            "samples_per_second": _number(samples_per_second, 2),
            "eta_seconds": self._eta(now, step, total_steps),
        }
        line = format_progress_line(payload)
        stream = self._stream or sys.stdout
        # One write: the processes of a machine share stdout, and a split line would not parse.
        stream.write(line)
        stream.flush()
        return True


_default: ProgressReporter | None = None


def report(*, step: int, total_steps: int | None = None, epoch: float | None = None,
           loss: float | None = None, samples_per_second: float | None = None) -> bool:
    """Report progress from the training loop; a no-op on every rank but global rank 0."""
    global _default
    if _default is None:
        _default = ProgressReporter()
    return _default.report(step=step, total_steps=total_steps, epoch=epoch, loss=loss,
                           samples_per_second=samples_per_second)


class ProgressTracker(GeneralTracker):
    """An accelerate tracker: `accelerator.log({"loss": l, "epoch": e}, step=s)` reports progress.

    Reads `loss`, `epoch` and `samples_per_second` from the logged values (others are ignored);
    a call without `step` reports nothing."""

    name = "accelerate-operator"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, total_steps: int | None = None, *, reporter: ProgressReporter | None = None):
        super().__init__()
        self.total_steps = total_steps
        self._reporter = reporter or ProgressReporter()

    @property
    def tracker(self) -> ProgressReporter:
        return self._reporter

    def store_init_configuration(self, values: dict) -> None:
        """Hyperparameters are not progress: nothing to report."""

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if step is None:
            return
        self._reporter.report(
            step=step,
            total_steps=self.total_steps,
            epoch=values.get("epoch"),
            loss=values.get("loss"),
            samples_per_second=values.get("samples_per_second"),
        )
