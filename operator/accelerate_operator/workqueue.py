"""The work queue between kopf's events and the reconcile passes: controller-runtime's workqueue
semantics, which kopf does not offer for a key made of several objects (a job and its pods).

- `add(key)`: the key's pass runs soon. A key already waiting is not queued twice, and a key
  added while its pass runs is run once more after it (so a burst of events of one job, its pods
  created, scheduled, started, costs one or two passes, and a pass always starts from the newest
  state). One pass per key at a time; at most `workers` passes at once.
- `add_after(key, seconds)`: "requeue after", for what time alone changes (a deadline, a TTL,
  a progress write held back); only the earliest request per key is kept.
- A pass that raises is retried with a per-key backoff (1 s doubling to 60 s), reset by the next
  pass that succeeds; `num_requeues(key)` is that count of failures in a row.
- `forget(key)`: the job is gone; nothing about it stays queued.
- `paused`: while another replica is active (peering.py), and while the caches sync after this
  one became active (cache_sync.py), no pass runs: queued keys wait, and the resumed controller
  adds every job again anyway.

Time-driven passes live here, not in kopf timers: kopf's timers and daemons put a finalizer on
every job, and a finalizer blocks deleting jobs while the operator is down."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable

log = logging.getLogger("accelerate_operator")

BACKOFF_FIRST_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 60.0

# A pass: given the key, returns when time alone will next change it (seconds), or None.
Pass = Callable[[Hashable], Awaitable[float | None]]


class WorkQueue:
    def __init__(self, run_pass: Pass, workers: int = 32,
                 clock: Callable[[], float] = time.monotonic):
        self._run_pass, self._workers, self._clock = run_pass, workers, clock
        self._ready: asyncio.Queue[Hashable] = asyncio.Queue()
        self._queued: set[Hashable] = set()      # in _ready, not yet taken by a worker
        self._running: set[Hashable] = set()     # a worker runs its pass now
        self._dirty: set[Hashable] = set()       # added while running: run once more
        self._timers: dict[Hashable, tuple[float, asyncio.TimerHandle]] = {}
        self._failures: dict[Hashable, int] = {}
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._tasks: list[asyncio.Task] = []
        self.passes = 0

    # ---- what handlers call ----------------------------------------------------------------
    def add(self, key: Hashable) -> None:
        if key in self._running:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._ready.put_nowait(key)

    def add_after(self, key: Hashable, seconds: float) -> None:
        if seconds <= 0:
            self.add(key)
            return
        due = self._clock() + seconds
        current = self._timers.get(key)
        if current is not None:
            if current[0] <= due:
                return
            current[1].cancel()
        handle = asyncio.get_running_loop().call_later(seconds, self._fire, key)
        self._timers[key] = (due, handle)

    def num_requeues(self, key: Hashable) -> int:
        """The key's passes failed in a row (controller-runtime's NumRequeues): the one count
        of failures, read by the controller for its ReconcileFailing Warning."""
        return self._failures.get(key, 0)

    def forget(self, key: Hashable) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer[1].cancel()
        self._dirty.discard(key)
        self._failures.pop(key, None)
        # A key in _ready stays there; its pass finds the job gone and does nothing.

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    @paused.setter
    def paused(self, value: bool) -> None:
        (self._resumed.clear if value else self._resumed.set)()

    def __len__(self) -> int:
        return len(self._queued) + len(self._running) + len(self._timers)

    # ---- the workers -------------------------------------------------------------------------
    def _fire(self, key: Hashable) -> None:
        self._timers.pop(key, None)
        self.add(key)

    async def _worker(self) -> None:
        while True:
            key = await self._ready.get()
            await self._resumed.wait()
            self._queued.discard(key)
            self._running.add(key)
            try:
                requeue_after = await self._run_pass(key)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                failures = self._failures.get(key, 0) + 1
                self._failures[key] = failures
                delay = min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2 ** (failures - 1))
                log.warning("pass of %s failed (%d in a row), retrying in %.0f s: %r", key,
                            failures, delay, error, exc_info=failures == 1)
                self.add_after(key, delay)
            else:
                self._failures.pop(key, None)
                if requeue_after is not None:
                    self.add_after(key, requeue_after)
            finally:
                self.passes += 1
                self._running.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.add(key)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(), name=f"pass worker {i}")
                       for i in range(self._workers)]

    async def stop(self) -> None:
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
