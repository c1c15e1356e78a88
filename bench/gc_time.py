"""The operator's CPU in CPython's cycle collector during a burst, with the stock collector and
with the operator's settings (heap.settle_garbage_collector: `gc.freeze` after start-up, young
threshold 10,000), side by side in one run (docs/benchmarks.md, "The cycle collector").

Each round starts the operator in-process on this host (`accelerate-operator`, against
$KUBECONFIG) in a child process that times every collection (`gc.callbacks`) with the CPU
clock; 20 s after it starts, a burst of N two-node Pending jobs is created and its namespace
deleted (bench/heap_survivors.py's burst, the same as bench/throughput.py's); the child reports
the CPU and collector seconds of the burst. The variants alternate, so a machine that slows
down weighs on both. The chart's operator is scaled to zero meanwhile and back afterwards.

Usage: python bench/gc_time.py [--jobs 500] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

DEPLOYMENT = ("accelerate-system", "accelerate-operator")


def child(stock: bool) -> int:
    """The operator, timing its collections; SIGUSR1 prints what was spent since the last one."""
    import gc

    spent = {"seconds": 0.0, "collections": [0, 0, 0]}
    started: list[float] = []

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.process_time())
        elif started:
            spent["seconds"] += time.process_time() - started.pop()
            spent["collections"][info["generation"]] += 1

    gc.callbacks.append(on_collection)
    mark = {"cpu": time.process_time(), "gc": 0.0, "collections": [0, 0, 0]}

    def report(*_: object) -> None:
        cpu = time.process_time()
        print(json.dumps({
            "cpu": cpu - mark["cpu"], "gc": spent["seconds"] - mark["gc"],
            "collections": [now - then for now, then in
                            zip(spent["collections"], mark["collections"], strict=True)],
            "threshold": gc.get_threshold()[0], "frozen": gc.get_freeze_count()}), flush=True)
        mark.update(cpu=cpu, gc=spent["seconds"], collections=list(spent["collections"]))

    signal.signal(signal.SIGUSR1, report)
    from accelerate_operator import heap
    from accelerate_operator.__main__ import main
    if stock:
        heap.settle_garbage_collector = lambda: None
    return main(["--log-level", "WARNING"])


def one_round(jobs: int, stock: bool) -> dict:
    from heap_survivors import burst

    env = {**os.environ, "PYTHONMALLOC": "malloc", "MALLOC_ARENA_MAX": "2"}  # as in the image
    proc = subprocess.Popen([sys.executable, __file__, "--child"] + (["--stock"] if stock else []),
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        time.sleep(20)  # start-up and the initial listing
        proc.send_signal(signal.SIGUSR1)
        json.loads(proc.stdout.readline())  # start-up's figures: not the burst's
        burst(jobs)
        time.sleep(5)  # the deletion's last events
        proc.send_signal(signal.SIGUSR1)
        return json.loads(proc.stdout.readline())
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="append the result as a JSON line to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stock", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.stock)

    from common import Cluster, emit_result, machine_line  # not in the child: its client

    cluster = Cluster()
    namespace, name = DEPLOYMENT
    replicas = cluster.kubectl("-n", namespace, "get", "deployment", name,
                               "-o", "jsonpath={.spec.replicas}").stdout.strip() or "1"
    print(f"gc_time: {args.jobs} jobs created and deleted per round; {machine_line()}")
    cluster.kubectl("-n", namespace, "scale", "deployment", name, "--replicas=0")
    results: dict[str, list[dict]] = {"stock": [], "settled": []}
    try:
        time.sleep(10)  # the chart's replicas stop
        for _ in range(args.rounds):
            for variant in ("stock", "settled"):
                got = one_round(args.jobs, stock=variant == "stock")
                results[variant].append(got)
                print(f"  {variant:8s} CPU {got['cpu']:.2f} s, of it in the collector "
                      f"{got['gc']:.2f} s ({got['gc'] / got['cpu']:.0%}); collections "
                      f"young/middle/full {got['collections']}; threshold {got['threshold']}, "
                      f"{got['frozen']} objects frozen", flush=True)
    finally:
        cluster.kubectl("-n", namespace, "scale", "deployment", name, f"--replicas={replicas}")

    def median(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in results[variant])
    summary = {variant: {key: round(median(variant, key), 2) for key in ("cpu", "gc")}
               for variant in results}
    print(f"  median: stock {summary['stock']['gc']:.2f} s of {summary['stock']['cpu']:.2f} s, "
          f"settled {summary['settled']['gc']:.2f} s of {summary['settled']['cpu']:.2f} s; "
          f"collector time {summary['settled']['gc'] / summary['stock']['gc']:.2f}x, CPU "
          f"{summary['settled']['cpu'] / summary['stock']['cpu']:.2f}x; per job, collector "
          f"{summary['stock']['gc'] / args.jobs * 1e3:.2f} -> "
          f"{summary['settled']['gc'] / args.jobs * 1e3:.2f} ms")
    emit_result("gc_time", {"jobs": args.jobs, **summary}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
