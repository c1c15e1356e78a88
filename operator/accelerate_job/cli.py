"""`accelerate-job`: submit, watch and read AccelerateJobs from a terminal.

Also a kubectl plugin: installed as `kubectl-accelerate` (a console script of this package, or a
symlink of that name to `accelerate-job`), it runs as `kubectl accelerate ...` and behaves the
same. The line is parsed by parser.py; each command is a function of (arguments, Terminal).
Expected errors (a missing job, a failed job, a bad config) print one line saying what to do and
exit 1, never a traceback; usage errors exit 2 (argparse)."""

from __future__ import annotations

import os
import sys
from typing import TextIO

from .commands import cmd_delete, cmd_describe, cmd_get, cmd_logs, cmd_status, cmd_top
from .errors import AccelerateJobError
from .parser import PROG, build_parser, check_output
from .render import printable
from .session import CommandError, Terminal
from .submit import cmd_submit
from .waiting import cmd_wait

COMMANDS = {"submit": cmd_submit, "get": cmd_get, "describe": cmd_describe,
            "status": cmd_status, "logs": cmd_logs, "wait": cmd_wait, "delete": cmd_delete,
            "top": cmd_top}


def program_name(argv0: str) -> str:
    """`kubectl accelerate` when kubectl runs us as its plugin `kubectl-accelerate`."""
    base = os.path.basename(argv0)
    return f"kubectl {base[len('kubectl-'):]}" if base.startswith("kubectl-") else PROG


def main(argv: list[str] | None = None, out: TextIO | None = None,
         err: TextIO | None = None) -> int:
    term = Terminal(out or sys.stdout, err or sys.stderr,
                    program_name(sys.argv[0] if sys.argv else PROG))
    parser = build_parser(term.prog)
    args = parser.parse_args(argv)
    check_output(parser, args)
    try:
        return COMMANDS[args.command](args, term)
    except (AccelerateJobError, CommandError) as error:
        # what the server and the job's pods wrote may hold escape codes: written out
        message = printable(str(error)).replace(f"`{PROG} ", f"`{term.prog} ")
        term.err.write(f"error: {message}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `accelerate-job logs x | head`
        return 0
