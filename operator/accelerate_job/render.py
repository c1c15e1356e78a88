"""What the CLI prints: job summaries, the status block with its progress bar, the table of
`list`, and objects as YAML or JSON. Pure: jobs in, text out."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, TextIO

import yaml
from accelerate_operator.progress import format_duration

BAR_WIDTH = 30


def summarize(job: Mapping[str, Any]) -> dict[str, Any]:
    """What `status -o json` and `list -o json` print for one job."""
    status = job.get("status") or {}
    return {
        "name": job["metadata"]["name"],
        "namespace": job["metadata"].get("namespace"),
        "phase": status.get("phase") or "Pending",
        "readyNodes": status.get("readyNodes"),
        "restarts": status.get("restarts", 0),
        "attempt": status.get("attempt"),
        "lastFailure": status.get("lastFailure"),
        "progress": status.get("progress"),
        "conditions": status.get("conditions") or [],
    }


def progress_bar(progress: Mapping[str, Any] | None, width: int = BAR_WIDTH) -> str:
    if not progress:
        return "no progress reported yet"
    step, total = progress.get("step", 0), progress.get("totalSteps")
    parts = []
    if total:
        filled = min(width, width * step // total)
        parts.append(f"[{'#' * filled}{'.' * (width - filled)}]")
    parts.append(progress.get("summary") or f"step {step}")
    if progress.get("epoch") is not None:
        parts.append(f"epoch {progress['epoch']:g}")
    if progress.get("loss") is not None:
        parts.append(f"loss {progress['loss']:.4f}")
    if progress.get("samplesPerSecond") is not None:
        parts.append(f"{progress['samplesPerSecond']:.1f} samples/s")
    if progress.get("eta"):
        parts.append(f"ETA {progress['eta']}")
    return "  ".join(parts)


def render_status(job: Mapping[str, Any]) -> str:
    summary = summarize(job)
    spec = job.get("spec") or {}
    lines = [
        f"{'Name:':<14}{summary['name']} (namespace {summary['namespace']})",
        f"{'Phase:':<14}{summary['phase']}",
        f"{'Nodes:':<14}{summary['readyNodes'] or '0/' + str(spec.get('numNodes', 1))} ready",
        f"{'Restarts:':<14}{summary['restarts']}"
        + (f" (attempt {summary['attempt']})" if summary["attempt"] is not None else ""),
        f"{'Progress:':<14}{progress_bar(summary['progress'])}",
    ]
    current = next((c for c in summary["conditions"]
                    if c.get("type") == summary["phase"] and c.get("status") == "True"), None)
    if current and current.get("message"):
        lines.append(f"{'Message:':<14}{current['message']}")
    versions = ((job.get("status") or {}).get("trainer") or {}).get("versions")
    if versions:
        lines.append(f"{'Trainer:':<14}" + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if summary["lastFailure"]:
        # The failure ends with the pod's last log lines: the first line says which pod and how.
        first, *rest = summary["lastFailure"].strip().splitlines() or [""]
        more = f" (+{len(rest)} lines of its log: -o json)" if rest else ""
        lines.append(f"{'Last failure:':<14}{first}{more}")
    return "\n".join(lines)


def _age(timestamp: str | None, now: datetime) -> str:
    if not timestamp:
        return "-"
    created = datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    return format_duration(int((now - created).total_seconds()))


def render_table(jobs: Sequence[Mapping[str, Any]], now: datetime) -> str:
    rows = [("NAME", "PHASE", "READY", "RESTARTS", "PROGRESS", "ETA", "AGE")]
    for job in jobs:
        s = summarize(job)
        progress = s["progress"] or {}
        rows.append((s["name"], s["phase"], s["readyNodes"] or "-", str(s["restarts"]),
                     progress.get("summary") or "-", progress.get("eta") or "-",
                     _age(job["metadata"].get("creationTimestamp"), now)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def dump(objects: Sequence[Mapping[str, Any]], output: str, out: TextIO) -> None:
    if output == "json":
        out.write(json.dumps(objects[0] if len(objects) == 1 else
                             {"apiVersion": "v1", "kind": "List", "items": list(objects)},
                             indent=2) + "\n")
    else:
        out.write(yaml.dump_all(list(objects), Dumper=_BlockDumper, sort_keys=False))


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the accelerate YAML in the ConfigMap) as `|` blocks, readable as
    the file they came from."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _represent_str)
