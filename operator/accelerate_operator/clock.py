"""The operator-wide clock: the passes and reads that time alone makes due.

One task ticks every CLOCK_SECONDS for all jobs (no timer per job, and nothing written to a
job to keep one):
- a job's next pass is due when its plan said time would change it (`requeue_after`: an active
  deadline, a TTL after finishing), and at the latest RESYNC_SECONDS after its last pass (a pass
  that an event ran is not retried: this repeats one that failed on a passing API error);
- a Running job's progress is read from rank 0's log every PROGRESS_SECONDS;
- every TRIM_SECONDS, if fewer jobs are followed than at the last look, the memory of those gone
  is handed back to the system (heap.py).

The schedule is a cache: a restart loses it, the start-up listing reconciles every job again,
and each pass schedules its job again. A finished job without a TTL leaves the schedule."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .api import SpecError, parse_job
from .constants import FINISHED_PHASES, RUNNING
from .heap import release_freed_memory

log = logging.getLogger("accelerate_operator")

CLOCK_SECONDS = 2.0
RESYNC_SECONDS = 30.0
PROGRESS_SECONDS = 5.0
TRIM_SECONDS = 10.0

Body = Mapping[str, Any]


@dataclass
class _Due:
    body: Body
    next_pass: float
    next_progress: float = 0.0

    @property
    def running(self) -> bool:
        return (self.body.get("status") or {}).get("phase") == RUNNING


def _has_ttl(body: Body) -> bool:
    try:
        return parse_job(body).run_policy.ttl_seconds_after_finished is not None
    except SpecError:
        return False


class Clock:
    def __init__(self, reconcile: Callable[[Body], Awaitable[float | None]],
                 refresh_progress: Callable[[Body], Awaitable[None]],
                 now: Callable[[], float] = time.monotonic):
        self._reconcile, self._refresh_progress, self._now = reconcile, refresh_progress, now
        self._jobs: dict[str, _Due] = {}
        self._jobs_at_last_look = 0

    def track(self, body: Body) -> None:
        """A job event: follow the job while time can still change it (unfinished, or finished
        with a TTL to expire), with its latest body."""
        uid = body["metadata"]["uid"]
        finished = (body.get("status") or {}).get("phase") in FINISHED_PHASES
        if finished and not _has_ttl(body):
            self._jobs.pop(uid, None)
        elif uid in self._jobs:
            self._jobs[uid].body = body
        else:
            self._jobs[uid] = _Due(body, next_pass=self._now() + RESYNC_SECONDS)

    def schedule(self, uid: str, requeue_after: float | None) -> None:
        """After a pass of the job: its next one is due after `requeue_after` seconds (when its
        plan said time would change it), else after RESYNC_SECONDS."""
        due = self._jobs.get(uid)
        if due is not None:
            wait = RESYNC_SECONDS if requeue_after is None else min(requeue_after, RESYNC_SECONDS)
            due.next_pass = self._now() + wait

    def forget(self, uid: str) -> None:
        self._jobs.pop(uid, None)

    def due(self) -> tuple[list[Body], list[Body]]:
        """The jobs whose pass is due, and those whose progress is, as of now; each is
        rescheduled as if its pass (or read) succeeded, so a failing one is retried later."""
        now = self._now()
        passes, reads = [], []
        for due in self._jobs.values():
            if now >= due.next_pass:
                due.next_pass = now + RESYNC_SECONDS
                passes.append(due.body)
            if due.running and now >= due.next_progress:
                due.next_progress = now + PROGRESS_SECONDS
                reads.append(due.body)
        return passes, reads

    async def tick(self) -> None:
        passes, reads = self.due()
        results = await asyncio.gather(*(self.run_pass(body) for body in passes),
                                       *(self._refresh_progress(body) for body in reads),
                                       return_exceptions=True)
        for error in results:
            if isinstance(error, Exception):
                log.warning("clock pass failed: %s", error)

    async def run_pass(self, body: Body) -> None:
        """Reconcile the job now (an event, or due), then schedule its next pass."""
        self.schedule(body["metadata"]["uid"], await self._reconcile(body))

    def jobs_went_away(self) -> bool:
        """Whether fewer jobs are followed than at the last call (finished or deleted)."""
        went_away = len(self._jobs) < self._jobs_at_last_look
        self._jobs_at_last_look = len(self._jobs)
        return went_away

    async def run(self, period: float = CLOCK_SECONDS) -> None:
        ticks_per_trim = max(1, round(TRIM_SECONDS / period))
        ticks = 0
        while True:
            await asyncio.sleep(period)
            try:
                await self.tick()
            except Exception:  # the clock must outlive any one bad tick
                log.exception("clock tick failed")
            ticks += 1
            if ticks % ticks_per_trim == 0 and self.jobs_went_away():
                release_freed_memory()
