"""What of a pod's output reaches the operator: pod 0's supervisor picks the progress out of the
output into the report it pushes (accelerate_trainer.report_push), the operator parses the report
back (accelerate_operator.progress). Both real, no cluster."""

from __future__ import annotations

from typing import Any

from accelerate_operator.progress import parse_report
from accelerate_trainer.report_push import Reports, encode


def pushed(output: str, when: float = 1_767_323_045.0) -> str:
    """The report pod 0's supervisor pushes after `output` (the annotation's value)."""
    reports = Reports()
    reports.feed(1, output.encode(), when)
    return encode(reports.current)


def pushed_progress(output: str) -> dict[str, Any] | None:
    """The progress of `output` as the operator reads it from the pushed report."""
    report = parse_report(pushed(output))
    return None if report is None or report.progress is None else dict(report.progress)
