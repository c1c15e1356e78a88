"""`accelerate-operator` / `python -m accelerate_operator`: run the operator (kopf, with the
handlers of handlers.py) against the current kubeconfig, or in-cluster. With `--peering NAME`
it is one replica of several: kopf's peering keeps the first started active and the others
paused, and a paused replica takes over when the active one is gone (the chart runs two).
`kopf run -m accelerate_operator.handlers --standalone` runs the same handlers."""

from __future__ import annotations

import argparse
import getpass
import logging
import os
import random
import socket
import sys
import time

from .peering import DEFAULT_LIFETIME_SECONDS


def replica_priority(now_ns: int | None = None) -> int:
    """kopf's peering pauses every replica but the one of highest priority, and pauses them all
    when two share it. The replica that started first gets the highest: a new or restarted
    replica never takes over from a running one (no handover on a rollout of standbys), and
    the random last digits keep two replicas started in the same millisecond apart."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    return -(now_ns // 1_000_000) * 1000 + random.randrange(1000)


def replica_identity() -> str:
    """This replica's name in kopf's peering records, as kopf makes it (user@host/time/random),
    given to kopf so that peering.py can find its own record."""
    now = time.strftime("%Y%m%d%H%M%S", time.gmtime())
    suffix = "".join(random.choices("abcdefhijklmnopqrstuvwxyz0123456789", k=3))
    return f"{getpass.getuser()}@{socket.gethostname()}/{now}/{suffix}"


# kopf renews a replica's record 5 to 10 s before it ends, and an answer read from the peering
# object stands for 10 s (peering.py): a shorter lifetime would leave no room between the two.
MIN_PEERING_LIFETIME = 20


def peering_lifetime(text: str) -> int:
    """--peering-lifetime: whole seconds, at least MIN_PEERING_LIFETIME."""
    try:
        seconds = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds") from None
    if seconds < MIN_PEERING_LIFETIME:
        raise argparse.ArgumentTypeError(
            f"{seconds} s is too short: kopf renews a record 5 to 10 s before it ends; use at "
            f"least {MIN_PEERING_LIFETIME}")
    return seconds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accelerate-operator", description=__doc__)
    parser.add_argument("-n", "--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable); default: every namespace")
    parser.add_argument("--liveness-port", type=int, default=None,
                        help="serve kopf's liveness endpoint on http://0.0.0.0:PORT/healthz")
    parser.add_argument("--peering", default=None, metavar="NAME",
                        help="run as one replica of several: kopf's peering object NAME "
                             "(a KopfPeering in the namespace watched, or a ClusterKopfPeering "
                             "cluster-wide) keeps one active and pauses the others; default: "
                             "standalone, the only replica")
    parser.add_argument("--priority", type=int, default=None,
                        help="this replica's peering priority (default: the one started first "
                             "wins)")
    parser.add_argument("--peering-lifetime", type=peering_lifetime,
                        default=DEFAULT_LIFETIME_SECONDS,
                        metavar="SECONDS",
                        help="how long this replica's keep-alive record stands: a standby takes "
                             "over this long after an active replica that died without a word "
                             "(its node lost) last renewed it (default: kopf's 60)")
    parser.add_argument("--log-level",
                        default=os.environ.get("ACCELERATE_OPERATOR_LOG_LEVEL", "INFO"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    namespaces = args.namespace or [
        ns for ns in os.environ.get("ACCELERATE_OPERATOR_NAMESPACES", "").split(",") if ns
    ]
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # kopf logs every handler call and watch-stream step at INFO/DEBUG: at thousands of pods
    # that is most of the log and a good part of the CPU. Its warnings and errors stay.
    logging.getLogger("kopf").setLevel(max(logging.WARNING, logging.getLogger().level))
    # kopf's liveness endpoint (aiohttp) logs every probe at INFO: a line every 5 s per replica.
    logging.getLogger("aiohttp.access").setLevel(max(logging.WARNING, logging.getLogger().level))
    import kopf

    from . import handlers  # noqa: F401 - registers the handlers with kopf

    identity = replica_identity()
    settings = kopf.OperatorSettings()
    settings.peering.lifetime = args.peering_lifetime
    kopf.run(
        settings=settings,
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.peering is None,
        peering_name=args.peering,
        identity=identity,
        # What the handlers need to know of this run: kopf's operator memo (handlers.py).
        memo=kopf.Memo(namespaces=list(namespaces), identity=identity),
        priority=args.priority if args.priority is not None else replica_priority(),
        liveness_endpoint=(f"http://0.0.0.0:{args.liveness_port}/healthz"
                           if args.liveness_port else None),
    )
    logging.getLogger("accelerate_operator").info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
