"""Give the memory of deleted jobs back to the system, and keep the garbage collector's work in
proportion.

After a burst of jobs is deleted, the objects that described them are freed, but glibc keeps
the freed pages of its heap for reuse and CPython's allocator keeps partly used arenas: the
operator's RSS stayed at its peak for good, a few MiB higher after every burst
(docs/benchmarks.md, finding 6). `malloc_trim(0)` returns every free page of glibc's heaps; the
operator image sets PYTHONMALLOC=malloc so that Python's small objects live there too, not in
pymalloc arenas that are freed only when wholly empty (finding 8)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)  # glibc only (not musl)


_MALLOC_TRIM = _find_malloc_trim()


# CPython's cycle collector visits every tracked container of the generations it collects. A
# burst allocates containers fast (each watch event's body decodes to a tree of dicts and lists),
# so at the default young threshold (700) it ran about 1,100 young, 100 middle and 10 full
# collections per 500 jobs created and deleted, and each full one walked again the ~70,000
# objects start-up leaves (modules, classes, functions, kopf's registry: never garbage): 14-24 %
# of the operator's CPU. bench/cpu_ledger.py measures it.
GC_YOUNG_THRESHOLD = 10_000
_gc_settled = False


def settle_garbage_collector() -> None:
    """Once per process, after start-up: what exists then lives as long as the process, so the
    collector stops visiting it (`gc.freeze`), and it collects young objects every 10,000
    allocations instead of 700. Objects stay freed by their reference counts as before; only
    cycles wait a little longer."""
    global _gc_settled
    if _gc_settled:
        return
    _gc_settled = True
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def release_freed_memory() -> None:
    """Collect cycles, then hand free heap pages back. Tens of milliseconds: call it after
    many objects went away, not per event."""
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _find_mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc before 2.33
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _find_mallinfo2()


def heap_usage() -> tuple[int, int] | None:
    """(bytes in use, bytes free) in glibc's heaps, or None where glibc cannot say. In use is
    what live allocations hold (Python's objects too, under PYTHONMALLOC=malloc); free is what
    the heap keeps between them, which malloc_trim hands back only in whole pages."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd, info.fordblks
