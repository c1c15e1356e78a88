"""Waiting for the caches to sync when this replica becomes the active one: controller-runtime's
WaitForCacheSync, one of the small pieces kopf lacks, on its public API.

A replica that resumes (peering.py) holds the indexes kopf filled while it was last active, or
at its start: a pod created since is missing, a job's status is older than the other replica's
last write. kopf lists again when it resumes its watches, but says neither when that listing is
over nor whether it happens at all (its pause and our follower's read the peering object apart).
A pass run on such indexes counts a missing pod as deleted and restarts a healthy job, or takes
the current group's pods for an earlier attempt's. So after a resume no pass runs until the
indexes show every job, pod and Workload that a list of the API server shows (metadata only, in
pages), at the listed resourceVersion or a newer one. What lags is listed again every
RELIST_SECONDS (it may have changed or gone meanwhile); after TIMEOUT_SECONDS the passes run
anyway, with a warning naming what lags: a sync never keeps an operator from acting for longer
than that. What the indexes still show of objects deleted meanwhile, the index audit hides
(audit.py; the controller runs it after the sync)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping

from .audit import Index, Listed, indexed_objects

log = logging.getLogger("accelerate_operator")

CHECK_SECONDS = 0.2
RELIST_SECONDS = 2.0
TIMEOUT_SECONDS = 60.0
# kind -> the indexes that keep it (handlers.py; audit.entry_identity reads their values). Those
# without an index (Workloads with the Kueue integration off) are not synced.
SYNCED = {"AccelerateJob": ("job_bodies",), "Pod": ("job_pods", "job_placeholders"),
          "Workload": ("job_workloads",)}

# (kind, namespace, name, uid) -> resourceVersion: kopf keys its index entries by uid, so a pod
# made again under a name sits beside the ghost of the one deleted while it was not watching.
Versions = dict[tuple[str, str, str, str], str]


def indexed_versions(indexes: Mapping[str, Index], kinds: Iterable[str]) -> Versions:
    """What kopf's indexes show of the kinds synced."""
    return {(kind, key[0], name, uid or ""): version or ""
            for kind in kinds for index_name in SYNCED[kind]
            for key, name, uid, version in indexed_objects(kind, indexes.get(index_name))}


def caught_up(indexed: str | None, listed: str) -> bool:
    """Whether an index shows an object at the listed version or a newer one. Versions are
    compared as the integers they are (KEP-5504, stable in Kubernetes 1.35); one that is not an
    integer (another storage) only by equality, so an object changing all the time waits for
    the next list."""
    if indexed is None:
        return False
    if indexed.isdigit() and listed.isdigit():
        return int(indexed) >= int(listed)
    return indexed == listed


def lagging(listed: Versions, indexed: Versions) -> list[tuple[str, str, str, str]]:
    """The listed objects the indexes lack, or show at an older version (pure)."""
    return sorted(key for key, version in listed.items()
                  if not caught_up(indexed.get(key), version))


class CacheSync:
    """`list_owned(kind)` lists one kind on the API server (Listed: each object's namespace,
    name, uid and version); `wait(indexes)` returns once kopf's indexes have caught up with what
    it lists, or on timeout."""

    def __init__(self, list_owned: Callable[[str], AsyncIterator[Listed]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.list_owned, self.clock = list_owned, clock

    async def listed(self, kinds: Iterable[str]) -> Versions:
        return {(kind, namespace, name, uid): version for kind in kinds
                async for namespace, name, uid, version in self.list_owned(kind)}

    async def wait(self, indexes: Mapping[str, Index]) -> bool:
        """True once the indexes show every listed object at its listed version or a newer one;
        False when TIMEOUT_SECONDS passed first (logged with what lags)."""
        kinds = [kind for kind, kept in SYNCED.items() if any(name in indexes for name in kept)]
        started = self.clock()
        behind: list[tuple[str, str, str, str]] = []
        while self.clock() - started < TIMEOUT_SECONDS:
            try:
                listed, listed_at = await self.listed(kinds), self.clock()
            except Exception as error:  # noqa: BLE001 - listed again, within the timeout
                log.warning("listing for the cache sync failed (tried again): %r", error)
                await asyncio.sleep(RELIST_SECONDS)
                continue
            while self.clock() - listed_at < RELIST_SECONDS:
                behind = lagging(listed, indexed_versions(indexes, kinds))
                if not behind:
                    log.info("caches synced: kopf's indexes show the %d objects listed "
                             "(%.1f s)", len(listed), self.clock() - started)
                    return True
                await asyncio.sleep(CHECK_SECONDS)
        log.warning("caches not synced after %.0f s: %d object(s) lag behind the API server "
                    "(first: %s); the passes run anyway", TIMEOUT_SECONDS, len(behind),
                    ", ".join("/".join(key[:3]) for key in behind[:3]))
        return False
