"""The commands that read and remove jobs: get, describe, status, top, logs, delete.
Each takes the parsed arguments and a Terminal, asks the client (session.client), and prints
what render, printing and describe build."""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from typing import Any

import yaml
from accelerate_operator.constants import FINISHED_PHASES, SUCCEEDED
from rich.console import Group
from rich.live import Live
from rich.text import Text

from . import session
from .describe import render_describe
from .printing import RESOURCE, render_jobs
from .render import (
    jobs_table,
    render_status,
    render_table,
    render_wide_status,
    status_view,
    summarize,
)
from .session import CommandError, Terminal


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _where(client: Any, all_namespaces: bool) -> str:
    return "every namespace" if all_namespaces else f"namespace {client.namespace}"


def targets(client: Any, args: argparse.Namespace, verb: str | None) -> list[str]:
    """The job names a command works on: the NAMEs, or those -l selects; with neither, every
    job (`get`), or an error saying how to name them when `verb` needs names."""
    names = list(getattr(args, "names", None) or [])
    if names and args.selector:
        raise CommandError(f"name the jobs or select them with -l {args.selector}, not both")
    if (names or verb) and args.all_namespaces:
        raise CommandError(f"{verb or 'a name'} works in one namespace: drop -A, and give "
                           "the namespace with -n")
    if names:
        return names
    if verb and not args.selector:
        raise CommandError(f"name the jobs to {verb} ({verb} NAME...), or select them "
                           "with -l KEY=VALUE")
    return [job["metadata"]["name"] for job in client.list(selector=args.selector)]


def _jobs(client: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """What `get` and `describe` show: the named jobs, or every job -l/-A pick."""
    if args.names:
        targets(client, args, None)  # the checks on names, -l and -A
        return [client.get(name) for name in args.names]
    return client.list(all_namespaces=args.all_namespaces, selector=args.selector)


def cmd_get(args: argparse.Namespace, term: Terminal) -> int:
    if args.watch:
        if args.names or args.selector or session.output_kind(args) not in ("text", "wide"):
            raise CommandError("get -w draws the table of every job: drop the NAMEs, -l and -o, "
                               "or follow one job with `status NAME -w -o json`")
        return cmd_top(args, term)
    client = session.client(args)
    jobs = _jobs(client, args)
    if not jobs and session.output_kind(args) in ("text", "wide"):
        term.err.write(f"No AccelerateJobs found in {_where(client, args.all_namespaces)}.\n")
        return 0
    term.out.write(render_jobs(jobs, args.output, _now(), single=len(args.names) == 1,
                               namespaces=args.all_namespaces))
    return 0


def cmd_describe(args: argparse.Namespace, term: Terminal) -> int:
    client = session.client(args)
    jobs = _jobs(client, args)
    if not jobs:
        term.err.write(f"No AccelerateJobs found in {_where(client, args.all_namespaces)}.\n")
    for index, job in enumerate(jobs):
        name = job["metadata"]["name"]
        here = client if not args.all_namespaces else session.client(
            argparse.Namespace(**{**vars(args), "namespace": job["metadata"]["namespace"]}))
        text = render_describe(job, here.pods(name), here.events(name), _now())
        term.out.write(("\n\n" if index else "") + text + "\n")
    return 0


def cmd_delete(args: argparse.Namespace, term: Terminal) -> int:
    client = session.client(args)
    names = targets(client, args, "delete")
    if not names:
        term.err.write(f"No AccelerateJobs found in {_where(client, False)}.\n")
    for name in names:
        client.delete(name)
        term.out.write(f"{RESOURCE}/{name}\n" if session.output_kind(args) == "name"
                       else f"acceleratejob/{name} deleted\n")
    return 0


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
    return render_wide_status(job) if output == "wide" else render_status(job)


def _status_live(client: Any, name: str, term: Terminal) -> int:
    with Live(console=session.console(term), auto_refresh=False, transient=False) as live:
        for job in client.watch(name):
            live.update(status_view(job), refresh=True)
            if (code := _finished(job)) is not None:
                return code
    return 0


def cmd_status(args: argparse.Namespace, term: Terminal) -> int:
    client, output = session.client(args), session.output_kind(args)
    if not args.watch:
        term.out.write(_status_text(client.get(args.name), output, False) + "\n")
        return 0
    if output in ("text", "wide") and session.console(term).is_terminal:
        return _status_live(client, args.name, term)
    shown = None
    for job in client.watch(args.name):
        text = _status_text(job, output, True)
        if text != shown:
            if shown is not None and output in ("text", "wide"):
                term.out.write("\n")
            term.out.write(text + "\n")
            term.out.flush()
            shown = text
        if (code := _finished(job)) is not None:
            return code
    return 0


def cmd_top(args: argparse.Namespace, term: Terminal) -> int:
    client, console = session.client(args), session.console(term)
    shape = {"namespaces": args.all_namespaces, "wide": session.output_kind(args) == "wide"}
    jobs_now = client.watch_all(all_namespaces=args.all_namespaces)
    if console.is_terminal:
        latest: list[list[dict[str, Any]]] = [[]]

        def view() -> Group:  # redrawn every second, so AGE moves between events
            return Group(Text(f"AccelerateJobs in {_where(client, args.all_namespaces)}",
                              style="bold"), jobs_table(latest[0], _now(), bars=True, **shape))
        with Live(get_renderable=view, console=console, refresh_per_second=1):
            for jobs in jobs_now:
                latest[0] = jobs
        return 0
    shown = None
    for jobs in jobs_now:
        text = render_table(jobs, _now(), bars=True, **shape)
        if text != shown:
            term.out.write(("\n" if shown is not None else "") + text + "\n")
            term.out.flush()
            shown = text
    return 0


def _previous_attempt(client: Any, name: str) -> int:
    """`logs -p`: the last attempt whose log the operator archived at a group restart."""
    archived = client.archived_attempts(name)
    if not archived:
        raise CommandError(
            f"AccelerateJob {name} has no previous attempt archived: the operator archives a "
            "group's logs when it restarts the whole group, and a restart in place keeps every "
            f"attempt in the live log (`logs {name}`)")
    return archived[-1]


def cmd_logs(args: argparse.Namespace, term: Terminal) -> int:
    client = session.client(args)
    attempt = _previous_attempt(client, args.name) if args.previous else args.attempt
    since = None if args.since is None else max(1, round(args.since))
    result = client.logs(args.name, node="all" if args.all else args.node, follow=args.follow,
                         attempt=attempt, tail_lines=args.tail, container=args.container,
                         since_seconds=since)
    if not isinstance(result, str):
        for line in result:
            term.out.write(line + "\n")
            term.out.flush()
        return 0
    term.out.write(result)
    archived = client.archived_attempts(args.name) if attempt is None else []
    if archived:
        term.err.write(f"note: the group was restarted; the logs of attempt(s) "
                       f"{', '.join(map(str, archived))}: {term.prog} logs {args.name} "
                       f"-p (the last), or --attempt N\n")
    return 0
