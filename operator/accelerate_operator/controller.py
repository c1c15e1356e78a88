"""The operator's runtime: informers for the jobs and what they own, wired to the Reconciler
and the Clock. Thin: an event finds its job in the stores and runs the job's pass; the pass
reads the job's pods and children from the stores when it starts (no GET).

What is followed, each collection filtered on the server by our job-name label: the
AccelerateJobs, their pods, Services and rendered ConfigMaps (a child deleted by hand is seen
missing and recreated; the logs archived at a restart are never recreated, so not followed),
and with the Kueue integration on (ACCELERATE_OPERATOR_KUEUE=true, the chart's kueue.enabled)
the Kueue Workloads the operator created; those are followed only while Kueue serves them, so
the operator runs the same on a cluster without Kueue.

Start-up: the owned objects are listed first, then the jobs, each of which then runs a pass;
only then do the watches start, from the lists' versions. So a pass never plans from a store
that has not been filled yet, and nothing that changes after the lists is missed.

The operator writes nothing to a job but its status: no finalizer (one would block deleting
jobs while the operator is down), no annotation. A job carrying the finalizer that versions
before 0.1 added gets it removed, so it can still be deleted."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine, Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from accelerate_trainer.contract import ATTEMPT_LABEL, JOB_NAME_LABEL

from .clock import Clock
from .constants import FIELD_MANAGER, GROUP, KIND, PLURAL, VERSION
from .informer import DELETED, Collection, Informer, Store
from .kube import Kube
from .kueue import KUEUE_GROUP, KUEUE_VERSION, QueueContext
from .reconciler import Reconciler
from .status import PodState, read_pod_state

log = logging.getLogger("accelerate_operator")

KUEUE_ENABLED = os.environ.get("ACCELERATE_OPERATOR_KUEUE", "").lower() in ("1", "true")
LEGACY_FINALIZER = f"{GROUP}/finalizer"
# A pod or child deleted runs its job's pass this much later, and only once the API server has
# confirmed that the job still exists. When a job is deleted, the garbage collector deletes its
# children, and their DELETED events (on other watches than the job's) can come before the job's
# own, by more than a second under load: a pass run on them would recreate the children of a job
# that is gone. The deletions of one job within the grace share one check.
DELETION_GRACE_SECONDS = 1.0
# kubectl apply keeps a full copy of the object in this annotation; nothing here reads it.
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"

JOBS = Collection(f"/apis/{GROUP}/{VERSION}", PLURAL)
PODS = Collection("/api/v1", "pods", JOB_NAME_LABEL)
SERVICES = Collection("/api/v1", "services", JOB_NAME_LABEL)
CONFIGMAPS = Collection("/api/v1", "configmaps", f"{JOB_NAME_LABEL},!{ATTEMPT_LABEL}")
WORKLOADS = Collection(f"/apis/{KUEUE_GROUP}/{KUEUE_VERSION}", "workloads", JOB_NAME_LABEL)

JobKey = tuple[str, str]  # (namespace, job name)


# ---- what the stores keep of each object (pure) ------------------------------------------
def _lean_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """managedFields are most of an object's metadata, and nothing here reads them."""
    lean = {key: value for key, value in metadata.items() if key != "managedFields"}
    annotations = lean.get("annotations")
    if annotations and LAST_APPLIED in annotations:
        lean["annotations"] = {k: v for k, v in annotations.items() if k != LAST_APPLIED}
    return lean


def lean_job(body: Mapping[str, Any]) -> dict[str, Any]:
    return {"metadata": _lean_metadata(body["metadata"]), "spec": body.get("spec") or {},
            "status": body.get("status") or {}}


def job_key(body: Mapping[str, Any]) -> JobKey:
    return body["metadata"].get("namespace") or "", body["metadata"]["name"]


def owning_job(body: Mapping[str, Any]) -> JobKey | None:
    """The job an object belongs to, by its job-name label."""
    name = (body["metadata"].get("labels") or {}).get(JOB_NAME_LABEL)
    return (body["metadata"].get("namespace") or "", name) if name else None


def owner_uid(body: Mapping[str, Any]) -> str | None:
    return next((ref.get("uid") for ref in body["metadata"].get("ownerReferences") or []
                 if ref.get("kind") == KIND), None)


def pod_entry(body: Mapping[str, Any]) -> tuple[str | None, PodState]:
    return owner_uid(body), read_pod_state(body)


def child_name(body: Mapping[str, Any]) -> str:
    return body["metadata"]["name"]


def workload_entry(body: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    return owner_uid(body), {
        "apiVersion": body.get("apiVersion") or f"{KUEUE_GROUP}/{KUEUE_VERSION}",
        "metadata": _lean_metadata(body["metadata"]),
        "spec": {"active": (body.get("spec") or {}).get("active", True)},
        "status": body.get("status") or {}}


class Controller:
    """The stores, the informers that fill them, and what their events run."""

    def __init__(self, kube: Kube, namespaces: Sequence[str] = (),
                 kueue: bool = KUEUE_ENABLED):
        self.kube = kube
        self.reconciler = Reconciler(kube)
        self.clock = Clock(self.reconcile, self.reconciler.refresh_progress)
        self.jobs: Store[dict[str, Any]] = Store(lean_job, job_key)
        self.pods: Store[tuple[str | None, PodState]] = Store(pod_entry, owning_job)
        self.configmaps: Store[str] = Store(child_name, owning_job)
        self.services: Store[str] = Store(child_name, owning_job)
        self.workloads: Store[tuple[str | None, dict]] | None = (
            Store(workload_entry, owning_job) if kueue else None)
        self._uids: dict[JobKey, str] = {}
        self._deletions: set[Hashable] = set()  # jobs whose check after a deletion is due
        self._tasks: set[asyncio.Task] = set()
        self.synced = False
        scopes = list(namespaces) or [None]
        owned = [(PODS, self.pods, self.on_pod), (SERVICES, self.services, self.on_child),
                 (CONFIGMAPS, self.configmaps, self.on_child)]
        if self.workloads is not None:
            owned.append((WORKLOADS, self.workloads, self.on_workload))
        self.owned_informers = [
            Informer(kube, collection, store, listener, namespace,
                     required=collection is not WORKLOADS)
            for collection, store, listener in owned for namespace in scopes]
        self.job_informers = [Informer(kube, JOBS, self.jobs, self.on_job, namespace)
                              for namespace in scopes]

    # ---- what a pass reads --------------------------------------------------------------
    def pods_of(self, namespace: str, name: str, uid: str) -> list[PodState]:
        """The job's pods. A pod of an earlier job of the same name (deleted, its pods still
        terminating) is no pod of this one: the pass sees it as a stale pod on its way out, so
        the new group waits for the name without counting the deletion as a failure."""
        return [state if owner == uid else replace(state, attempt=-1, deleting=True)
                for owner, state in self.pods.get((namespace, name))]

    def children_of(self, namespace: str, name: str) -> set[tuple[str, str]]:
        return ({("ConfigMap", n) for n in self.configmaps.get((namespace, name))}
                | {("Service", n) for n in self.services.get((namespace, name))})

    def queue_of(self, namespace: str, name: str, uid: str) -> QueueContext | None:
        """The job's Workload, None when the Kueue integration is off."""
        if self.workloads is None:
            return None
        owned = [workload for owner, workload in self.workloads.get((namespace, name))
                 if owner == uid]
        return QueueContext(workload=owned[0] if owned else None)

    async def reconcile(self, body: Mapping[str, Any]) -> float | None:
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        uid = body["metadata"]["uid"]

        def shown() -> tuple | None:
            # A pass may have been asked for with a body taken before the job was deleted (the
            # clock's, an event's just before the deletion): a job gone gets no pass.
            if self._uids.get((namespace, name)) != uid:
                return None
            return (self.pods_of(namespace, name, uid), self.children_of(namespace, name),
                    self.queue_of(namespace, name, uid))
        return await self.reconciler.reconcile_latest(body, shown)

    # ---- events ---------------------------------------------------------------------------
    # Level-triggered: every event of a job (its creation, a spec change, the listing at
    # start-up, our own status writes) reconciles it from scratch; a pass with nothing to
    # change makes no API call.
    def on_job(self, kind: str, key: Hashable, body: Mapping[str, Any],
               _obj: Mapping[str, Any] | None) -> None:
        uid = body["metadata"]["uid"]
        if kind == DELETED:
            self._forget(key, uid)
            return
        if self._uids.get(key, uid) != uid:  # deleted and created again while unwatched
            self._forget(key, self._uids[key])
        self._uids[key] = uid
        metadata = body["metadata"]
        if metadata.get("deletionTimestamp") and LEGACY_FINALIZER in (
                metadata.get("finalizers") or ()):
            self._spawn(self.kube.remove_finalizer(body, LEGACY_FINALIZER))
        self.clock.track(body)
        self._spawn(self.clock.run_pass(body))

    def on_pod(self, kind: str, key: Hashable, value: tuple[str | None, PodState] | None,
               _obj: Mapping[str, Any] | None) -> None:
        """A pod created, scheduled, started, ended: the job's pass acts on it now. One deleted
        or being deleted (its deletionTimestamp set) may be going with its job: that pass waits
        for the check (DELETION_GRACE_SECONDS)."""
        if kind == DELETED or (value is not None and value[1].deleting):
            self._after_deletion(key)
        else:
            self._pass_now(key)

    def on_workload(self, kind: str, key: Hashable, _value: Any,
                    _obj: Mapping[str, Any] | None) -> None:
        """A Workload admitted or evicted: the job's pass acts on it."""
        if kind == DELETED:
            self._after_deletion(key)
        else:
            self._pass_now(key)

    def on_child(self, kind: str, key: Hashable, _value: Any,
                 _obj: Mapping[str, Any] | None) -> None:
        """A ConfigMap or Service deleted (by hand, say): the job's pass recreates it."""
        if kind == DELETED:
            self._after_deletion(key)

    def _pass_now(self, key: Hashable) -> None:
        for body in self.jobs.get(key):
            self._spawn(self.clock.run_pass(body))

    def _after_deletion(self, key: Hashable) -> None:
        if key not in self._deletions:
            self._deletions.add(key)
            self._spawn(self._pass_after_deletion(key))

    async def _pass_after_deletion(self, key: Hashable) -> None:
        try:
            await asyncio.sleep(DELETION_GRACE_SECONDS)
        finally:
            self._deletions.discard(key)
        for body in self.jobs.get(key):  # the job as it is now: none if it went meanwhile
            metadata = body["metadata"]
            if await self.kube.job_exists(metadata["namespace"], metadata["name"],
                                          metadata["uid"]):
                await self.clock.run_pass(body)

    def _forget(self, key: Hashable, uid: str) -> None:
        self._uids.pop(key, None)
        self.reconciler.forget(uid)
        self.clock.forget(uid)

    def _spawn(self, work: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # The job's next event, or the clock's resync, runs the pass again.
            log.error("%s failed: %r", task.get_coro().__qualname__, task.exception(),
                      exc_info=task.exception())

    # ---- the whole run ----------------------------------------------------------------------
    async def run(self) -> None:
        """List everything, reconcile every job, then follow the watches until cancelled."""
        tasks: list[asyncio.Task] = []
        try:
            await asyncio.gather(*(i.sync(notify=False) for i in self.owned_informers))
            await asyncio.gather(*(i.sync() for i in self.job_informers))
            self.synced = True
            log.info("%s started: %d jobs, %d pods", FIELD_MANAGER, len(self.jobs),
                     len(self.pods))
            tasks = [asyncio.create_task(i.run(), name=f"watch {i.collection.plural}")
                     for i in self.owned_informers + self.job_informers]
            tasks.append(asyncio.create_task(self.clock.run(), name="clock"))
            await asyncio.gather(*tasks)
        finally:
            for task in [*tasks, *self._tasks]:
                task.cancel()
            await asyncio.gather(*tasks, *self._tasks, return_exceptions=True)
            await self.kube.close()
