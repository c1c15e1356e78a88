"""`accelerate-operator` / `python -m accelerate_operator`: run the operator against the current
kubeconfig, or in-cluster. One replica only: there is no leader election (two replicas would
both act on every AccelerateJob), so the chart runs one with `strategy: Recreate`."""

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
    from .heap import heap_usage

    gc.collect()
    counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
    rss = next((line.split()[1] for line in open("/proc/self/status")
                if line.startswith("VmRSS")), "?")
    heap = heap_usage()
    logging.getLogger("accelerate_operator").warning(
        "memory: RSS %s KiB, %d allocated blocks (%s), glibc heap %s, %d objects tracked by "
        "gc; most numerous: %s", rss, sys.getallocatedblocks(),
        os.environ.get("PYTHONMALLOC", "pymalloc"),
        f"{heap[0] >> 10} KiB in use, {heap[1] >> 10} KiB free" if heap else "unknown",
        sum(counts.values()), ", ".join(f"{n} {name}" for name, n in counts.most_common(12)))


async def serve(namespaces: list[str], liveness_port: int | None) -> None:
    """Run the operator until SIGTERM or SIGINT; the health check answers meanwhile."""
    from aiohttp import web

    from .controller import Controller
    from .kube import Kube

    controller = Controller(Kube.from_environment(), namespaces)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGUSR2, log_memory)
    health = None
    if liveness_port:
        async def healthz(_: web.Request) -> web.Response:
            # The event loop answered: the watches and passes it runs are not stuck.
            return web.json_response({"synced": controller.synced, "jobs": len(controller.jobs)})
        app = web.Application()
        app.router.add_get("/healthz", healthz)
        health = web.AppRunner(app, access_log=None)
        await health.setup()
        await web.TCPSite(health, "0.0.0.0", liveness_port).start()
    running = asyncio.create_task(controller.run(), name="controller")
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (running, stopping):
            task.cancel()
        await asyncio.gather(running, stopping, return_exceptions=True)
        if health is not None:
            await health.cleanup()
    if running.done() and not running.cancelled() and running.exception() is not None:
        raise running.exception()
    logging.getLogger("accelerate_operator").info("stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="accelerate-operator", description=__doc__)
    parser.add_argument("-n", "--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable); default: every namespace")
    parser.add_argument("--liveness-port", type=int, default=None,
                        help="serve the health check on http://0.0.0.0:PORT/healthz")
    parser.add_argument("--log-level",
                        default=os.environ.get("ACCELERATE_OPERATOR_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    namespaces = args.namespace or [
        ns for ns in os.environ.get("ACCELERATE_OPERATOR_NAMESPACES", "").split(",") if ns
    ]
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(namespaces, args.liveness_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
