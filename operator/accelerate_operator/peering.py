"""Whether this replica is the active one, for the passes kopf does not run.

kopf's peering (docs/peering.rst) pauses its watches on every replica but the live one of highest
priority. The passes our work queue runs on time (requeue after, the grace check) are not kopf's,
and kopf says whether it has paused only in its log: its toggles are not public. So this reads
the same peering object(s) kopf keeps and applies kopf's documented rule to their records
(`status`: identity -> priority, lastseen, lifetime): paused while another live replica has a
higher priority, or the same one. The queue follows it within POLL_SECONDS."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from .timefmt import parse_time

log = logging.getLogger("accelerate_operator")

POLL_SECONDS = 2.0
# kopf's default lifetime of a record that states none (settings.peering.lifetime).
DEFAULT_LIFETIME_SECONDS = 60


def _lastseen(record: Mapping[str, Any], now: datetime) -> datetime:
    """When the replica last wrote its record; as kopf reads it, a record without one (or
    one it cannot read) is fresh."""
    seen = parse_time(record.get("lastseen"))
    return now if seen is None else seen.replace(tzinfo=timezone.utc)


def is_paused(records: Mapping[str, Mapping[str, Any]], identity: str, priority: int,
              now: datetime) -> bool:
    """kopf's rule over one peering object's records (pure)."""
    for peer, record in records.items():
        lifetime = timedelta(seconds=int(record.get("lifetime") or DEFAULT_LIFETIME_SECONDS))
        if peer == identity or _lastseen(record, now) + lifetime <= now:
            continue  # ourselves, or a dead replica
        if int(record.get("priority", 0)) >= priority:
            return True
    return False


class PeeringFollower:
    """Polls the peering object(s) and sets `on_change(paused)` when the answer changes."""

    def __init__(self, read: Callable[[], Any], identity: str, priority: int,
                 on_change: Callable[[bool], None]) -> None:
        self.read, self.identity, self.priority = read, identity, priority
        self.on_change = on_change
        self.paused: bool | None = None

    def decide(self, statuses: Iterable[Mapping[str, Any]], now: datetime) -> None:
        paused = any(is_paused(status, self.identity, self.priority, now)
                     for status in statuses)
        if paused != self.paused:
            log.info("%s passes: %s", "pausing" if paused else "running",
                     "another replica is active" if paused else "this replica is active")
            self.paused = paused
            self.on_change(paused)

    async def run(self) -> None:
        while True:
            try:
                self.decide(await self.read(), datetime.now(timezone.utc))
            except Exception as error:  # noqa: BLE001 - the next look tries again
                log.warning("reading kopf's peering failed: %r", error)
            await asyncio.sleep(POLL_SECONDS)
