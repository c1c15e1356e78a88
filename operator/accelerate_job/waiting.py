"""`wait`: kubectl's `wait --for=condition=X|jsonpath=...|delete --timeout=D NAME... | -l SEL`.
Each job is followed with a watch (client.watch), all within one deadline; a job that fails,
or finishes without what was asked, ends the wait at once (exit 1), since waiting longer
cannot help."""

from __future__ import annotations

import argparse
import time
from typing import Any

from accelerate_operator.constants import FINISHED_PHASES

from . import session
from .commands import targets
from .errors import AccelerateJobError, JobNotFound, WaitTimeout
from .options import WaitFor
from .render import printable
from .session import CommandError, Terminal


def _phase(job: dict[str, Any]) -> str:
    return (job.get("status") or {}).get("phase") or "Pending"


def _matches(target: WaitFor, job: dict[str, Any]) -> bool:
    values = target.template.values(job)
    if target.value is None:
        return bool(values)
    return any(str(value) == target.value or (isinstance(value, bool) and
                                              str(value).lower() == target.value)
               for value in values)


def _jsonpath(client: Any, name: str, target: WaitFor, timeout: float) -> str:
    job: dict[str, Any] = {}
    for job in client.watch(name, timeout=timeout):
        if _matches(target, job):
            return _phase(job)
        if _phase(job) in FINISHED_PHASES:
            found = " ".join(map(str, target.template.values(job))) or "nothing"
            raise AccelerateJobError(printable(
                f"AccelerateJob {name} is {_phase(job)} and will not change: "
                f"{target.template.source} is {found}, not {target.value}"))
    raise WaitTimeout(printable(f"AccelerateJob {name} is still {_phase(job)} after "
                                f"{timeout:g}s of waiting for {target.template.source}"
                                + (f"={target.value}" if target.value is not None else "")
                                + "; wait longer with --timeout"))


def _deleted(client: Any, name: str, timeout: float) -> str:
    try:
        for _ in client.watch(name, timeout=timeout):
            pass
    except JobNotFound:
        return "deleted"
    raise WaitTimeout(f"AccelerateJob {name} still exists after {timeout:g}s; wait longer "
                      "with --timeout")


def wait_one(client: Any, name: str, target: WaitFor, timeout: float) -> str:
    """Block until `target` holds for job `name`; returns its phase then."""
    if target.kind == "condition":
        return _phase(client.wait(name, condition=target.condition, timeout=timeout))
    if target.kind == "jsonpath":
        return _jsonpath(client, name, target, timeout)
    return _deleted(client, name, timeout)


def cmd_wait(args: argparse.Namespace, term: Terminal) -> int:
    client = session.client(args)
    names = targets(client, args, "wait for")
    if not names:
        raise CommandError(f"no AccelerateJob matches -l {args.selector} in namespace "
                           f"{client.namespace}")
    deadline = time.monotonic() + args.timeout
    for name in names:
        left = round(max(0.0, deadline - time.monotonic()), 1)
        phase = wait_one(client, name, args.wait_for, left)
        suffix = "" if args.wait_for.kind == "delete" else f" ({phase})"
        term.out.write(f"acceleratejob/{name} {args.wait_for.describe()}{suffix}\n")
        term.out.flush()
    return 0
