"""Where the operator's CPU goes during a burst, on the CPU clock: what each kind of event-loop
callback costs per job, the cycle collector's share, and the collector stock against the
operator's settings (heap.settle_garbage_collector), side by side in one run
(docs/benchmarks.md, "Where the CPU goes, on the CPU clock").

A sampling profiler is no good here: on this 2-core machine, shared with the API server, it
counts a thread waiting for a core as busy. So each round starts the operator in-process on this
host (`accelerate-operator`, against $KUBECONFIG, with the image's allocator settings) in a
child process that keeps a ledger:
- every callback the event loop runs, timed with the main thread's CPU clock and booked to
  what it runs: a task's outermost coroutine (kopf's per-object `worker`, its `watcher`, our
  `WorkQueue._worker`, ...) or the callback itself (a socket's `_read_ready`: TLS and HTTP
  parsing);
- the collector's time (`gc.callbacks`), taken out of the callback it interrupted;
- the main thread's CPU outside callbacks (the loop itself), and the other threads'.

20 s after the child starts, N two-node Pending jobs are created (bench/throughput.py's
template) until every pod exists, then their namespace is deleted. The child reports each
phase. The variants alternate, so a machine that slows down weighs on both. The chart's operator
is scaled to zero meanwhile and back afterwards.

`--compare loop` runs asyncio's event loop against uvloop's (what `kopf run` picks where uvloop is
installed), both with the settled collector and without the ledger, whose per-callback timing
cannot reach into uvloop's C callbacks and would weigh on one side only: the process's CPU per
phase and the collector's.

Usage: python bench/cpu_ledger.py [--jobs 500] [--rounds 2] [--compare collector|loop]
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time

DEPLOYMENT = ("accelerate-system", "accelerate-operator")
COLLECTOR = "cycle collector"
LOOP = "event loop itself (select, scheduling)"
THREADS = "other threads"


def book_of(handle: object) -> str:
    """What a callback's CPU is booked to: a task's outermost coroutine, else the callback."""
    callback = getattr(handle, "_callback", None)
    owner = getattr(callback, "__self__", None)
    if hasattr(owner, "get_coro"):
        coro = owner.get_coro()
        code = getattr(coro, "cr_code", None)
        name = getattr(coro, "__qualname__", None) or type(coro).__name__
        path = code.co_filename if code else ""
        package = next((p for p in ("kopf", "accelerate_operator", "aiohttp", "asyncio")
                        if f"/{p}/" in path), "")
        return f"task {package}:{name}" if package else f"task {name}"
    name = getattr(callback, "__qualname__", None) or type(callback).__name__
    return f"callback {name}"


def book_inside_kopfs_worker() -> collections.Counter[str]:
    """Split kopf's per-object worker: its processing of one event (kopf's
    `process_resource_event`, which does not suspend for these kinds) and, inside that, the
    operator's own code its handlers call (indexing functions, `when` filters, on-event
    hand-offs to the work queue). Timed with the thread's CPU clock, collector included."""

    from accelerate_operator import controller, handlers
    from kopf._core.reactor import processing

    inside: collections.Counter[str] = collections.Counter()
    depth = [0]  # on_job calls job_event_matters: book the outermost call only

    def timed(book: str, function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            started = time.thread_time()
            depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    inside[book] += time.thread_time() - started
        return wrapper

    process = processing.process_resource_event

    @functools.wraps(process)
    async def timed_process(*args, **kwargs):
        started = time.thread_time()
        try:
            return await process(*args, **kwargs)
        finally:
            inside["kopf's processing of the event, all of it"] += time.thread_time() - started

    processing.process_resource_event = timed_process  # looked up when kopf starts watching
    ours = "of which the operator's code in its handlers"
    for name in ("lean_job", "pod_entry", "owning_job", "lean_workload", "owner_uid"):
        setattr(handlers, name, timed(ours, getattr(handlers, name)))
    for name in ("on_job", "on_pod", "on_child", "job_event_matters", "pod_event_matters",
                 "child_event_matters"):
        setattr(controller.Controller, name, timed(ours, getattr(controller.Controller, name)))
    return inside


def child(stock: bool, loop: str, keep_ledger: bool) -> int:
    """The operator with its ledger; SIGUSR1 prints what was spent since the last one. Without
    the ledger (the loop comparison: uvloop's callbacks are C, out of its reach), only the
    process's CPU and the collector's."""
    import asyncio.events
    import gc

    ledger: collections.Counter[str] = collections.Counter()
    collections_run = [0, 0, 0]
    state = {"gc_started": 0.0, "gc_in_callback": 0.0, "in_callback": 0.0}

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            state["gc_started"] = time.thread_time()
            return
        spent = time.thread_time() - state["gc_started"]
        ledger[COLLECTOR] += spent
        state["gc_in_callback"] += spent
        collections_run[info["generation"]] += 1

    run = asyncio.events.Handle._run

    def timed_run(self: asyncio.events.Handle) -> None:
        started, gc_before = time.thread_time(), state["gc_in_callback"]
        try:
            run(self)
        finally:
            spent = time.thread_time() - started
            state["in_callback"] += spent
            ledger[book_of(self)] += spent - (state["gc_in_callback"] - gc_before)

    if keep_ledger:
        asyncio.events.Handle._run = timed_run  # the loop's one way into a callback
        inside = book_inside_kopfs_worker()
    else:
        inside = collections.Counter()
    gc.callbacks.append(on_collection)
    mark = {"process": time.process_time(), "main": time.thread_time(), "in_callback": 0.0,
            "gc_in_callback": 0.0, "ledger": collections.Counter(), "runs": [0, 0, 0],
            "inside": collections.Counter()}

    def report(*_: object) -> None:
        process, main = time.process_time(), time.thread_time()
        spent = ledger - mark["ledger"]
        outside = (main - mark["main"]) - (state["in_callback"] - mark["in_callback"])
        # a collection outside any callback is already in the collector's line
        outside -= (ledger[COLLECTOR] - mark["ledger"][COLLECTOR]) - (
            state["gc_in_callback"] - mark["gc_in_callback"])
        if keep_ledger:
            spent[LOOP] = max(outside, 0.0)
        spent[THREADS] = max((process - mark["process"]) - (main - mark["main"]), 0.0)
        print(json.dumps({
            "cpu": process - mark["process"], "ledger": dict(spent),
            "inside_kopf_worker": dict(inside - mark["inside"]),
            "collections": [now - then for now, then in
                            zip(collections_run, mark["runs"], strict=True)],
            "threshold": gc.get_threshold()[0], "frozen": gc.get_freeze_count()}), flush=True)
        mark.update(process=process, main=main, in_callback=state["in_callback"],
                    gc_in_callback=state["gc_in_callback"], ledger=collections.Counter(ledger),
                    runs=list(collections_run), inside=collections.Counter(inside))

    signal.signal(signal.SIGUSR1, report)
    from accelerate_operator import heap
    from accelerate_operator.__main__ import main
    if stock:
        heap.settle_garbage_collector = lambda: None
    if loop == "uvloop":  # as `kopf run` does where uvloop is installed (kopf.run does not)
        import kopf
        import uvloop
        kopf.run = functools.partial(kopf.run, loop=uvloop.new_event_loop())
    return main(["--log-level", "WARNING"])


# What each comparison sets, per variant: the collector stock or settled (heap.py), the event
# loop, and whether the ledger books every callback (it cannot see into uvloop's).
COMPARISONS = {
    "collector": {"stock": {"stock": True, "loop": "asyncio", "ledger": True},
                  "settled": {"stock": False, "loop": "asyncio", "ledger": True}},
    "loop": {"asyncio": {"stock": False, "loop": "asyncio", "ledger": False},
             "uvloop": {"stock": False, "loop": "uvloop", "ledger": False}},
}


def one_round(cluster, jobs: int, variant: dict) -> dict[str, dict]:
    from throughput import create_pending_jobs

    env = {**os.environ, "PYTHONMALLOC": "malloc", "MALLOC_ARENA_MAX": "2"}  # as in the image
    proc = subprocess.Popen([sys.executable, __file__, "--child", "--loop", variant["loop"]]
                            + (["--stock"] if variant["stock"] else [])
                            + ([] if variant["ledger"] else ["--no-ledger"]),
                            stdout=subprocess.PIPE, text=True, env=env)

    def phase() -> dict:
        proc.send_signal(signal.SIGUSR1)
        return json.loads(proc.stdout.readline())
    try:
        time.sleep(20)  # start-up and the initial listing
        phase()  # start-up's figures: not the burst's
        namespace = create_pending_jobs(cluster, "cpu-ledger", jobs)
        time.sleep(3)  # the scheduler's Unschedulable conditions, the status writes
        creation = phase()
        cluster.delete_namespace(namespace)
        time.sleep(5)  # the deletion's last events
        return {"creation": creation, "deletion": phase()}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def print_round(variant: str, phases: dict[str, dict], jobs: int) -> None:
    for name, got in phases.items():
        gc_share = got["ledger"].get(COLLECTOR, 0.0) / got["cpu"]
        print(f"  {variant} {name}: CPU {got['cpu'] / jobs * 1e3:.2f} ms per job, "
              f"collector {gc_share:.0%}; collections young/middle/full {got['collections']}")
        top = sorted(got["ledger"].items(), key=lambda item: -item[1])
        for book, seconds in top[:8]:
            print(f"      {seconds / jobs * 1e3:6.2f} ms  {book}")
        if len(top) > 8:
            rest = sum(seconds for _, seconds in top[8:])
            print(f"      {rest / jobs * 1e3:6.2f} ms  the rest ({len(top) - 8} more)")
        for book, seconds in sorted(got["inside_kopf_worker"].items()):
            print(f"        {seconds / jobs * 1e3:6.2f} ms  inside kopf's workers: {book}",
                  flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="collector",
                        help="collector: stock against settled, with the ledger; loop: asyncio "
                             "against uvloop, the process's CPU only")
    parser.add_argument("--json", help="append the result as a JSON line to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stock", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loop", default="asyncio", help=argparse.SUPPRESS)
    parser.add_argument("--no-ledger", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.stock, args.loop, keep_ledger=not args.no_ledger)
    if args.compare == "loop" and importlib.util.find_spec("uvloop") is None:
        # Not a project dependency: the operator does not use it (docs/benchmarks.md, "uvloop").
        sys.exit(f"--compare loop needs uvloop: {sys.executable} -m pip install uvloop")

    from common import Cluster, emit_result, machine_line  # not in the child: its client

    cluster = Cluster()
    namespace, name = DEPLOYMENT
    replicas = cluster.kubectl("-n", namespace, "get", "deployment", name,
                               "-o", "jsonpath={.spec.replicas}").stdout.strip() or "1"
    variants = COMPARISONS[args.compare]
    print(f"cpu_ledger: {args.jobs} jobs created and deleted per round, {args.compare}: "
          f"{' against '.join(variants)}; {machine_line()}")
    cluster.kubectl("-n", namespace, "scale", "deployment", name, "--replicas=0")
    results: dict[str, list[dict]] = {variant: [] for variant in variants}
    try:
        time.sleep(10)  # the chart's replicas stop
        for _ in range(args.rounds):
            for variant, setup in variants.items():
                phases = one_round(cluster, args.jobs, setup)
                results[variant].append(phases)
                print_round(variant, phases, args.jobs)
    finally:
        cluster.kubectl("-n", namespace, "scale", "deployment", name, f"--replicas={replicas}")

    def median(variant: str, phase: str, key: str) -> float:
        return statistics.median(
            r[phase]["cpu"] if key == "cpu" else r[phase]["ledger"].get(COLLECTOR, 0.0)
            for r in results[variant])
    summary = {variant: {phase: {key: round(median(variant, phase, key), 3)
                                 for key in ("cpu", "gc")} for phase in ("creation", "deletion")}
               for variant in results}
    before, after = variants
    for phase in ("creation", "deletion"):
        was, now = summary[before][phase], summary[after][phase]
        print(f"  median, {phase}: CPU {was['cpu'] / args.jobs * 1e3:.2f} -> "
              f"{now['cpu'] / args.jobs * 1e3:.2f} ms per job "
              f"({now['cpu'] / was['cpu']:.2f}x), collector "
              f"{was['gc'] / args.jobs * 1e3:.2f} -> {now['gc'] / args.jobs * 1e3:.2f} ms "
              f"per job ({now['gc'] / max(was['gc'], 1e-9):.2f}x)")
    emit_result("cpu_ledger", {"jobs": args.jobs, "compare": args.compare, **summary}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
