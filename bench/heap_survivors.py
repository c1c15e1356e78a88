"""What keeps a burst's heap pages resident (docs/benchmarks.md, finding 17).

Runs the operator in-process on this host (as `accelerate-operator`, against $KUBECONFIG).
`kill -USR1 <pid>` the first time records where glibc's heap ends while idle. Each later
USR1 trims the heap as the operator does, then writes a report (--out). The report lists the
live Python objects above that address, by type and by what refers to them: these were
allocated during the burst and are still alive. It also gives the pages they sit on, the
resident pages above and below that address (/proc/self/pagemap), what holds each resident page
above it (a walk of glibc's heap: a Python object, another allocation, nothing), the dicts and
sets whose tables outgrew their contents, and the failed isinstance checks the abc caches
recorded during the burst. Run it with the image's allocator settings, and with the chart's
operator scaled to zero so that only this one acts:

    kubectl -n accelerate-system scale deployment accelerate-operator --replicas=0
    PYTHONMALLOC=malloc MALLOC_ARENA_MAX=2 $PY bench/heap_survivors.py &
    sleep 20; kill -USR1 $!           # idle: the baseline
    $PY bench/heap_survivors.py --burst 500   # another process: create, wait, delete
    sleep 90; kill -USR1 $!           # after the minute of trims: the report

(bench/throughput.py cannot make the burst: it waits for the chart's operator.)
"""

from __future__ import annotations

import abc
import argparse
import array
import bisect
import collections
import ctypes
import gc
import signal
import struct
import sys
import time
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


def outgrown(objects: Any, at_least: int = 4096) -> list[tuple[int, int, Any]]:
    """(bytes over a compact copy, bytes in all, container) of the dicts and sets whose
    table is at least `at_least` bytes bigger than a copy of the same entries would need,
    biggest first. Their tables are malloc'd apart from the object, so the report's objects
    above the idle end do not show them."""
    found = []
    for o in objects:
        if isinstance(o, (dict, set)):
            try:
                size = sys.getsizeof(o)
                waste = size - sys.getsizeof((dict if isinstance(o, dict) else set)(o))
            except Exception:  # a mapping whose copy fails (a proxy mid-change): not counted
                continue
            if waste >= at_least:
                found.append((waste, size, o))
    return sorted(found, key=lambda item: -item[0])


def describe_referrers(o: Any, skip: set[int]) -> str:
    """Who holds `o`: `Type.attribute` where an object's attribute does, else the holder's
    type. (Python 3.11 keeps most instances' attributes inline, so the holder gc reports is
    the instance itself, not its `__dict__`.)"""
    names = []
    for holder in gc.get_referrers(o):
        if id(holder) in skip or type(holder).__name__ == "frame":
            continue
        attributes = getattr(holder, "__dict__", None)
        attribute = None
        if isinstance(attributes, dict):
            attribute = next((name for name, value in attributes.items() if value is o), None)
        names.append(f"{type(holder).__name__}.{attribute}" if attribute
                     else type(holder).__name__)
    return ", ".join(names[:3]) or "?"


def negative_cache_entries(above: dict[int, Any]) -> collections.Counter[str]:
    """The abc classes whose negative cache (a set of weak references to the classes found not
    to be subclasses) holds references created during the burst: `abc.ABC` caches each
    failed `isinstance` check. Read through `_abc._get_dump`, the stdlib's test hook."""
    import _abc
    counts: collections.Counter[str] = collections.Counter()
    for cls in [o for o in gc.get_objects() if isinstance(o, abc.ABCMeta)]:
        for ref in _abc._get_dump(cls)[2]:
            if id(ref) in above:
                checked = ref()
                counts[f"{cls.__module__}.{cls.__qualname__} "
                       f"<- {getattr(checked, '__qualname__', '?')}"] += 1
    return counts


def walk_chunks(start: int, end: int, idle_end: int) -> tuple[array.array, array.array, int]:
    """Walk glibc's main heap chunk by chunk (each header's size; a chunk is in use when the
    next one's PREV_INUSE bit is set). Returns the start and size of each in-use chunk that
    reaches above `idle_end`, in two arrays, and the count of free chunks there. Run before
    the report makes anything per object: its own allocations would fill the free gaps it
    counts. Tcache and fastbin chunks count as in use, as glibc's own walk would."""
    word = ctypes.c_uint64
    starts, sizes = array.array("Q"), array.array("Q")
    free_chunks = 0
    chunk = start
    while chunk + 16 <= end:
        size = word.from_address(chunk + 8).value & ~7
        following = chunk + size
        if size < 32 or following > end:
            break
        if following > idle_end:
            if following + 16 > end or word.from_address(following + 8).value & 1:
                starts.append(chunk)
                sizes.append(size)
            else:
                free_chunks += 1
        chunk = following
    return starts, sizes, free_chunks


def resident_page_numbers(start: int, end: int) -> array.array:
    """The numbers of the pages of [start, end) that are in memory."""
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(start // PAGE * 8)
        entries = pagemap.read((end - start) // PAGE * 8)
    return array.array("Q", (start // PAGE + n for n, (entry,) in
                             enumerate(struct.iter_unpack("Q", entries)) if entry >> 63))


def chunk_census(starts: array.array, sizes: array.array, free_chunks: int,
                 resident: array.array, idle_end: int, objects: dict[int, Any]) -> list[str]:
    """The resident pages above `idle_end`, by what is on them: in-use chunks that hold a
    Python object (the chunk starts 16 bytes before the object, or 32 before a gc-tracked
    one), in-use chunks that hold something else only (a dict's or list's table, a buffer, a C
    library's allocation), or no in-use chunk (free memory the trim could not return)."""
    holds_object = [False] * len(starts)
    for address in objects:
        for chunk in (address - 16, address - 32):
            n = bisect.bisect_left(starts, chunk)
            if n < len(starts) and starts[n] == chunk:
                holds_object[n] = True
    pages_with: dict[bool, set[int]] = {True: set(), False: set()}
    by_size: dict[bool, collections.Counter[int]] = {True: collections.Counter(),
                                                     False: collections.Counter()}
    for chunk, size, is_object in zip(starts, sizes, holds_object, strict=True):
        pages_with[is_object].update(range(max(chunk, idle_end) // PAGE,
                                           (chunk + size - 1) // PAGE + 1))
        by_size[is_object][min(1 << (size - 1).bit_length(), 1 << 20)] += 1
    resident_set = set(resident)
    used = pages_with[True] | pages_with[False]
    return [f"resident pages {len(resident_set)}: with a Python object's chunk "
            f"{len(resident_set & pages_with[True])}, with other in-use chunks only "
            f"{len(resident_set & (pages_with[False] - pages_with[True]))}, with no in-use "
            f"chunk {len(resident_set - used)}; free chunks {free_chunks}",
            *(f"{name} chunks: {sum(by_size[kind].values())}, "
              f"{sum(n * s for s, n in by_size[kind].items()) // 1024} KiB at most; by size "
              f"(rounded up to a power of two): {sorted(by_size[kind].items())}"
              for kind, name in ((True, "object"), (False, "other")))]


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
        starts, sizes, free_chunks = walk_chunks(start, end, self.idle_end)
        resident_above = resident_page_numbers(self.idle_end, end)
        resident_below = len(resident_page_numbers(start, self.idle_end))
        # The operator froze start-up's objects (heap.settle_garbage_collector): gc's lists of
        # objects and referrers leave them out until they are unfrozen.
        gc.unfreeze()
        objects = live_objects()
        above = {i: o for i, o in objects.items() if self.idle_end <= i < end}
        skip = {id(objects), id(above)}
        types = collections.Counter(type(o).__name__ for o in above.values())
        lines = [f"heap {start:#x}-{end:#x}; idle end {self.idle_end:#x}",
                 f"resident pages: {resident_below} below the idle end, "
                 f"{len(resident_above)} above",
                 f"live Python objects above the idle end: {len(above)}, on "
                 f"{len({i // PAGE for i in above})} pages", "",
                 "by type, and what refers to them:"]
        for name, count in types.most_common(15):
            referrers = collections.Counter(
                type(r).__name__ for o in above.values() if type(o).__name__ == name
                for r in gc.get_referrers(o) if id(r) not in skip
                and type(r).__name__ != "frame")
            lines.append(f"  {count:6d} {name:28s} <- {referrers.most_common(4)}")
        lines += ["", "containers whose table outgrew their contents (a dict or set never shrinks "
                  "its table when entries are removed), bytes over a compact copy's:"]
        oversized = outgrown(objects.values())
        skip |= {id(oversized), *map(id, oversized)}
        lines.append(f"  {sum(waste for waste, *_ in oversized)} bytes in {len(oversized)}")
        for waste, size, container in oversized[:15]:
            lines.append(f"  {waste:9d} over ({size} in all, {len(container)} entries) "
                         f"{type(container).__name__} <- {describe_referrers(container, skip)}")
        lines += ["", "glibc's chunks above the idle end (a walk of the [heap]):"]
        lines += [f"  {line}" for line in chunk_census(starts, sizes, free_chunks,
                                                       resident_above, self.idle_end, objects)]
        first_checks = negative_cache_entries(above)
        lines += ["", f"isinstance checks that failed for the first time during the burst "
                  f"(entries of abc classes' negative caches above the idle end): "
                  f"{sum(first_checks.values())}"]
        lines += [f"  {count:6d} {abc_name}" for abc_name, count in first_checks.most_common(12)]
        lines.append(f"\nwhat the operator holds: {held()}")
        self.out.write_text("\n".join(lines) + "\n")
        print(f"heap_survivors: report written to {self.out}", flush=True)


def burst(jobs: int) -> None:
    """Run from a second process (the operator's must not load the official client): `jobs`
    Pending two-node jobs in a new namespace, until every pod exists, then the namespace
    deleted, as bench/throughput.py's bursts are."""
    from common import Cluster  # bench/ is this script's path
    from throughput import create_pending_jobs

    cluster = Cluster()
    started = time.monotonic()
    namespace = create_pending_jobs(cluster, "heap-survivors", jobs)
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
