"""`accelerate-job`: submit, watch and read AccelerateJobs from a terminal.

Also a kubectl plugin: installed as `kubectl-accelerate` (a console script of this package, or a
symlink of that name to `accelerate-job` anywhere on PATH), it runs as `kubectl accelerate ...`.

Built on AccelerateJobClient. Expected errors (a missing job, a failed job, a bad config) print one
line saying what to do and exit 1, never a traceback; usage errors exit 2 (argparse)."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import string
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

import yaml

from .constants import FINISHED_PHASES, SUCCEEDED
from .progress import format_duration
from .submission import build_config_source, build_job, check_accelerate_yaml, files_named_by

PROG = "accelerate-job"
BAR_WIDTH = 30


# ---- argument parsing ------------------------------------------------------------------------


def _procs(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or auto, not {value!r}")
    return number


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value!r}")
    return number


def _env_pair(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {value!r}")
    return key, val


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    connection = argparse.ArgumentParser(add_help=False)
    group = connection.add_argument_group("cluster")
    group.add_argument("--kubeconfig",
                       help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    group.add_argument("--context", help="kubeconfig context (default: the current one)")
    group.add_argument("-n", "--namespace", help="namespace (default: the context's, else default)")

    parser = argparse.ArgumentParser(
        prog=prog, description="Submit, watch and read AccelerateJobs (multi-node `accelerate "
        "launch` on Kubernetes).",
        epilog="Also a kubectl plugin: `kubectl accelerate COMMAND ...` runs this program when "
        "`kubectl-accelerate` is on PATH (installed with this package, or any symlink of that "
        "name to accelerate-job).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    submit = commands.add_parser(
        "submit", parents=[connection], help="run a training script as an AccelerateJob",
        description="Create an AccelerateJob running `accelerate-trainer SCRIPT ARGS...` on NODES "
        "pods, and a ConfigMap with the accelerate YAML. Options go before SCRIPT: everything "
        "after it is passed to the script.",
        usage=f"{prog} submit --config FILE --image IMAGE [options] SCRIPT [ARGS...]")
    submit.add_argument("--config", required=True, metavar="FILE",
                        help="the accelerate YAML (`accelerate config --config_file FILE`)")
    submit.add_argument("--image", required=True, help="the trainer image")
    submit.add_argument("--nodes", type=_positive, default=None,
                        help="pods (machines); default: the YAML's num_machines, else 1")
    submit.add_argument("--procs-per-node", type=_procs, default=None, metavar="N|auto",
                        help="training processes per pod (auto: one per GPU); default: the "
                             "YAML's num_processes / num_machines, else 1")
    submit.add_argument("--gpus", type=_positive, default=None, metavar="N",
                        help="nvidia.com/gpu per pod")
    submit.add_argument("--name", help="the job's name (default: the script's name and a suffix)")
    submit.add_argument("--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                        help="environment of the training processes (repeatable)")
    submit.add_argument("--backoff-limit", type=int, default=None, metavar="N",
                        help="whole-group restarts before the job fails (default: the CRD's, 3)")
    submit.add_argument("--dry-run", action="store_true",
                        help="print the objects instead of creating them (no cluster needed)")
    submit.add_argument("-o", "--output", choices=("yaml", "json"), default=None,
                        help="print the objects (the created ones, or with --dry-run the ones "
                             "that would be)")
    submit.add_argument("script", metavar="SCRIPT",
                        help="the training script, as the image sees it")
    submit.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="the script's arguments")

    status = commands.add_parser("status", parents=[connection],
                                 help="phase, nodes, restarts and progress of a job")
    status.add_argument("name", metavar="NAME")
    status.add_argument("-w", "--watch", action="store_true",
                        help="keep a live progress bar until the job finishes")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    status.add_argument("-o", "--output", choices=("text", "json"), default="text")

    logs = commands.add_parser("logs", parents=[connection],
                               help="a node's log; --attempt N: the log before restart N+1")
    logs.add_argument("name", metavar="NAME")
    which = logs.add_mutually_exclusive_group()
    which.add_argument("--node", type=int, default=0, metavar="N", help="node index; default 0")
    which.add_argument("--all", action="store_true",
                       help="every node, each line prefixed [node N]")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="stream, following the pods through restarts until the job finishes")
    logs.add_argument("--attempt", type=int, default=None, metavar="N",
                      help="the logs archived when attempt N was restarted")
    logs.add_argument("--tail", type=int, default=None, metavar="LINES",
                      help="only the last LINES lines (live logs)")

    wait = commands.add_parser("wait", parents=[connection],
                               help="block until a job reaches a condition (exit 1 if it fails)")
    wait.add_argument("name", metavar="NAME")
    wait.add_argument("--for", dest="condition", default=SUCCEEDED, metavar="CONDITION",
                      help="Created, Running, Restarting, Suspended, Succeeded (default) or Failed")
    wait.add_argument("--timeout", type=float, default=3600, metavar="SECONDS",
                      help="give up after this long (default 3600)")

    delete = commands.add_parser("delete", parents=[connection],
                                 help="delete a job with its pods and ConfigMaps")
    delete.add_argument("name", metavar="NAME")

    listing = commands.add_parser("list", parents=[connection], help="the jobs of a namespace")
    listing.add_argument("-o", "--output", choices=("text", "json"), default="text")
    return parser


# ---- pure helpers (unit tested) --------------------------------------------------------------


def default_job_name(script: str, suffix: str) -> str:
    """`train.py` -> `train-<suffix>`: a DNS-1035 label, as the CRD requires."""
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(script).stem.lower()).strip("-")[:40] or "job"
    if not stem[0].isalpha():
        stem = f"job-{stem}"
    return f"{stem}-{suffix}"


def build_submit_objects(args: argparse.Namespace, config_yaml: str, name: str,
                         namespace: str, files: Mapping[str, str] | None = None,
                         ) -> list[dict[str, Any]]:
    """The ConfigMap and the AccelerateJob that `submit` creates, in creation order."""
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:  # `submit ... SCRIPT -- ARGS`
        script_args = script_args[1:]
    job = build_job(
        name=name, namespace=namespace, image=args.image, script=args.script,
        script_args=script_args,
        num_nodes=args.nodes, nproc_per_node=args.procs_per_node, env=dict(args.env),
        gpus_per_node=args.gpus, backoff_limit=args.backoff_limit,
    )
    check_accelerate_yaml(config_yaml, job["spec"], files)
    return [build_config_source(name, namespace, config_yaml, files=files), job]


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


# ---- commands --------------------------------------------------------------------------------


class CommandError(Exception):
    """An expected failure in the CLI itself (a missing file)."""


def _client(args: argparse.Namespace):
    from .client import AccelerateJobClient

    return AccelerateJobClient(kubeconfig=args.kubeconfig, context=args.context,
                               namespace=args.namespace)


def _dump(objects: Sequence[Mapping[str, Any]], output: str, out: TextIO) -> None:
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


def cmd_submit(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from accelerate_trainer.config import ConfigError

    try:
        config_yaml = Path(args.config).read_text()
    except OSError as error:
        raise CommandError(f"cannot read --config {args.config} ({error.strerror}); write one with "
                           f"`accelerate config --config_file {args.config}`") from None
    files = _read_named_files(args.config, config_yaml)
    name = args.name or default_job_name(
        args.script, "".join(random.choices(string.ascii_lowercase + string.digits, k=5)))
    if args.dry_run:
        namespace = args.namespace or _context_namespace(args)
        try:
            objects = build_submit_objects(args, config_yaml, name, namespace, files)
        except ConfigError as error:
            raise CommandError(f"{args.config}: {error}") from None
        _dump(objects, args.output or "yaml", out)
        return 0
    client = _client(args)
    try:
        configmap, job = build_submit_objects(args, config_yaml, name, client.namespace, files)
    except ConfigError as error:
        raise CommandError(f"{args.config}: {error}") from None
    created = client.submit(job, config_yaml=config_yaml, config_files=files)
    if args.output:
        _dump([created], args.output, out)
    else:
        out.write(f"acceleratejob/{name} submitted in namespace {client.namespace}\n")
        err.write(f"follow it: {args.prog} status {name} -n {client.namespace} --watch\n")
    return 0


def _read_named_files(config: str, config_yaml: str) -> dict[str, str]:
    """The files the YAML names (its DeepSpeed JSON), read beside it, to ship with it."""
    files = {}
    for named in files_named_by(config_yaml):
        path = Path(config).parent / named
        if path.is_file():
            files[path.name] = path.read_text()
    return files


def _context_namespace(args: argparse.Namespace) -> str:
    """The namespace a dry run shows: the kubeconfig context's if one can be read, else default.
    A dry run needs no cluster."""
    from .client import _connect

    try:
        return _connect(args.kubeconfig, args.context)[1]
    except Exception:  # no kubeconfig, or a broken one: still print the objects
        return "default"


def cmd_status(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    client = _client(args)
    job = client.get(args.name)
    if not args.watch:
        out.write((json.dumps(summarize(job), indent=2) if args.output == "json"
                   else render_status(job)) + "\n")
        return 0
    live = out.isatty() and args.output == "text"
    shown, previous_lines = None, 0
    while True:
        text = (json.dumps(summarize(job)) if args.output == "json" else render_status(job))
        if text != shown:
            if live and previous_lines:
                out.write(f"\x1b[{previous_lines}F\x1b[J")  # redraw in place
            elif shown is not None and not live and args.output == "text":
                out.write("\n")
            out.write(text + "\n")
            out.flush()
            shown, previous_lines = text, text.count("\n") + 1
        phase = (job.get("status") or {}).get("phase")
        if phase in FINISHED_PHASES:
            return 0 if phase == SUCCEEDED else 1
        time.sleep(args.interval)
        job = client.get(args.name)


def cmd_logs(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    client = _client(args)
    node = "all" if args.all else args.node
    result = client.logs(args.name, node=node, follow=args.follow, attempt=args.attempt,
                         tail_lines=args.tail)
    if isinstance(result, str):
        out.write(result)
        if args.attempt is None:
            archived = client.archived_attempts(args.name)
            if archived:
                err.write(f"note: the group was restarted; the logs of attempt(s) "
                          f"{', '.join(map(str, archived))}: {args.prog} logs {args.name} "
                          f"--attempt N\n")
        return 0
    for line in result:
        out.write(line + "\n")
        out.flush()
    return 0


def cmd_wait(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    job = _client(args).wait(args.name, condition=args.condition, timeout=args.timeout)
    out.write(f"acceleratejob/{args.name} condition met: {args.condition}"
              f" ({(job.get('status') or {}).get('phase')})\n")
    return 0


def cmd_delete(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    _client(args).delete(args.name)
    out.write(f"acceleratejob/{args.name} deleted\n")
    return 0


def cmd_list(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    client = _client(args)
    jobs = client.list()
    if args.output == "json":
        out.write(json.dumps([summarize(job) for job in jobs], indent=2) + "\n")
    elif not jobs:
        err.write(f"no AccelerateJobs in namespace {client.namespace}\n")
    else:
        out.write(render_table(jobs, datetime.now(timezone.utc)) + "\n")
    return 0


COMMANDS = {"submit": cmd_submit, "status": cmd_status, "logs": cmd_logs, "wait": cmd_wait,
            "delete": cmd_delete, "list": cmd_list}


def program_name(argv0: str) -> str:
    """`kubectl accelerate` when kubectl runs us as its plugin `kubectl-accelerate`."""
    base = os.path.basename(argv0)
    return f"kubectl {base[len('kubectl-'):]}" if base.startswith("kubectl-") else PROG


def main(argv: list[str] | None = None, out: TextIO | None = None,
         err: TextIO | None = None) -> int:
    from .client import AccelerateJobError

    out, err = out or sys.stdout, err or sys.stderr
    prog = program_name(sys.argv[0] if sys.argv else PROG)
    args = build_parser(prog).parse_args(argv)
    args.prog = prog
    try:
        return COMMANDS[args.command](args, out, err)
    except (AccelerateJobError, CommandError) as error:
        message = str(error).replace(f"`{PROG} ", f"`{prog} ")
        err.write(f"error: {message}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `accelerate-job logs x | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
