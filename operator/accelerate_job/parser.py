"""The command line of `accelerate-job` (and `kubectl accelerate`), in kubectl's habits: the
cluster flags (-n, --context, --kubeconfig, -A, -o) go anywhere, before or after the command;
`get` and `describe`; `wait --for=condition=X --timeout=10m`; several names or -l for get,
delete and wait; and what kubectl has no command for: `status` (one job, or a live progress bar
with -w), `top`, `logs --attempt N`. argparse does the parsing: the global flags are one parent
parser, added to the top level and (with SUPPRESS defaults, so they do not overwrite what was
given before the command) to every command."""

from __future__ import annotations

import argparse
from typing import Any

from . import options

PROG = "accelerate-job"
KINDS = "AccelerateJobs (also: ajob)"

# The -o formats each command prints; the first is what it prints without -o.
OUTPUTS = {
    "submit": ("", "yaml", "json"),
    "get": ("", "wide", "name", "json", "yaml", "jsonpath"),
    "status": ("text", "wide", "json", "yaml"),
    "top": ("text", "wide"),
    "describe": ("",), "logs": ("",), "wait": ("",), "delete": ("", "name"),
}


def _global_options(suppress: bool) -> argparse.ArgumentParser:
    """-n, --context, --kubeconfig, -A and -o; `suppress`: the copy each command carries."""
    default = (lambda value: argparse.SUPPRESS) if suppress else (lambda value: value)
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("cluster and output (anywhere on the line)")
    group.add_argument("--kubeconfig", default=default(None),
                       help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    group.add_argument("--context", default=default(None),
                       help="kubeconfig context (default: the current one)")
    group.add_argument("-n", "--namespace", default=default(None),
                       help="namespace (default: the context's, else default)")
    group.add_argument("-A", "--all-namespaces", action="store_true", default=default(False),
                       help="every namespace (get, top; needs cluster-wide list)")
    group.add_argument("-o", "--output", type=options.output, default=default(None),
                       metavar="FORMAT",
                       help="name, wide, json, yaml or jsonpath=TEMPLATE, where the command "
                            "prints them")
    return parent


def _selector(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-l", "--selector", metavar="SELECTOR",
                        help="label selector, as kubectl takes it (app=x,tier!=y)")


def _names(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("names", nargs="*", metavar="NAME", help=what)


def _add_submit(commands: Any, parent: argparse.ArgumentParser, prog: str) -> None:
    submit = commands.add_parser(
        "submit", parents=[parent], help="run a training script as an AccelerateJob",
        description="Create an AccelerateJob running `accelerate-trainer SCRIPT ARGS...` on NODES "
        "pods, a ConfigMap with the accelerate YAML, and one with your code: SCRIPT (a file on "
        "this machine), or with --workdir the folder it is in, packed and unpacked into the "
        "pods' /workspace before `accelerate launch`. With --in-image, SCRIPT is a path inside "
        "the image and nothing is packed. Options go before SCRIPT: everything after it is "
        "passed to the script. -o yaml|json prints the objects created (with --dry-run, the "
        "ones that would be).",
        usage=f"{prog} submit --config FILE --image IMAGE [options] [--workdir DIR] "
              "[--requirements FILE] SCRIPT [ARGS...]\n"
              f"       {prog} submit --config FILE --image IMAGE [options] --in-image PATH "
              "[ARGS...]")
    submit.add_argument("--config", required=True, metavar="FILE",
                        help="the accelerate YAML (`accelerate config --config_file FILE`)")
    submit.add_argument("--image", required=True, help="the trainer image")
    submit.add_argument("--nodes", type=options.positive, default=None,
                        help="pods (machines); default: the YAML's num_machines, else 1")
    submit.add_argument("--procs-per-node", type=options.procs, default=None, metavar="N|auto",
                        help="training processes per pod (auto: one per GPU); default: the "
                             "YAML's num_processes / num_machines, else 1")
    submit.add_argument("--gpus", type=options.positive, default=None, metavar="N",
                        help="nvidia.com/gpu per pod")
    submit.add_argument("--name", help="the job's name (default: the script's name and a suffix)")
    submit.add_argument("--env", type=options.env_pair, action="append", default=[],
                        metavar="KEY=VALUE",
                        help="environment of the training processes (repeatable)")
    submit.add_argument("--backoff-limit", type=int, default=None, metavar="N",
                        help="whole-group restarts before the job fails (default: the CRD's, 3)")
    submit.add_argument("--dry-run", action="store_true",
                        help="print the objects instead of creating them (no cluster needed)")
    _add_submit_code(submit)


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
    submit.add_argument("script", metavar="SCRIPT",
                        help="the training script on this machine (with --in-image: in the "
                             "image)")
    submit.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="the script's arguments")


def _add_reading(commands: Any, parent: argparse.ArgumentParser) -> None:
    for add in (_add_get, _add_describe, _add_status, _add_top):
        add(commands, parent)


def _add_get(commands: Any, parent: argparse.ArgumentParser) -> None:
    get = commands.add_parser(
        "get", parents=[parent], help="a table of jobs, or the jobs as name/json/yaml/jsonpath",
        description="The table `kubectl get ajob` prints (the CRD's printer columns): every job "
        "of the namespace, or the NAMEs, or those -l selects. -o wide adds the columns kubectl's "
        "wide adds; -o json|yaml print the objects as the API server has them (a List for "
        "several), -o name prints acceleratejob.accelerate-operator.io/NAME, -o "
        "jsonpath=TEMPLATE prints a kubectl JSONPath template.")
    _names(get, "jobs to show (default: every job)")
    _selector(get)
    get.add_argument("-w", "--watch", action="store_true",
                     help="keep the table live (as `top` does)")


def _add_describe(commands: Any, parent: argparse.ArgumentParser) -> None:
    describe = commands.add_parser(
        "describe", parents=[parent], help="a job's story: conditions, events, pods, failure",
        description="What happened to a job: its phase and progress, conditions, goodput, the "
        "last failure with its log lines, its pods, and its events.")
    _names(describe, "jobs to describe (default: every job, or those -l selects)")
    _selector(describe)


def _add_status(commands: Any, parent: argparse.ArgumentParser) -> None:
    status = commands.add_parser("status", parents=[parent],
                                 help="phase, nodes, restarts and progress of a job")
    status.add_argument("name", metavar="NAME")
    status.add_argument("-w", "--watch", action="store_true",
                        help="keep a live progress bar until the job finishes (a watch on the "
                             "job: it changes as the status does); -o json: one line per "
                             "change, yaml: one document each; -o wide adds the table's other "
                             "columns")


def _add_top(commands: Any, parent: argparse.ArgumentParser) -> None:
    commands.add_parser(
        "top", parents=[parent], help="every job's phase, progress and ETA, live (Ctrl-C)",
        description="Like `kubectl get ajob -w`, but one table kept up to date in place, with "
        "progress bars: a watch on the namespace's jobs redraws it as their status changes. "
        "Without a terminal, the table is printed again after each change.")


def _add_logs(commands: Any, parent: argparse.ArgumentParser) -> None:
    logs = commands.add_parser(
        "logs", parents=[parent], help="a node's log; -p: the attempt before the restart",
        description="The log of node 0 (--node N, --all). -p/--previous reads the log the "
        "operator archived when it last restarted the group; --attempt N the one of attempt N.")
    logs.add_argument("name", metavar="NAME")
    which = logs.add_mutually_exclusive_group()
    which.add_argument("--node", type=int, default=0, metavar="N", help="node index; default 0")
    which.add_argument("--all", action="store_true",
                       help="every node, each line prefixed [node N]")
    logs.add_argument("-c", "--container", metavar="NAME",
                      help="a container of the pod (default: the trainer)")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="stream, following the pods through restarts until the job finishes")
    attempt = logs.add_mutually_exclusive_group()
    attempt.add_argument("-p", "--previous", action="store_true",
                         help="the log archived when the group was last restarted")
    attempt.add_argument("--attempt", type=int, default=None, metavar="N",
                         help="the log archived when attempt N was restarted")
    logs.add_argument("--since", type=options.duration, default=None, metavar="DURATION",
                      help="only lines newer than this (5s, 2m, 3h; live logs)")
    logs.add_argument("--tail", type=int, default=None, metavar="LINES",
                      help="only the last LINES lines (live logs; -1: every line)")


def _add_wait_delete(commands: Any, parent: argparse.ArgumentParser) -> None:
    wait = commands.add_parser(
        "wait", parents=[parent], help="block until jobs reach a condition (exit 1 if one fails)",
        description="Like `kubectl wait`: --for=condition=TYPE (default Succeeded), "
        "--for=jsonpath='{.status.phase}'=VALUE, or --for=delete, for each NAME or every job "
        "-l selects, within one --timeout.")
    _names(wait, "jobs to wait for")
    _selector(wait)
    wait.add_argument("--for", dest="wait_for", type=options.wait_for,
                      default=options.wait_for("condition=Succeeded"), metavar="TARGET",
                      help="condition=TYPE, jsonpath=TEMPLATE[=VALUE] or delete")
    wait.add_argument("--timeout", type=options.duration, default=3600.0, metavar="DURATION",
                      help="give up after this long: 30s, 10m, 1h (default 1h)")

    delete = commands.add_parser("delete", parents=[parent],
                                 help="delete jobs with their pods and ConfigMaps")
    _names(delete, "jobs to delete")
    _selector(delete)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, parents=[_global_options(suppress=False)],
        description="Submit, watch and read AccelerateJobs (multi-node `accelerate launch` on "
        "Kubernetes).",
        epilog="Also a kubectl plugin: `kubectl accelerate COMMAND ...` runs this program when "
        "`kubectl-accelerate` is on PATH (installed with this package, or any symlink of that "
        "name to accelerate-job).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parent = _global_options(suppress=True)
    _add_submit(commands, parent, prog)
    _add_reading(commands, parent)
    _add_logs(commands, parent)
    _add_wait_delete(commands, parent)
    return parser


def check_output(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error (exit 2) when the command does not print the -o format asked for."""
    allowed = OUTPUTS[args.command]
    if args.output is not None and args.output.kind not in allowed:
        formats = [kind + ("=TEMPLATE" if kind == "jsonpath" else "") for kind in allowed if kind]
        parser.error(f"{args.command} -o {args.output.kind}: "
                     + (f"{args.command} prints {', '.join(formats)}" if formats else
                        f"{args.command} takes no -o"))
