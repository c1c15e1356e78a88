"""A pass's one input, made for a test: the Snapshot of a job body (decide.py decides from it)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from accelerate_operator.api import parse_job
from accelerate_operator.snapshot import Snapshot

NOW = datetime(2026, 1, 1, 12, 0, 0)


def snapshot(body: dict, now: datetime = NOW, **changes: Any) -> Snapshot:
    """The job with no status, pod or child yet, unless `changes` say otherwise."""
    values: dict[str, Any] = {"body": body, "job": parse_job(body), "status": {}, "pods": (),
                              "children": frozenset(), "now": now, "created": now}
    return Snapshot(**{**values, **changes})
