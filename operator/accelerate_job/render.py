"""What the CLI prints: job summaries, the status block with its progress bar, the tables of
`get` and `top`, and objects as YAML or JSON. Pure: jobs in, text or `rich` renderables out
(rich draws the tables and the live bar, and leaves colours out when the output is no terminal);
nothing here writes to a terminal."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, TextIO

import yaml
from accelerate_operator.progress import format_duration
from accelerate_operator.timefmt import naive_utc, parse_time
from rich.console import Console, Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

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
        "goodput": {k: v for k, v in (status.get("goodput") or {}).items() if k != "ledger"}
        or None,
        "conditions": status.get("conditions") or [],
    }


def goodput_line(goodput: Mapping[str, Any] | None) -> str | None:
    """`87.5% of 1h20m kept; lost: recovery 40s, startup 15s (2 interruptions, the last
    recovered in 21s)`, or None before the operator wrote any."""
    if not goodput or goodput.get("percent") is None:
        return None
    lost = sorted(((seconds, cause) for cause, seconds in (goodput.get("lostSeconds") or {})
                   .items() if seconds), reverse=True)
    text = (f"{goodput['percent']:.1f}% of {format_duration(int(goodput.get('wallSeconds', 0)))}"
            " kept")
    if lost:
        text += "; lost: " + ", ".join(f"{cause} {format_duration(int(seconds))}"
                                       for seconds, cause in lost)
    count = int(goodput.get("interruptions") or 0)
    if count:
        text += f" ({count} interruption{'s' if count > 1 else ''}"
        last = goodput.get("lastRecoverySeconds")
        if last is not None:
            text += f", the last recovered in {format_duration(int(last))}"
        text += ")"
    return text


def progress_bar(progress: Mapping[str, Any] | None, width: int = BAR_WIDTH) -> str:
    if not progress:
        return "no progress reported yet"
    step, total = progress.get("step", 0), progress.get("totalSteps")
    if not total:
        return progress_text(progress)
    filled = min(width, width * step // total)
    return f"[{'#' * filled}{'.' * (width - filled)}]  {progress_text(progress)}"


def progress_text(progress: Mapping[str, Any]) -> str:
    """What the bar's line says beside the bar: the step, epoch, loss, rate, ETA."""
    parts = [progress.get("summary") or f"step {progress.get('step', 0)}"]
    if progress.get("epoch") is not None:
        parts.append(f"epoch {progress['epoch']:g}")
    if progress.get("loss") is not None:
        parts.append(f"loss {progress['loss']:.4f}")
    if progress.get("samplesPerSecond") is not None:
        parts.append(f"{progress['samplesPerSecond']:.1f} samples/s")
    if progress.get("eta"):
        parts.append(f"ETA {progress['eta']}")
    return "  ".join(parts)


def status_rows(job: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The (label, value) rows of `status`, which render_status and status_view lay out."""
    summary = summarize(job)
    spec = job.get("spec") or {}
    rows = [
        ("Name:", f"{summary['name']} (namespace {summary['namespace']})"),
        ("Phase:", summary["phase"]),
        ("Nodes:", f"{summary['readyNodes'] or '0/' + str(spec.get('numNodes', 1))} ready"),
        ("Restarts:", f"{summary['restarts']}"
         + (f" (attempt {summary['attempt']})" if summary["attempt"] is not None else "")),
        ("Progress:", progress_bar(summary["progress"])),
    ]
    goodput = goodput_line(summary["goodput"])
    if goodput:
        rows.append(("Goodput:", goodput))
    current = next((c for c in summary["conditions"]
                    if c.get("type") == summary["phase"] and c.get("status") == "True"), None)
    if current and current.get("message"):
        rows.append(("Message:", current["message"]))
    versions = ((job.get("status") or {}).get("trainer") or {}).get("versions")
    if versions:
        rows.append(("Trainer:", ", ".join(f"{k} {v}" for k, v in versions.items())))
    if summary["lastFailure"]:
        # The failure ends with the pod's last log lines: the first line says which pod and how.
        first, *rest = summary["lastFailure"].strip().splitlines() or [""]
        more = f" (+{len(rest)} lines of its log: -o json)" if rest else ""
        rows.append(("Last failure:", f"{first}{more}"))
    return rows


def render_status(job: Mapping[str, Any]) -> str:
    return "\n".join(f"{label:<14}{value}" for label, value in status_rows(job))


def _age(timestamp: str | None, now: datetime) -> str:
    if not timestamp:
        return "-"
    created = parse_time(timestamp)
    if created is None:
        return "-"
    return format_duration(int((naive_utc(now) - created).total_seconds()))


PHASE_STYLES = {"Pending": "dim", "Queued": "cyan", "Running": "green", "Restarting": "yellow",
                "Suspended": "magenta", "Succeeded": "bold green", "Failed": "bold red"}
COLUMNS = ("NAME", "PHASE", "READY", "RESTARTS", "PROGRESS", "ETA", "AGE")
# `-o wide` adds what `kubectl get ajob -o wide` adds, and the attempt.
WIDE_COLUMNS = ("TOPOLOGY", "PORT", "COUNTED", "ATTEMPT", "QUEUE", "ACCELERATE")


def _bar(progress: Mapping[str, Any], width: int) -> RenderableType:
    total = progress.get("totalSteps")
    if not total:
        return Text("")
    return ProgressBar(total=float(total), completed=float(min(progress.get("step", 0), total)),
                       width=width)


def render_wide_status(job: Mapping[str, Any]) -> str:
    """`status -o wide`: the status block, then what `-o wide` adds to the table, one a line."""
    wide = [f"{(column.title() + ':'):<14}{value}"
            for column, value in zip(WIDE_COLUMNS, _wide_cells(job), strict=True)]
    return "\n".join([render_status(job), *wide])


def _wide_cells(job: Mapping[str, Any]) -> list[str]:
    status = job.get("status") or {}
    topology = status.get("topology") or {}
    versions = (status.get("trainer") or {}).get("versions") or {}
    values = (topology.get("summary"), topology.get("masterPort"), status.get("restartsCounted"),
              status.get("attempt"), (status.get("queue") or {}).get("name"),
              versions.get("accelerate"))
    return ["-" if value is None else str(value) for value in values]


def _row(job: Mapping[str, Any], now: datetime, bars: bool, namespaces: bool,
         wide: bool) -> list[RenderableType]:
    s = summarize(job)
    progress = s["progress"] or {}
    cells: list[RenderableType] = [s["namespace"] or "-"] if namespaces else []
    cells += [s["name"], Text(s["phase"], style=PHASE_STYLES.get(s["phase"], "")),
              s["readyNodes"] or "-", str(s["restarts"])]
    if bars:
        cells.append(_bar(progress, 20))
    cells += [progress.get("summary") or "-", progress.get("eta") or "-",
              _age(job["metadata"].get("creationTimestamp"), now)]
    return cells + (_wide_cells(job) if wide else [])


def jobs_table(jobs: Sequence[Mapping[str, Any]], now: datetime, *, bars: bool = False,
               namespaces: bool = False, wide: bool = False) -> Table:
    """The jobs as `kubectl get ajob` shows them; with `bars`, a progress bar beside PROGRESS
    (`top`); with `namespaces`, a NAMESPACE column first (`-A`); with `wide`, WIDE_COLUMNS."""
    table = Table(box=None, pad_edge=False, padding=(0, 3, 0, 0), header_style="bold")
    columns = (("NAMESPACE",) if namespaces else ()) + COLUMNS + (WIDE_COLUMNS if wide else ())
    for column in columns:
        table.add_column(column, no_wrap=True)
        if bars and column == "PROGRESS":
            table.add_column("", no_wrap=True)
    for job in jobs:
        table.add_row(*_row(job, now, bars, namespaces, wide))
    return table


def status_view(job: Mapping[str, Any]) -> RenderableType:
    """The status block of `status --watch` on a terminal: the lines of render_status, with a
    drawn progress bar and the phase in colour."""
    progress = summarize(job)["progress"] or {}
    out: list[RenderableType] = []
    for label, value in status_rows(job):
        if label == "Progress:" and progress.get("totalSteps"):
            row = Table.grid(padding=(0, 2))
            row.add_row(Text(f"{label:<14}"), _bar(progress, BAR_WIDTH),
                        Text(progress_text(progress)))
            out.append(row)
        elif label == "Phase:":
            out.append(Text.assemble(f"{label:<14}", (value, PHASE_STYLES.get(value, ""))))
        else:
            out.append(Text(f"{label:<14}{value}"))
    return Group(*out)


def to_text(renderable: RenderableType, width: int = 200) -> str:
    """What rich draws, as plain text without colours (for pipes, files and tests)."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False,
            legacy_windows=False).print(renderable)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def render_table(jobs: Sequence[Mapping[str, Any]], now: datetime, *, bars: bool = False,
                 namespaces: bool = False, wide: bool = False) -> str:
    return to_text(jobs_table(jobs, now, bars=bars, namespaces=namespaces, wide=wide))


def dump(objects: Sequence[Mapping[str, Any]], output: str, out: TextIO) -> None:
    """Kubernetes objects as kubectl prints them: YAML documents, or JSON (a List of several)."""
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

