"""Informers: the operator's live view of its objects. Each lists one collection once (in
pages), then follows its watch from that list's resourceVersion, keeping in a Store only what
the reconcile passes read of each object (a projection: a pod's PodState, a child's name, a job
without its managedFields), grouped by the job the object belongs to.

This is what kopf's indexes and event handlers did, at a fraction of the CPU and memory: kopf
ran every event through its per-object queues, cause detection and handler invocation (about
half of the operator's CPU per job) and kept each object's decoded body (docs/benchmarks.md,
finding 9). An event here updates the store, then calls one callback, synchronously: the
callback schedules the job's pass, which reads the stores when it starts, so it always sees the
newest state.

A watch that ends is resumed from the last resourceVersion seen (bookmarks keep it recent); one
whose version expired (410) lists again, and the differences against the store come out as
events, deletions included, so nothing that happened during the gap is missed. A collection the
server does not serve (Kueue not installed, the CRD not yet applied) is tried again every
NOT_SERVED_SECONDS. The requests themselves are kube.py's."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import aiohttp

from .apierrors import server_message
from .kube import ApiError, Gone, Kube

log = logging.getLogger("accelerate_operator.informer")

V = TypeVar("V")
ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"
# Seconds before a failed list or watch is tried again: 1, 2, 5, then every 10.
BACKOFF_SECONDS = (1, 2, 5, 10)
NOT_SERVED_SECONDS = 30


@dataclass(frozen=True)
class Collection:
    """A kind of object as the API server serves it, optionally filtered by labels."""

    api: str  # "/api/v1" or "/apis/<group>/<version>"
    plural: str
    label_selector: str | None = None

    def path(self, namespace: str | None) -> str:
        if namespace is None:
            return f"{self.api}/{self.plural}"
        return f"{self.api}/namespaces/{namespace}/{self.plural}"


Key = tuple[str, str]  # (namespace, name) of one object


class Store(Generic[V]):
    """Projected objects, by (namespace, name) and by group (the job they belong to).

    `project(obj)` is what is kept of an object; `group(obj)` the key it is found under (None:
    not kept). Both are pure. The resourceVersion of each object is kept too, so a re-list
    reports only what changed."""

    def __init__(self, project: Callable[[Mapping[str, Any]], V],
                 group: Callable[[Mapping[str, Any]], Hashable | None]):
        self._project, self._group = project, group
        self._objects: dict[Key, tuple[Hashable, str, V]] = {}
        self._groups: dict[Hashable, dict[Key, V]] = {}

    def __len__(self) -> int:
        return len(self._objects)

    def get(self, group: Hashable) -> list[V]:
        return list((self._groups.get(group) or {}).values())

    def groups(self) -> Iterator[tuple[Hashable, list[V]]]:
        for group, members in list(self._groups.items()):
            yield group, list(members.values())

    def keys(self, namespace: str | None) -> set[Key]:
        return {key for key in self._objects if namespace is None or key[0] == namespace}

    def version(self, key: Key) -> str | None:
        entry = self._objects.get(key)
        return entry[1] if entry else None

    def kept(self, key: Key) -> tuple[Hashable, V] | None:
        """(group, value) as kept for the object, or None."""
        entry = self._objects.get(key)
        return (entry[0], entry[2]) if entry else None

    def put(self, obj: Mapping[str, Any]) -> tuple[Hashable | None, V | None, Hashable | None]:
        """Keep (or replace) an object. Returns (its group, what is kept, the group it left
        when its group changed)."""
        metadata = obj["metadata"]
        key = (metadata.get("namespace") or "", metadata["name"])
        group = self._group(obj)
        left = self._drop(key) if key in self._objects else None
        if group is None:
            return None, None, left
        value = self._project(obj)
        self._objects[key] = (group, metadata.get("resourceVersion") or "", value)
        self._groups.setdefault(group, {})[key] = value
        return group, value, left if left != group else None

    def remove(self, key: Key) -> tuple[Hashable | None, V | None]:
        entry = self._objects.get(key)
        if entry is None:
            return None, None
        self._drop(key)
        return entry[0], entry[2]

    def _drop(self, key: Key) -> Hashable:
        group, _, _ = self._objects.pop(key)
        members = self._groups[group]
        del members[key]
        if not members:
            del self._groups[group]
        return group


# What an informer reports: the event type, the object's group and what the store keeps (for a
# deletion: what it kept), and the object as the server sent it (for a deletion found by a
# re-list: None).
Listener = Callable[[str, Hashable, Any, Mapping[str, Any] | None], None]


class Informer:
    """Lists one collection (a namespace's, or the cluster's) into a Store, then follows it.
    Several informers may feed one store (one per watched namespace)."""

    def __init__(self, kube: Kube, collection: Collection, store: Store,
                 listener: Listener | None = None, namespace: str | None = None,
                 required: bool = True):
        self.kube, self.collection, self.store = kube, collection, store
        self.listener = listener
        self.namespace = namespace
        # Not required: a collection that may not exist (Kueue's); its absence is no error.
        self.required = required
        self.resource_version: str | None = None
        self._path = collection.path(namespace)

    async def sync(self, notify: bool = True) -> None:
        """List until it succeeds, so that the store holds the whole collection. With `notify`
        each difference against the store is reported; without, the store is only filled (the
        start-up listing of children: the jobs' listing that follows reconciles every job)."""
        attempt = 0
        while True:
            try:
                await self._relist(notify)
                return
            except Exception as error:  # noqa: BLE001 (any failure: the same retry)
                if not self._absent(error, attempt):
                    raise
                if not self.required and _is_not_served(error):
                    return  # watched once it is served (run())
                await asyncio.sleep(_wait(error, attempt))
                attempt += 1

    async def run(self) -> None:
        """Follow the collection for good: watch, resume, re-list on 410, retry on errors."""
        attempt = 0
        while True:
            try:
                if self.resource_version is None:
                    await self._relist(notify=True)
                started = asyncio.get_running_loop().time()
                async for kind, obj in self.kube.watch(self._path, self.resource_version,
                                                       self.collection.label_selector):
                    self._receive(kind, obj)
                    attempt = 0
                if asyncio.get_running_loop().time() - started < 1:
                    await asyncio.sleep(1)  # a server that ends every watch at once
            except Gone:
                log.info("%s: the watch's version expired; listing again", self._path)
                self.resource_version = None
            except Exception as error:  # noqa: BLE001 (any failure: the same retry)
                if not self._absent(error, attempt):
                    log.exception("%s: unexpected error in the watch", self._path)
                await asyncio.sleep(_wait(error, attempt))
                attempt += 1

    def _absent(self, error: BaseException, attempt: int) -> bool:
        """Log a failed list or watch the way its cause deserves; False for a bug (not an API
        or connection failure)."""
        if _is_not_served(error):
            if attempt == 0 and self.required:
                log.warning("%s is not served (is the CRD installed?); trying again every %d s",
                            self._path, NOT_SERVED_SECONDS)
            return True
        if isinstance(error, Gone):  # a list's continue token expired between two pages
            log.info("%s: listing again from the start: %s", self._path, error)
            return True
        if isinstance(error, ApiError):
            log.warning("%s: %s", self._path, server_message(error))
            return True
        if isinstance(error, aiohttp.ClientError | asyncio.TimeoutError | OSError
                      | json.JSONDecodeError):
            log.warning("%s: %s", self._path, error or type(error).__name__)
            return True
        return False

    def _receive(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.resource_version = obj["metadata"].get("resourceVersion") or self.resource_version
        if kind == "BOOKMARK":
            return
        if kind == DELETED:
            metadata = obj["metadata"]
            group, value = self.store.remove((metadata.get("namespace") or "", metadata["name"]))
            if group is not None:
                self._notify(DELETED, group, value, obj)
            return
        self._put(kind, obj, notify=True)

    def _put(self, kind: str, obj: Mapping[str, Any], notify: bool) -> None:
        """Keep the object; report it unless what is kept of it is what was kept before (a pod
        whose conditions changed in ways no pass reads, say): such an event cannot change what
        a pass does, and skipping it saves the pass."""
        metadata = obj["metadata"]
        before = self.store.kept((metadata.get("namespace") or "", metadata["name"]))
        group, value, left = self.store.put(obj)
        if not notify:
            return
        if left is not None:
            self._notify(DELETED, left, None, obj)
        if group is not None and before != (group, value):
            self._notify(kind, group, value, obj)

    async def _relist(self, notify: bool) -> None:
        """List the collection; what changed against the store is reported as events."""
        unseen = self.store.keys(self.namespace)
        version = None
        async for items, listed_version in self.kube.list_pages(
                self._path, self.collection.label_selector):
            version = listed_version or version
            for obj in items:
                metadata = obj["metadata"]
                key = (metadata.get("namespace") or "", metadata["name"])
                unseen.discard(key)
                kept_version = self.store.version(key)
                if kept_version == metadata.get("resourceVersion"):
                    continue
                self._put(ADDED if kept_version is None else MODIFIED, obj, notify)
        for key in unseen:  # deleted while nobody watched
            group, value = self.store.remove(key)
            if notify and group is not None:
                self._notify(DELETED, group, value, None)
        self.resource_version = version

    def _notify(self, kind: str, group: Hashable, value: Any,
                obj: Mapping[str, Any] | None) -> None:
        if self.listener is None:
            return
        try:
            self.listener(kind, group, value, obj)
        except Exception:  # one bad object must not stop the watch
            log.exception("%s: handling a %s event failed", self._path, kind)


def _is_not_served(error: BaseException) -> bool:
    return isinstance(error, ApiError) and error.status == 404


def _wait(error: BaseException, attempt: int) -> float:
    if _is_not_served(error):
        return NOT_SERVED_SECONDS
    return BACKOFF_SECONDS[min(attempt, len(BACKOFF_SECONDS) - 1)]
