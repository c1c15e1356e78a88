"""What keeps a burst's heap pages resident (docs/benchmarks.md, finding 17).

Runs the operator in-process on this host (as `accelerate-operator`, against $KUBECONFIG).
`kill -USR1 <pid>` the first time records where glibc's heap ends while idle. Each later
USR1 trims the heap as the operator does, then writes a report (--out). The report lists the
live Python objects above that address, by type and by what refers to them: these were
allocated during the burst and are still alive. It also gives the pages they sit on, and the
resident pages above and below that address (/proc/self/pagemap). Run it with the image's
allocator settings, and with the chart's operator scaled to zero so that only this one acts:

    kubectl -n accelerate-system scale deployment accelerate-operator --replicas=0
    PYTHONMALLOC=malloc MALLOC_ARENA_MAX=2 $PY bench/heap_survivors.py &
    sleep 20; kill -USR1 $!           # idle: the baseline
    $PY bench/heap_survivors.py --burst 500   # another process: create, wait, delete
    sleep 90; kill -USR1 $!           # after the minute of trims: the report

(bench/throughput.py cannot make the burst: it waits for the chart's operator.)
"""

from __future__ import annotations

import argparse
import collections
import gc
import signal
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from accelerate_operator.heap import release_freed_memory

PAGE = 4096


def heap_range() -> tuple[int, int]:
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = line.split()[0].split("-")
            return int(start, 16), int(end, 16)
    raise RuntimeError("no [heap] mapping")


def resident_pages(start: int, end: int) -> int:
    """Pages of [start, end) in memory: bit 63 of each /proc/self/pagemap entry."""
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(start // PAGE * 8)
        entries = pagemap.read((end - start) // PAGE * 8)
    return sum(entry >> 63 for (entry,) in struct.iter_unpack("Q", entries))


def live_objects() -> dict[int, Any]:
    """Every object gc tracks, and those they refer to directly (strings, numbers: untracked)."""
    tracked = gc.get_objects()
    found = {id(o): o for o in tracked}
    for o in tracked:
        for referent in gc.get_referents(o):
            found.setdefault(id(referent), referent)
    return found


def held() -> dict[str, int]:
    """The job states, queued passes and indexed objects of the operator in this process."""
    from accelerate_operator.handlers import RUNTIME

    controller = RUNTIME.controller
    if controller is None:
        return {}
    return {"job states": len(controller.states), "queued": len(controller.queue),
            **{name: sum(len(index.get(key) or ()) for key in list(index))
               for name, index in controller.indexes.items()}}


class Report:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.idle_end: int | None = None

    def __call__(self, *_: object) -> None:
        release_freed_memory()
        start, end = heap_range()
        if self.idle_end is None:
            self.idle_end = end
            print(f"heap_survivors: idle heap ends at {end:#x}", flush=True)
            return
        objects = live_objects()
        above = {i: o for i, o in objects.items() if self.idle_end <= i < end}
        skip = {id(objects), id(above)}
        types = collections.Counter(type(o).__name__ for o in above.values())
        lines = [f"heap {start:#x}-{end:#x}; idle end {self.idle_end:#x}",
                 f"resident pages: {resident_pages(start, self.idle_end)} below the idle end, "
                 f"{resident_pages(self.idle_end, end)} above",
                 f"live Python objects above the idle end: {len(above)}, on "
                 f"{len({i // PAGE for i in above})} pages", "",
                 "by type, and what refers to them:"]
        for name, count in types.most_common(15):
            referrers = collections.Counter(
                type(r).__name__ for o in above.values() if type(o).__name__ == name
                for r in gc.get_referrers(o) if id(r) not in skip
                and type(r).__name__ != "frame")
            lines.append(f"  {count:6d} {name:28s} <- {referrers.most_common(4)}")
        lines.append(f"\nwhat the operator holds: {held()}")
        self.out.write_text("\n".join(lines) + "\n")
        print(f"heap_survivors: report written to {self.out}", flush=True)


def burst(jobs: int) -> None:
    """Run from a second process (the operator's must not load the official client): `jobs`
    Pending two-node jobs in a new namespace, until every pod exists, then the namespace
    deleted, as bench/throughput.py's bursts are."""
    from accelerate_trainer.contract import JOB_NAME_LABEL
    from common import Cluster, wait_until  # bench/ is this script's path
    from throughput import job_body

    cluster = Cluster()
    namespace = cluster.create_namespace("heap-survivors")
    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: cluster.create_job(
            job_body(namespace, f"job-{i:04d}", "pending")), range(jobs)))
    wait_until(lambda: len(cluster.core.list_namespaced_pod(
        namespace, label_selector=JOB_NAME_LABEL).items) >= 2 * jobs, 600, "every job's pods")
    print(f"heap_survivors: {jobs} jobs and their pods in {time.monotonic() - started:.1f} s; "
          f"namespace deleted in {cluster.delete_namespace(namespace):.1f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/heap-survivors.txt"))
    parser.add_argument("--burst", type=int, default=None, metavar="JOBS",
                        help="make the burst instead (run while the operator above runs)")
    args = parser.parse_args()
    if args.burst:
        burst(args.burst)
        return 0
    signal.signal(signal.SIGUSR1, Report(args.out))
    from accelerate_operator.__main__ import main as operator_main
    return operator_main([])


if __name__ == "__main__":
    sys.exit(main())
