"""What every command shares: where it writes, the client the global flags describe, and the
error a command raises for an expected failure (main prints it in one line, exit 1)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console


class CommandError(Exception):
    """An expected failure in the CLI itself (a missing file, flags that do not mix)."""


@dataclass(frozen=True)
class Terminal:
    out: TextIO
    err: TextIO
    prog: str


def client(args: argparse.Namespace):
    """The client of the cluster, context and namespace the global flags name."""
    from .client import AccelerateJobClient

    return AccelerateJobClient(kubeconfig=args.kubeconfig, context=args.context,
                               namespace=args.namespace)


def console(term: Terminal) -> Console:
    """rich draws on the terminal only when there is one: no colours, no redraws in a pipe."""
    return Console(file=term.out, highlight=False)


def output_kind(args: argparse.Namespace, default: str = "text") -> str:
    return args.output.kind if args.output is not None else default
