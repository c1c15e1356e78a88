"""`accelerate-operator` / `python -m accelerate_operator`: run the operator against the current
kubeconfig, or in-cluster. One replica only: kopf has no leader election."""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import logging
import os
import signal
import sys


def log_memory(*_: object) -> None:
    """`kill -USR2 <pid>`: the RSS, the memory blocks Python's allocator holds for live objects,
    and the most numerous live Python objects, in the log, to see what holds memory in a running
    operator (docs/benchmarks.md, finding 6): live blocks back at the idle count while the RSS is
    not means the allocator, not a leak, keeps the pages."""
    gc.collect()
    counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
    rss = next((line.split()[1] for line in open("/proc/self/status")
                if line.startswith("VmRSS")), "?")
    logging.getLogger("accelerate_operator").warning(
        "memory: RSS %s KiB, %d allocated blocks (%s), %d objects tracked by gc; most "
        "numerous: %s", rss, sys.getallocatedblocks(), os.environ.get("PYTHONMALLOC", "pymalloc"),
        sum(counts.values()), ", ".join(f"{n} {name}" for name, n in counts.most_common(12)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="accelerate-operator", description=__doc__)
    parser.add_argument("-n", "--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable); default: every namespace")
    parser.add_argument("--liveness-port", type=int, default=None,
                        help="serve kopf's health check on http://0.0.0.0:PORT/healthz")
    parser.add_argument("--log-level",
                        default=os.environ.get("ACCELERATE_OPERATOR_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    namespaces = args.namespace or [
        ns for ns in os.environ.get("ACCELERATE_OPERATOR_NAMESPACES", "").split(",") if ns
    ]

    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().level > logging.DEBUG:
        # kopf logs "Handler ... succeeded" for every pod event: several lines per job, most of
        # the log and a real share of the CPU at scale. Our own transitions are logged instead.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    signal.signal(signal.SIGUSR2, log_memory)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    asyncio.run(kopf.operator(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness,
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
