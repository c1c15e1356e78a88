"""`accelerate-job`: submit, watch and read AccelerateJobs from a terminal.

Also a kubectl plugin: installed as `kubectl-accelerate` (a console script of this package, or a
symlink of that name to `accelerate-job` anywhere on PATH), it runs as `kubectl accelerate ...`.

Built on AccelerateJobClient. Expected errors (a missing job, a failed job, a bad config) print one
line saying what to do and exit 1, never a traceback; usage errors exit 2 (argparse). The parsed
arguments stay at the command boundary: what submit builds comes from a typed SubmitOptions."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import string
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

import yaml
from accelerate_operator.constants import CONDITION_TYPES, FINISHED_PHASES, SUCCEEDED
from accelerate_trainer.config import ConfigError
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from .code import CodeArchive, pack_code
from .errors import AccelerateJobError, InvalidConfig
from .render import (
    dump,
    dump_data,
    jobs_table,
    render_status,
    render_table,
    status_view,
    summarize,
)
from .request import context_namespace
from .submission import build_job, build_submission, files_named_by

PROG = "accelerate-job"


# ---- argument parsing ------------------------------------------------------------------------


def _procs(value: str) -> int | str:
    return value if value == "auto" else _positive(value, "a positive integer or auto")


def _positive(value: str, what: str = "a positive integer") -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be {what}, not {value!r}")
    return number


def _env_pair(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {value!r}")
    return key, val


def _connection_options() -> argparse.ArgumentParser:
    connection = argparse.ArgumentParser(add_help=False)
    group = connection.add_argument_group("cluster")
    group.add_argument("--kubeconfig",
                       help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    group.add_argument("--context", help="kubeconfig context (default: the current one)")
    group.add_argument("-n", "--namespace", help="namespace (default: the context's, else default)")
    return connection


def _add_submit(commands: Any, connection: argparse.ArgumentParser, prog: str) -> None:
    submit = commands.add_parser(
        "submit", parents=[connection], help="run a training script as an AccelerateJob",
        description="Create an AccelerateJob running `accelerate-trainer SCRIPT ARGS...` on NODES "
        "pods, a ConfigMap with the accelerate YAML, and one with your code: SCRIPT (a file on "
        "this machine), or with --workdir the folder it is in, packed and unpacked into the "
        "pods' /workspace before `accelerate launch`. With --in-image, SCRIPT is a path inside "
        "the image and nothing is packed. Options go before SCRIPT: everything after it is "
        "passed to the script.",
        usage=f"{prog} submit --config FILE --image IMAGE [options] [--workdir DIR] "
              "[--requirements FILE] SCRIPT [ARGS...]\n"
              f"       {prog} submit --config FILE --image IMAGE [options] --in-image PATH "
              "[ARGS...]")
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
    _add_submit_code(submit)
    submit.add_argument("script", metavar="SCRIPT",
                        help="the training script on this machine (with --in-image: in the "
                             "image)")
    submit.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="the script's arguments")


def _add_submit_code(submit: argparse.ArgumentParser) -> None:
    code = submit.add_argument_group("code")
    code.add_argument("--workdir", metavar="DIR",
                      help="ship this folder (at most about 1 MiB compressed; .gitignore and "
                           ".accelerateignore in it exclude files) and run SCRIPT, which lies "
                           "in it, from there")
    code.add_argument("--requirements", metavar="FILE",
                      help="a pip requirements file installed in every pod before launch")
    code.add_argument("--in-image", action="store_true",
                      help="SCRIPT is a path inside the image (--in-image /opt/.../train.py): "
                           "ship nothing of it")


def _add_status_and_logs(commands: Any, connection: argparse.ArgumentParser) -> None:
    status = commands.add_parser("status", parents=[connection],
                                 help="phase, nodes, restarts and progress of a job")
    status.add_argument("name", metavar="NAME")
    status.add_argument("-w", "--watch", action="store_true",
                        help="keep a live progress bar until the job finishes (a watch on the "
                             "job: it changes as the status does)")
    status.add_argument("-o", "--output", choices=("text", "json", "yaml"), default="text",
                        help="text (default), or the summary as json or yaml, for scripts "
                             "(with -w: one JSON line per change; yaml: one document each)")

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


def _add_wait_delete_list(commands: Any, connection: argparse.ArgumentParser) -> None:
    wait = commands.add_parser("wait", parents=[connection],
                               help="block until a job reaches a condition (exit 1 if it fails)")
    wait.add_argument("name", metavar="NAME")
    wait.add_argument("--for", dest="condition", default=SUCCEEDED, metavar="CONDITION",
                      help=f"{', '.join(CONDITION_TYPES[:-2])}, Succeeded (default) or Failed")
    wait.add_argument("--timeout", type=float, default=3600, metavar="SECONDS",
                      help="give up after this long (default 3600)")

    delete = commands.add_parser("delete", parents=[connection],
                                 help="delete a job with its pods and ConfigMaps")
    delete.add_argument("name", metavar="NAME")

    listing = commands.add_parser("list", parents=[connection, _listing_options()],
                                  help="the jobs of a namespace (-A: of every namespace)")
    listing.add_argument("-o", "--output", choices=("text", "wide", "json", "yaml"),
                         default="text",
                         help="text (default); wide adds TOPOLOGY, PORT, COUNTED, ATTEMPT, "
                              "QUEUE and ACCELERATE; json or yaml print the jobs' summaries")
    listing.add_argument("-w", "--watch", action="store_true",
                         help="keep the table live, as `top` does")

    top = commands.add_parser(
        "top", parents=[connection, _listing_options()],
        help="every job's phase, progress and ETA, live (Ctrl-C to stop)",
        description="Like `kubectl get ajob -w`, but one table kept up to date in place, with "
        "progress bars: a watch on the namespace's jobs redraws it as their status changes. "
        "Without a terminal, the table is printed again after each change.")
    top.add_argument("-o", "--output", choices=("text", "wide"), default="text",
                     help="wide adds the columns `list -o wide` adds")


def _listing_options() -> argparse.ArgumentParser:
    listing = argparse.ArgumentParser(add_help=False)
    listing.add_argument("-A", "--all-namespaces", action="store_true",
                         help="the jobs of every namespace, with a NAMESPACE column (needs "
                              "cluster-wide list and watch on acceleratejobs)")
    return listing


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Submit, watch and read AccelerateJobs (multi-node `accelerate "
        "launch` on Kubernetes).",
        epilog="Also a kubectl plugin: `kubectl accelerate COMMAND ...` runs this program when "
        "`kubectl-accelerate` is on PATH (installed with this package, or any symlink of that "
        "name to accelerate-job).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    connection = _connection_options()
    _add_submit(commands, connection, prog)
    _add_status_and_logs(commands, connection)
    _add_wait_delete_list(commands, connection)
    return parser


# ---- submit ----------------------------------------------------------------------------------


def default_job_name(script: str, suffix: str) -> str:
    """`train.py` -> `train-<suffix>`: a DNS-1035 label, as the CRD requires."""
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(script).stem.lower()).strip("-")[:40] or "job"
    if not stem[0].isalpha():
        stem = f"job-{stem}"
    return f"{stem}-{suffix}"


@dataclass(frozen=True)
class SubmitOptions:
    """What `submit` was asked to run, read once from the command line."""

    config: str
    image: str
    script: str
    script_args: tuple[str, ...]
    nodes: int | None  # None: not written, the operator takes it from the YAML
    procs_per_node: int | str | None
    gpus: int | None
    env: tuple[tuple[str, str], ...]
    backoff_limit: int | None
    workdir: str | None = None
    requirements: str | None = None
    in_image: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SubmitOptions:
        script_args = list(args.script_args)
        if script_args[:1] == ["--"]:  # `submit ... SCRIPT -- ARGS`
            script_args = script_args[1:]
        return cls(config=args.config, image=args.image, script=args.script,
                   script_args=tuple(script_args), nodes=args.nodes,
                   procs_per_node=args.procs_per_node, gpus=args.gpus, env=tuple(args.env),
                   backoff_limit=args.backoff_limit, workdir=args.workdir,
                   requirements=args.requirements, in_image=args.in_image)

    def pack(self) -> CodeArchive | None:
        """The code to ship, packed; None when there is nothing (the script is in the image).
        Raises CodeError (CodeTooLarge) before anything is created."""
        if self.in_image and self.workdir:
            raise CommandError("--workdir ships a folder to run SCRIPT from, but --in-image "
                               "says SCRIPT is already in the image; drop one of them")
        if self.in_image and not self.requirements:
            return None
        return pack_code(None if self.in_image else self.script, workdir=self.workdir,
                         requirements=self.requirements)

    def build_job(self, name: str, namespace: str,
                  code: CodeArchive | None = None) -> dict[str, Any]:
        """The job; with shipped code its script is the one in the workspace."""
        script = code.entrypoint if code is not None and code.entrypoint else self.script
        return build_job(name=name, namespace=namespace, image=self.image, script=script,
                         script_args=self.script_args, num_nodes=self.nodes,
                         nproc_per_node=self.procs_per_node, env=dict(self.env),
                         gpus_per_node=self.gpus, backoff_limit=self.backoff_limit)


# ---- commands --------------------------------------------------------------------------------


class CommandError(Exception):
    """An expected failure in the CLI itself (a missing file)."""


@dataclass(frozen=True)
class Terminal:
    out: TextIO
    err: TextIO
    prog: str


def _client(args: argparse.Namespace):
    from .client import AccelerateJobClient

    return AccelerateJobClient(kubeconfig=args.kubeconfig, context=args.context,
                               namespace=args.namespace)


def _read_config(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise CommandError(f"cannot read --config {path} ({error.strerror}); write one with "
                           f"`accelerate config --config_file {path}`") from None


def _read_named_files(config: str, config_yaml: str) -> dict[str, str]:
    """The files the YAML names (its DeepSpeed JSON), read beside it, to ship with it."""
    files = {}
    for named in files_named_by(config_yaml):
        path = Path(config).parent / named
        if path.is_file():
            files[path.name] = path.read_text()
    return files


def cmd_submit(args: argparse.Namespace, term: Terminal) -> int:
    options = SubmitOptions.from_args(args)
    config_yaml = _read_config(options.config)
    files = _read_named_files(options.config, config_yaml)
    code = options.pack()  # too big for a ConfigMap: an error before anything is created
    name = args.name or default_job_name(
        options.script, "".join(random.choices(string.ascii_lowercase + string.digits, k=5)))
    client = None if args.dry_run else _client(args)
    namespace = client.namespace if client else (
        args.namespace or context_namespace(args.kubeconfig, args.context))
    job = options.build_job(name, namespace, code)
    if client is None:
        try:
            submission = build_submission(job, config_yaml, namespace, files, code)
        except ConfigError as error:
            raise CommandError(f"{options.config}: {error}") from None
        dump(submission.objects(), args.output or "yaml", term.out)
        return 0
    try:
        created = client.submit(job, config_yaml=config_yaml, config_files=files, code=code)
    except InvalidConfig as error:
        raise CommandError(f"{options.config}: {error}") from None
    if args.output:
        dump([created], args.output, term.out)
    else:
        term.out.write(f"acceleratejob/{name} submitted in namespace {client.namespace}\n")
        if code is not None:
            term.err.write(f"shipped {len(code.files)} file(s), {len(code.data) / 1024:.0f} KiB "
                           f"packed, in configmap/{name}-code\n")
        term.err.write(f"follow it: {term.prog} status {name} -n {client.namespace} --watch\n")
    return 0


def _console(term: Terminal) -> Console:
    """rich draws on the terminal only when there is one: no colours, no redraws in a pipe."""
    return Console(file=term.out, highlight=False)


def _finished(job: dict[str, Any]) -> int | None:
    phase = (job.get("status") or {}).get("phase")
    if phase in FINISHED_PHASES:
        return 0 if phase == SUCCEEDED else 1
    return None


def _status_text(job: dict[str, Any], output: str, watching: bool) -> str:
    """One state of the job as `status` prints it; watching, JSON takes one line per state and
    YAML one document."""
    if output == "json":
        return json.dumps(summarize(job), indent=None if watching else 2)
    if output == "yaml":
        return ("---\n" if watching else "") + yaml.dump(
            summarize(job), sort_keys=False).rstrip("\n")
    return render_status(job)


def cmd_status(args: argparse.Namespace, term: Terminal) -> int:
    client = _client(args)
    if not args.watch:
        term.out.write(_status_text(client.get(args.name), args.output, False) + "\n")
        return 0
    console = _console(term)
    if args.output == "text" and console.is_terminal:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            for job in client.watch(args.name):
                live.update(status_view(job), refresh=True)
                if (code := _finished(job)) is not None:
                    return code
        return 0
    shown = None
    for job in client.watch(args.name):
        text = _status_text(job, args.output, True)
        if text != shown:
            if shown is not None and args.output == "text":
                term.out.write("\n")
            term.out.write(text + "\n")
            term.out.flush()
            shown = text
        if (code := _finished(job)) is not None:
            return code
    return 0


def _where(client: Any, all_namespaces: bool) -> str:
    return "every namespace" if all_namespaces else f"namespace {client.namespace}"


def cmd_top(args: argparse.Namespace, term: Terminal) -> int:
    client = _client(args)
    console = _console(term)
    shape = {"namespaces": args.all_namespaces, "wide": args.output == "wide"}
    jobs_now = client.watch_all(all_namespaces=args.all_namespaces)
    if console.is_terminal:
        latest: list[list[dict[str, Any]]] = [[]]

        def view() -> Group:  # redrawn every second, so AGE moves between events
            return Group(Text(f"AccelerateJobs in {_where(client, args.all_namespaces)}",
                              style="bold"),
                         jobs_table(latest[0], datetime.now(timezone.utc), bars=True, **shape))
        with Live(get_renderable=view, console=console, refresh_per_second=1):
            for jobs in jobs_now:
                latest[0] = jobs
        return 0
    shown = None
    for jobs in jobs_now:
        text = render_table(jobs, datetime.now(timezone.utc), bars=True, **shape)
        if text != shown:
            term.out.write(("\n" if shown is not None else "") + text + "\n")
            term.out.flush()
            shown = text
    return 0


def cmd_logs(args: argparse.Namespace, term: Terminal) -> int:
    client = _client(args)
    node = "all" if args.all else args.node
    result = client.logs(args.name, node=node, follow=args.follow, attempt=args.attempt,
                         tail_lines=args.tail)
    if not isinstance(result, str):
        for line in result:
            term.out.write(line + "\n")
            term.out.flush()
        return 0
    term.out.write(result)
    archived = client.archived_attempts(args.name) if args.attempt is None else []
    if archived:
        term.err.write(f"note: the group was restarted; the logs of attempt(s) "
                       f"{', '.join(map(str, archived))}: {term.prog} logs {args.name} "
                       f"--attempt N\n")
    return 0


def cmd_wait(args: argparse.Namespace, term: Terminal) -> int:
    job = _client(args).wait(args.name, condition=args.condition, timeout=args.timeout)
    term.out.write(f"acceleratejob/{args.name} condition met: {args.condition}"
                   f" ({(job.get('status') or {}).get('phase')})\n")
    return 0


def cmd_delete(args: argparse.Namespace, term: Terminal) -> int:
    _client(args).delete(args.name)
    term.out.write(f"acceleratejob/{args.name} deleted\n")
    return 0


def cmd_list(args: argparse.Namespace, term: Terminal) -> int:
    if args.watch:
        if args.output in ("json", "yaml"):
            raise CommandError("list -w draws a table: use -o text or -o wide with it, or "
                               "`status NAME -w -o json` to follow one job as JSON")
        return cmd_top(args, term)
    client = _client(args)
    jobs = client.list(all_namespaces=args.all_namespaces)
    if args.output in ("json", "yaml"):
        dump_data([summarize(job) for job in jobs], args.output, term.out)
    elif not jobs:
        term.err.write(f"no AccelerateJobs in {_where(client, args.all_namespaces)}\n")
    else:
        term.out.write(render_table(jobs, datetime.now(timezone.utc),
                                    namespaces=args.all_namespaces,
                                    wide=args.output == "wide") + "\n")
    return 0


COMMANDS = {"submit": cmd_submit, "status": cmd_status, "logs": cmd_logs, "wait": cmd_wait,
            "delete": cmd_delete, "list": cmd_list, "top": cmd_top}


def program_name(argv0: str) -> str:
    """`kubectl accelerate` when kubectl runs us as its plugin `kubectl-accelerate`."""
    base = os.path.basename(argv0)
    return f"kubectl {base[len('kubectl-'):]}" if base.startswith("kubectl-") else PROG


def main(argv: list[str] | None = None, out: TextIO | None = None,
         err: TextIO | None = None) -> int:
    term = Terminal(out or sys.stdout, err or sys.stderr,
                    program_name(sys.argv[0] if sys.argv else PROG))
    args = build_parser(term.prog).parse_args(argv)
    try:
        return COMMANDS[args.command](args, term)
    except (AccelerateJobError, CommandError) as error:
        message = str(error).replace(f"`{PROG} ", f"`{term.prog} ")
        term.err.write(f"error: {message}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `accelerate-job logs x | head`
        return 0

