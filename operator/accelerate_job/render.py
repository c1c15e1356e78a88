"""What the CLI prints: job summaries, the status block with its progress bar, the table of
`get` and `top` (the columns of `kubectl get ajob`, table.py), and objects as YAML or
JSON. Pure: jobs in, text or `rich` renderables out
(rich draws the tables and the live bar, and leaves colours out when the output is no terminal);
nothing here writes to a terminal."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, TextIO

import yaml
from accelerate_operator.progress import format_duration
from rich.console import Console, Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from . import table

BAR_WIDTH = 30
UNBOUNDED = 1_000_000  # wider than any table: what to_text measures its renderable in
# What a terminal would act on rather than show: C0 controls but newline and tab (ESC starts
# the escape sequences that move the cursor, clear the screen or set the window title), DEL, C1
# controls (0x9b is a one-byte CSI), bidirectional overrides.
UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """Job text as the CLI shows it: what pods and users wrote (failure messages, events,
    versions) may hold escape codes; each is written out (`\\x1b`), never sent to the
    terminal. Newlines and tabs stay."""
    return UNPRINTABLE.sub(lambda found: f"\\x{ord(found.group()):02x}"
                           if ord(found.group()) < 0x100 else f"\\u{ord(found.group()):04x}",
                           text)


def cell(value: Any) -> Text:
    """A table cell of job text: printable, and never read as rich markup (a `[/x]` in a
    message would otherwise be a closing tag)."""
    return Text(printable(str(value)))


def node_count(job: Mapping[str, Any]) -> int:
    """How many nodes the job has: the operator's status.topology.numNodes (also when the
    count comes from the accelerate YAML, which submit leaves spec.numNodes out for), else
    spec.numNodes, else 1."""
    topology = (job.get("status") or {}).get("topology") or {}
    return int(topology.get("numNodes") or (job.get("spec") or {}).get("numNodes") or 1)


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
    recovered in 21s)`, or None before the operator wrote any; an elastic job's says how much
    of what it kept ran at a reduced size (`... kept (20m of it reduced); ...`)."""
    if not goodput or goodput.get("percent") is None:
        return None
    lost = sorted(((seconds, cause) for cause, seconds in (goodput.get("lostSeconds") or {})
                   .items() if seconds), reverse=True)
    text = (f"{goodput['percent']:.1f}% of {format_duration(int(goodput.get('wallSeconds', 0)))}"
            " kept")
    if goodput.get("reducedSeconds"):  # an elastic job's training on fewer nodes
        text += f" ({format_duration(int(goodput['reducedSeconds']))} of it reduced)"
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
    rows = [
        ("Name:", f"{summary['name']} (namespace {summary['namespace']})"),
        ("Phase:", summary["phase"]),
        ("Nodes:", f"{summary['readyNodes'] or f'0/{node_count(job)}'} ready"),
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
    return "\n".join(f"{label:<14}{printable(value)}" for label, value in status_rows(job))


PHASE_STYLES = {"Pending": "dim", "Queued": "cyan", "Running": "green", "Restarting": "yellow",
                "Suspended": "magenta", "Succeeded": "bold green", "Failed": "bold red"}


def _bar(progress: Mapping[str, Any], width: int) -> RenderableType:
    total = progress.get("totalSteps")
    if not total:
        return Text("")
    return ProgressBar(total=float(total), completed=float(min(progress.get("step", 0), total)),
                       width=width)


def render_wide_status(job: Mapping[str, Any], now: datetime | None = None) -> str:
    """`status -o wide`: the status block, then the table's columns it does not show, one a
    line (the CRD's printer columns, those of `-o wide` included)."""
    shown = {"PHASE", "READY", "RESTARTS", "GOODPUT", "PROGRESS", "ETA", "AGE"}
    now = now or datetime.now(timezone.utc)
    cells = zip(table.header(wide=True)[1:], table.row(job, now, wide=True)[1:], strict=True)
    wide = [f"{(name.title() + ':'):<14}{printable(value or '-')}" for name, value in cells
            if name not in shown]
    return "\n".join([render_status(job), *wide])


def _row(job: Mapping[str, Any], now: datetime, bars: bool, namespaces: bool,
         wide: bool) -> list[RenderableType]:
    cells: list[RenderableType] = [cell(value) for value in table.row(job, now, wide,
                                                                      namespaces)]
    names = table.header(wide, namespaces)
    phase = names.index("PHASE")
    cells[phase] = Text(str(cells[phase]), style=PHASE_STYLES.get(str(cells[phase]), ""))
    if bars:
        cells.insert(names.index("PROGRESS") + 1,
                     _bar((job.get("status") or {}).get("progress") or {}, 20))
    return cells


def jobs_table(jobs: Sequence[Mapping[str, Any]], now: datetime, *, bars: bool = False,
               namespaces: bool = False, wide: bool = False) -> Table:
    """The jobs as `kubectl get ajob` shows them (table.py); with `bars`, a progress bar beside
    PROGRESS (`top`); with `namespaces`, a NAMESPACE column first (`-A`); with `wide`, the
    columns of `-o wide`."""
    grid = Table(box=None, pad_edge=False, padding=(0, 3, 0, 0), header_style="bold")
    for column in table.header(wide, namespaces):
        grid.add_column(column, no_wrap=True)
        if bars and column == "PROGRESS":
            grid.add_column("", no_wrap=True)
    for job in jobs:
        grid.add_row(*_row(job, now, bars, namespaces, wide))
    return grid


def status_view(job: Mapping[str, Any]) -> RenderableType:
    """The status block of `status --watch` on a terminal: the lines of render_status, with a
    drawn progress bar and the phase in colour."""
    progress = summarize(job)["progress"] or {}
    out: list[RenderableType] = []
    for label, value in status_rows(job):
        if label == "Progress:" and progress.get("totalSteps"):
            row = Table.grid(padding=(0, 2))
            row.add_row(Text(f"{label:<14}"), _bar(progress, BAR_WIDTH),
                        cell(progress_text(progress)))
            out.append(row)
        elif label == "Phase:":
            out.append(Text.assemble(f"{label:<14}", (printable(value),
                                                      PHASE_STYLES.get(value, ""))))
        else:
            out.append(Text(f"{label:<14}{printable(value)}"))
    return Group(*out)


def to_text(renderable: RenderableType, width: int | None = None) -> str:
    """What rich draws, as plain text without colours (for pipes, files and tests). At the
    renderable's own width unless `width` is given: as kubectl, no cell is ever cut short to
    fit a width."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=width or UNBOUNDED, color_system=None,
                      force_terminal=False, legacy_windows=False)
    if width is None:
        console.width = max(1, console.measure(renderable).maximum)
    console.print(renderable)
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

