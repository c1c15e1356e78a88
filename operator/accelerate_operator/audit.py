"""The index audit, one of the small pieces kopf lacks, on its public API. After a watch's
resourceVersion expired (410), or when a standby resumes, kopf lists again, but an object deleted
while it was not watching stays in its indexes for good (nothing ever reports its deletion). A
pass deciding from such a ghost pod would wait for it forever. So the owned collections are
listed AUDIT_DELAY_SECONDS after kopf re-lists (its listing events carry type None) and every
AUDIT_SECONDS anyway; indexed objects the listing lacks are ghosts: the passes no longer see them
(`Audit.hides`), and their jobs are reconciled."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Mapping
from typing import Any, Protocol

log = logging.getLogger("accelerate_operator")

AUDIT_SECONDS = 300.0
AUDIT_DELAY_SECONDS = 5.0
# The owned kinds, and the index that keeps each.
AUDITED = (("Pod", "job_pods"), ("Pod", "job_placeholders"), ("Service", "job_services"),
           ("ConfigMap", "job_configmaps"), ("PodDisruptionBudget", "job_pdbs"),
           ("Workload", "job_workloads"))


class Index(Protocol):
    """What a pass reads of a kopf.Index: the values indexed under a key."""

    def get(self, key: Hashable, default: Any = None) -> Iterable[Any] | None: ...


def indexed_name(kind: str, value: Any) -> str:
    """The object's name in an index's value (indexes.py: what each kind's entry is)."""
    if kind in ("Pod", "Workload"):
        return value[1].name if kind == "Pod" else value[1]["metadata"]["name"]
    return value[0] if kind == "ConfigMap" else value


class Audit:
    """Lists the owned collections through `list_names(kind)` and keeps the ghosts found;
    `reconcile(job key)` queues a job whose objects turned out to be ghosts."""

    def __init__(self, list_names: Callable[[str], AsyncIterator[tuple[str, str]]],
                 reconcile: Callable[[Hashable], None]):
        self.list_names, self.reconcile = list_names, reconcile
        self.indexes: Mapping[str, Index] = {}
        self.ghosts: set[tuple[str, str, str]] = set()  # (kind, namespace, name)
        self._due: asyncio.TimerHandle | None = None
        self._tasks: list[asyncio.Task] = []

    def hides(self, kind: str, namespace: str, name: str) -> bool:
        return (kind, namespace, name) in self.ghosts

    def seen(self, kind: str, event_type: str | None, metadata: Mapping[str, Any]) -> None:
        """An event proves the object is no ghost; a listing event (type None) means kopf has
        listed again: audit soon."""
        if self.ghosts:
            self.ghosts.discard((kind, metadata.get("namespace") or "", metadata["name"]))
        if event_type is None and self._due is None and self._tasks:
            self._due = asyncio.get_running_loop().call_later(AUDIT_DELAY_SECONDS, self._start)

    def indexed(self, kind: str, index: str) -> dict[tuple[str, str], Hashable]:
        """(namespace, name) -> job key of every object of a kind the indexes show."""
        found: dict[tuple[str, str], Hashable] = {}
        source = self.indexes.get(index)
        for key in list(source or ()):
            for value in source.get(key) or ():
                found[(key[0], indexed_name(kind, value))] = key
        return found

    async def audit(self) -> int:
        """List the owned collections once; every indexed object the lists lack becomes a ghost
        the passes no longer see, and its job is reconciled. Returns the ghosts found."""
        kinds = [(kind, index) for kind, index in AUDITED if index in self.indexes]
        found = 0
        for kind, index in kinds:
            before = self.indexed(kind, index)  # what was indexed before the list started
            if not before:
                continue
            listed = {item async for item in self.list_names(kind)}
            for (namespace, name), key in before.items():
                if (namespace, name) not in listed and not self.hides(kind, namespace, name):
                    log.info("%s %s/%s is gone but still indexed (deleted while unwatched): "
                             "no pass sees it any more", kind, namespace, name)
                    self.ghosts.add((kind, namespace, name))
                    self.reconcile(key)
                    found += 1
        # Ghosts whose index entry has gone (their name indexed again as a new object clears
        # them in seen) are forgotten.
        self.ghosts &= {(kind, ns, name) for kind, index in kinds
                        for (ns, name) in self.indexed(kind, index)}
        return found

    def _start(self) -> None:
        self._due = None
        self._tasks.append(asyncio.create_task(self._once(), name="index audit"))

    async def _once(self) -> None:
        try:
            await self.audit()
        except Exception as error:  # the next audit tries again
            log.warning("index audit failed: %r", error)
        finally:
            self._tasks = [t for t in self._tasks if not t.done()]

    async def _every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            await self._once()

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
