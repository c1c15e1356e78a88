"""Whether this replica is the active one, for the passes kopf does not run.

kopf's peering (docs/peering.rst) pauses its watches on every replica but the live one of highest
priority. The passes our work queue runs on time (requeue after, the grace check) are not kopf's,
and kopf says whether it has paused only in its log: its toggles are not public. So this reads
the same peering object(s) kopf keeps and applies kopf's documented rule to their records
(`status`: identity -> priority, lastseen, lifetime): paused while another live replica has a
higher priority, or the same one.

No split-brain: a replica acts only while it can confirm that it is the active one. An answer
read from the peering object stands for GRACE_SECONDS (a replica of higher priority may start
meanwhile), and never past the end of this replica's own record less MARGIN_SECONDS (after that
end the others count it dead and one of them takes over). A replica that cannot read the object,
or whose own record is not renewed (kopf cannot write it), pauses when that time is up, on a
timer of its own, and resumes after the next read that confirms it again."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from .timefmt import parse_time

log = logging.getLogger("accelerate_operator")

POLL_SECONDS = 1.0
READ_TIMEOUT_SECONDS = 5.0
# How long one read's answer stands.
GRACE_SECONDS = 10.0
# Stop this long before the peers may count this replica dead: a pass in flight ends first. kopf
# renews its record 5 to 10 s before its end, so a replica whose writes work never stops.
MARGIN_SECONDS = 2.0
# kopf's default lifetime of a record that states none (settings.peering.lifetime).
DEFAULT_LIFETIME_SECONDS = 60


def parse_lastseen(record: Mapping[str, Any]) -> datetime | None:
    """When the replica last wrote its record (aware, UTC), or None when it says nothing
    readable; a time without a zone is UTC, as kopf reads it."""
    seen = parse_time(record.get("lastseen"))
    return None if seen is None else seen.replace(tzinfo=timezone.utc)


def record_end(record: Mapping[str, Any], now: datetime) -> datetime:
    """When the peers count the record's replica dead; as kopf reads it, a record without a
    readable lastseen is fresh."""
    lifetime = timedelta(seconds=int(record.get("lifetime") or DEFAULT_LIFETIME_SECONDS))
    return (parse_lastseen(record) or now) + lifetime


def is_paused(records: Mapping[str, Mapping[str, Any]], identity: str, priority: int,
              now: datetime) -> bool:
    """kopf's rule over one peering object's records (pure)."""
    for peer, record in records.items():
        if peer == identity or record_end(record, now) <= now:
            continue  # ourselves, or a dead replica
        if int(record.get("priority", 0)) >= priority:
            return True
    return False


def active_for(statuses: Iterable[Mapping[str, Mapping[str, Any]]], identity: str,
               priority: int, now: datetime) -> float:
    """For how many seconds from `now` this replica may act, by the peering object(s) read at
    `now` (pure): 0 when kopf's rule pauses it, or when its own record is missing (the others do
    not know it) or ends within MARGIN_SECONDS; otherwise at most GRACE_SECONDS."""
    seconds = GRACE_SECONDS
    for records in statuses:
        own = records.get(identity)
        if own is None or parse_lastseen(own) is None or is_paused(records, identity, priority,
                                                                   now):
            return 0.0
        left = (record_end(own, now) - now).total_seconds() - MARGIN_SECONDS
        seconds = min(seconds, max(0.0, left))
    return seconds


class PeeringFollower:
    """Reads the peering object(s) every POLL_SECONDS and calls `on_change(paused)` when the
    answer changes; pauses by itself when the last confirmation runs out."""

    def __init__(self, read: Callable[[], Awaitable[Any]], identity: str, priority: int,
                 on_change: Callable[[bool], None],
                 now: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        self.read, self.identity, self.priority = read, identity, priority
        self.on_change, self.now = on_change, now
        self.paused: bool | None = None
        self._expiry: asyncio.TimerHandle | None = None

    def decide(self, statuses: Iterable[Mapping[str, Any]], now: datetime) -> None:
        """What a read at `now` showed: run for as long as it confirms, else pause."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        seconds = active_for(statuses, self.identity, self.priority, now)
        if seconds <= 0:
            self._set(True, "another replica is active, or this one's record is not live")
            return
        self._set(False, "this replica is active")
        elapsed = max(0.0, (self.now() - now).total_seconds())  # the read's own time
        self._expiry = asyncio.get_running_loop().call_later(seconds - elapsed, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        self._set(True, "this replica cannot confirm that it is still the active one")

    def _set(self, paused: bool, why: str) -> None:
        if paused != self.paused:
            log.info("%s passes: %s", "pausing" if paused else "running", why)
            self.paused = paused
            self.on_change(paused)

    async def _read(self) -> Any:
        """One read, given up after READ_TIMEOUT_SECONDS. Not asyncio.wait_for, which can
        swallow the follower's own cancellation when both happen at once (Python < 3.12)."""
        task = asyncio.ensure_future(self.read())
        try:
            done, _ = await asyncio.wait({task}, timeout=READ_TIMEOUT_SECONDS)
        finally:
            if not task.done():
                task.cancel()
        if not done:
            raise TimeoutError(f"no answer within {READ_TIMEOUT_SECONDS:g} s")
        return task.result()

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            read_at = self.now()  # the answer is at least this old: its grace counts from here
            try:
                statuses = await self._read()
            except Exception as error:  # noqa: BLE001 - the expiry timer pauses; next look retries
                log.warning("reading kopf's peering failed: %r", error)
            else:
                self.decide(statuses, read_at)
            await asyncio.sleep(max(0.0, POLL_SECONDS - (time.monotonic() - started)))
