"""`accelerate-operator` / `python -m accelerate_operator`: run the operator against the current
kubeconfig, or in-cluster. One replica only: kopf has no leader election."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys


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
