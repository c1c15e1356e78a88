"""`describe`: a job's story as `kubectl describe` tells one: the status block, then its
conditions, the last failure whole (with the pod's last log lines), its pods and its events.
Pure: the job, its pods and events in, text out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from accelerate_operator.progress import format_duration
from rich.table import Table

from .render import cell, printable, render_status, to_text

INDENT = "  "


def _age(timestamp: str | None, now: datetime) -> str:
    if not timestamp:
        return "-"
    when = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return format_duration(int((now - when).total_seconds()))


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    table = Table(box=None, pad_edge=False, padding=(0, 3, 0, 0), header_style="bold")
    for column in columns:
        table.add_column(column, no_wrap=column != "MESSAGE")
    for row in rows:
        table.add_row(*(cell(value) for value in row))
    return "\n".join(INDENT + line for line in to_text(table).splitlines())


def _section(title: str, body: str | None, empty: str = "<none>") -> str:
    return f"{title}:\n" + (body if body else f"{INDENT}{empty}")


def _conditions(job: Mapping[str, Any], now: datetime) -> str | None:
    conditions = (job.get("status") or {}).get("conditions") or []
    rows = [(c.get("type", ""), c.get("status", ""), c.get("reason") or "",
             _age(c.get("lastTransitionTime"), now), c.get("message") or "")
            for c in conditions]
    return _table(("TYPE", "STATUS", "REASON", "AGE", "MESSAGE"), rows) if rows else None


def _pod_row(pod: Mapping[str, Any], now: datetime) -> tuple[str, ...]:
    status = pod.get("status") or {}
    containers = status.get("containerStatuses") or []
    ready = sum(1 for c in containers if c.get("ready"))
    restarts = sum(int(c.get("restartCount") or 0) for c in containers)
    return (pod["metadata"]["name"], status.get("phase") or "Pending",
            f"{ready}/{len(containers) or len((pod.get('spec') or {}).get('containers') or [])}",
            str(restarts), (pod.get("spec") or {}).get("nodeName") or "-",
            _age(pod["metadata"].get("creationTimestamp"), now))


def _pods(pods: Sequence[Mapping[str, Any]], now: datetime) -> str | None:
    rows = [_pod_row(pod, now) for pod in pods]
    return _table(("NAME", "PHASE", "READY", "RESTARTS", "NODE", "AGE"), rows) if rows else None


def _events(events: Sequence[Mapping[str, Any]], now: datetime) -> str | None:
    rows = []
    for event in events:
        count = int(event.get("count") or 1)
        when = event.get("lastTimestamp") or event.get("eventTime")
        age = _age(when, now) + (f" (x{count})" if count > 1 else "")
        source = (event.get("source") or {}).get("component") or \
            event.get("reportingComponent") or "-"
        rows.append((event.get("type") or "", event.get("reason") or "", age, source,
                     (event.get("message") or "").strip()))
    return _table(("TYPE", "REASON", "AGE", "FROM", "MESSAGE"), rows) if rows else None


def _last_failure(job: Mapping[str, Any]) -> str | None:
    text = printable(((job.get("status") or {}).get("lastFailure") or "").strip())
    return "\n".join(INDENT + line for line in text.splitlines()) if text else None


def render_describe(job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]],
                    events: Sequence[Mapping[str, Any]], now: datetime) -> str:
    """The whole story of one job, in sections; a section with nothing says <none>."""
    head = [line for line in render_status(job).splitlines()
            if not line.startswith("Last failure:")]  # shown whole below
    created = job["metadata"].get("creationTimestamp")
    head.insert(1, f"{'Created:':<14}{created or '-'} ({_age(created, now)} ago)")
    return "\n".join([
        "\n".join(head),
        _section("Conditions", _conditions(job, now)),
        _section("Last failure", _last_failure(job)),
        _section("Pods", _pods(pods, now), "<none> (not created yet, or cleaned up)"),
        _section("Events", _events(events, now)),
    ])
