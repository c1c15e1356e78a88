"""The table `kubectl get ajob` prints, for `get`, `top` and `get -w`: its columns are the CRD's
printer columns (printer_columns.py, generated from crds/ at build time: the one source), each
cell read from the job by the column's JSON path and printed as kubectl prints that column's
type. `-o wide` adds the columns of priority above 0, as kubectl's wide does; `-A` a NAMESPACE
column first. Pure: jobs and the clock in, strings out."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from accelerate_operator.timefmt import naive_utc, parse_time

from .jsonpath import compile_template
from .printer_columns import COLUMNS


def columns(wide: bool) -> list[tuple[str, str, str, int]]:
    return [column for column in COLUMNS if wide or column[3] == 0]


def header(wide: bool = False, namespaces: bool = False) -> list[str]:
    """The column names, upper-cased as kubectl prints them, after NAME (and NAMESPACE)."""
    first = ["NAMESPACE", "NAME"] if namespaces else ["NAME"]
    return first + [name.upper() for name, *_ in columns(wide)]


def row(job: Mapping[str, Any], now: datetime, wide: bool = False,
        namespaces: bool = False) -> list[str]:
    metadata = job.get("metadata") or {}
    first = [metadata.get("namespace") or "", metadata.get("name") or ""]
    return first[0 if namespaces else 1:] + [
        cell(job, type_, path, now) for _, type_, path, _ in columns(wide)]


def cell(job: Mapping[str, Any], type_: str, path: str, now: datetime) -> str:
    """One column of one job; "" where the path finds nothing (kubectl's empty cell)."""
    found = compile_template("{" + path + "}").values(job)
    if not found or found[0] is None:
        return ""
    value = found[0]
    if type_ == "date":
        moment = parse_time(value)
        if moment is None:
            return "<invalid>"
        return human_duration((naive_utc(now) - moment).total_seconds())
    if isinstance(value, bool):
        return str(value).lower()
    if type_ == "integer" and isinstance(value, (int, float)):
        return str(int(value))
    return str(value)


def human_duration(seconds: float) -> str:
    """kubectl's AGE (k8s.io/apimachinery duration.HumanDuration): seconds up to 2 minutes,
    then minutes (with seconds under 10 minutes), hours (with minutes under 8 hours), days
    (with hours under 8 days), years (with days under 8 years)."""
    total = int(seconds)
    if total < -1:
        return "<invalid>"
    if total < 120:
        return f"{max(total, 0)}s"
    minutes, hours, days = total // 60, total // 3600, total // 86400
    if minutes < 10:
        return _two(minutes, "m", total % 60, "s")
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return _two(hours, "h", minutes % 60, "m")
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return _two(days, "d", hours % 24, "h")
    if hours < 24 * 365 * 2:
        return f"{days}d"
    if hours < 24 * 365 * 8:
        return _two(days // 365, "y", days % 365, "d")
    return f"{days // 365}y"


def _two(big: int, unit: str, small: int, small_unit: str) -> str:
    return f"{big}{unit}{small}{small_unit}" if small else f"{big}{unit}"
