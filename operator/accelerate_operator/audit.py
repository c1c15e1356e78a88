"""The index audit, one of the small pieces kopf lacks, on its public API. After a watch's
resourceVersion expired (410), or when a standby resumes, kopf lists again, but an object deleted
while it was not watching stays in its indexes for good (nothing ever reports its deletion; kopf
keys an index entry by the object's uid, so a pod made again under the same name sits beside its
ghost). A pass deciding from such a ghost pod would wait for it forever, or take it for an earlier
attempt's pod and delete, by name, the live pod that reuses it; a ghost job would have its children
made again. So the jobs and the owned collections are listed AUDIT_DELAY_SECONDS after kopf
re-lists (its listing events carry type None), when this replica becomes the active one
(controller.py), and every AUDIT_SECONDS anyway; indexed objects the listing lacks (jobs, pods and
Workloads by uid, the other kinds, indexed by name, by name) are ghosts: the passes no longer see
them (`Audit.hides`), and their jobs are reconciled."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any, Protocol

log = logging.getLogger("accelerate_operator")

AUDIT_SECONDS = 300.0
AUDIT_DELAY_SECONDS = 5.0
# The owned kinds, and the index that keeps each.
AUDITED = (("AccelerateJob", "job_bodies"), ("Pod", "job_pods"), ("Pod", "job_placeholders"),
           ("Service", "job_services"), ("ConfigMap", "job_configmaps"),
           ("PodDisruptionBudget", "job_pdbs"), ("Workload", "job_workloads"))
# The kinds whose index entries carry the object's uid: their ghosts are told apart by it.
UID_KINDS = ("AccelerateJob", "Pod", "Workload")


class Index(Protocol):
    """What a pass reads of a kopf.Index: the values indexed under a key."""

    def get(self, key: Hashable, default: Any = None) -> Iterable[Any] | None: ...


# (kind, namespace, name, uid): the uid is None for a kind whose index keeps names only.
Identity = tuple[str, str, str, str | None]
# (namespace, name, uid, resourceVersion) of one listed object (Kube.list_owned).
Listed = tuple[str, str, str, str]


def entry_identity(kind: str, value: Any) -> tuple[str, str | None, str | None]:
    """(name, uid, resourceVersion) of the object in an index's value (indexes.py: each kind's
    entry); uid and version None for a kind indexed by name."""
    if kind == "Pod":
        return value[1].name, value[1].uid, value[1].resource_version
    if kind in UID_KINDS:
        metadata = (value if kind == "AccelerateJob" else value[1])["metadata"]
        return metadata["name"], metadata.get("uid"), metadata.get("resourceVersion")
    return (value[0] if kind == "ConfigMap" else value), None, None


def indexed_objects(kind: str, index: Index | None
                    ) -> Iterator[tuple[Hashable, str, str | None, str | None]]:
    """(job key, name, uid, resourceVersion) of every object of a kind an index shows (read
    also by cache_sync.py)."""
    for key in list(index or ()):
        for value in index.get(key) or ():
            yield (key, *entry_identity(kind, value))


class Audit:
    """Lists the jobs and the owned collections through `list_owned(kind)` (Listed: each
    object's namespace, name, uid and version) and keeps the ghosts found; `reconcile(job key)`
    queues a job whose objects turned out to be ghosts."""

    def __init__(self, list_owned: Callable[[str], AsyncIterator[Listed]],
                 reconcile: Callable[[Hashable], None]):
        self.list_owned, self.reconcile = list_owned, reconcile
        self.indexes: Mapping[str, Index] = {}
        self.ghosts: set[Identity] = set()
        self._due: asyncio.TimerHandle | None = None
        self._tasks: list[asyncio.Task] = []

    def hides(self, kind: str, namespace: str, name: str, uid: str | None = None) -> bool:
        return (kind, namespace, name, uid) in self.ghosts

    def seen(self, kind: str, event_type: str | None, metadata: Mapping[str, Any]) -> None:
        """An event proves the object is no ghost; a listing event (type None) means kopf has
        listed again: audit soon."""
        if self.ghosts:
            uid = metadata.get("uid") if kind in UID_KINDS else None
            self.ghosts.discard((kind, metadata.get("namespace") or "", metadata["name"], uid))
        if event_type is None and self._due is None and self._tasks:
            self._due = asyncio.get_running_loop().call_later(AUDIT_DELAY_SECONDS, self._start)

    def indexed(self, kind: str, index: str) -> dict[Identity, Hashable]:
        """Identity -> job key of every object of a kind the index shows."""
        return {(kind, key[0], name, uid): key
                for key, name, uid, _ in indexed_objects(kind, self.indexes.get(index))}

    async def audit(self) -> int:
        """List the owned collections once; every object indexed before the list began that
        the list lacks becomes a ghost the passes no longer see, and its job is reconciled.
        Returns the ghosts found."""
        kinds = [(kind, index) for kind, index in AUDITED if index in self.indexes]
        found = 0
        for kind, index in kinds:
            before = self.indexed(kind, index)
            if not before:
                continue
            listed = set()
            async for namespace, name, uid, _ in self.list_owned(kind):
                listed |= {(kind, namespace, name, uid), (kind, namespace, name, None)}
            for identity, key in before.items():
                if identity not in listed and identity not in self.ghosts:
                    log.info("%s %s/%s%s is gone but still indexed (deleted while unwatched): "
                             "no pass sees it any more", *identity[:3],
                             f" (uid {identity[3]})" if identity[3] else "")
                    self.ghosts.add(identity)
                    self.reconcile(key)
                    found += 1
        # Ghosts whose index entry has gone are forgotten.
        self.ghosts &= {identity for kind, index in kinds for identity in self.indexed(kind, index)}
        return found

    def _start(self) -> None:
        self._due = None
        self._tasks.append(asyncio.create_task(self.run_once(), name="index audit"))

    async def run_once(self) -> None:
        """One audit; a failure is logged (the next audit tries again)."""
        try:
            await self.audit()
        except Exception as error:  # the next audit tries again
            log.warning("index audit failed: %r", error)
        finally:
            self._tasks = [t for t in self._tasks if not t.done()]

    async def _every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            await self.run_once()

    def start(self, indexes: Mapping[str, Index]) -> None:
        self.indexes = indexes
        self._tasks = [asyncio.create_task(self._every(AUDIT_SECONDS),
                                           name="index audit every 5 minutes")]

    async def stop(self) -> None:
        if self._due is not None:
            self._due.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
