"""kopf handlers: thin. Each finds the job, its pods and children in kopf's indexes and hands
them to the Reconciler; what depends on time alone runs on the Clock (clock.py).

Pods, ConfigMaps and Services are tracked through kopf indexes (in-memory views, each fed by one
watch filtered on the server by our job-name label), so an event reconciles its job without a
single GET, and a child deleted by hand is seen missing and recreated. Only event handlers and
indexes are used: kopf then writes nothing to a job (state-based create/update handlers would add
an annotation patch per job; timers and daemons would add a finalizer, which blocks deleting jobs
while the operator is down, kopf issue 1074).

With the Kueue integration on (ACCELERATE_OPERATOR_KUEUE=true, the chart's kueue.enabled), the
operator also indexes and watches the Kueue Workloads it created (same label filter): an
admission or an eviction reconciles the job at once. kopf serves those handlers only while the
Workload CRD exists, so the operator runs the same on a cluster without Kueue."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

import kopf
from accelerate_trainer.contract import ATTEMPT_LABEL, JOB_NAME_LABEL

from .clock import Clock
from .constants import FIELD_MANAGER, GROUP, KIND, PLURAL, VERSION
from .kube import Kube
from .kueue import KUEUE_GROUP, KUEUE_VERSION, QueueContext
from .reconciler import Reconciler
from .status import read_pod_state

log = logging.getLogger("accelerate_operator")
OURS = {JOB_NAME_LABEL: kopf.PRESENT}
# The logs archived at a restart are ConfigMaps of the job too, but never recreated: not watched.
RENDERED_CONFIGMAPS = {JOB_NAME_LABEL: kopf.PRESENT, ATTEMPT_LABEL: kopf.ABSENT}
KUEUE_ENABLED = os.environ.get("ACCELERATE_OPERATOR_KUEUE", "").lower() in ("1", "true")


@dataclass
class Operator:
    """What the handlers share, set up at start-up. The indexes are kopf's live views, passed to
    handlers only: the first handler call hands them over for the clock."""

    reconciler: Reconciler | None = None
    clock: Clock | None = None
    clock_task: asyncio.Task | None = None
    indexes: dict[str, kopf.Index] = field(default_factory=dict)

    def remember_indexes(self, **indexes: kopf.Index) -> None:
        self.indexes.update(indexes)

    def pods_of(self, namespace: str, name: str, uid: str) -> list:
        """The job's pods. A pod of an earlier job of the same name (deleted, its pods still
        terminating) is no pod of this one: the pass sees it as a stale pod on its way out, so
        the new group waits for the name without counting the deletion as a failure."""
        return [state if owner == uid else replace(state, attempt=-1, deleting=True)
                for owner, state in self.indexes.get("pod_index", {}).get((namespace, name), [])]

    def children_of(self, namespace: str, name: str) -> set[tuple[str, str]]:
        return {child for index in ("configmap_index", "service_index")
                for child in self.indexes.get(index, {}).get((namespace, name), [])}

    def queue_of(self, namespace: str, name: str, uid: str) -> QueueContext | None:
        """The job's Workload, None when the Kueue integration is off."""
        if not KUEUE_ENABLED:
            return None
        owned = [workload for owner, workload
                 in self.indexes.get("workload_index", {}).get((namespace, name), [])
                 if owner == uid]
        return QueueContext(workload=owned[0] if owned else None)

    async def reconcile(self, body: kopf.Body) -> float | None:
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        uid = body["metadata"]["uid"]
        return await self.reconciler.reconcile_latest(
            body, lambda: (self.pods_of(namespace, name, uid), self.children_of(namespace, name),
                           self.queue_of(namespace, name, uid)))


OPERATOR = Operator()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # No handler needs a finalizer now; naming the one older versions added lets kopf find and
    # drop it, so those jobs can still be deleted.
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # We post our own events, one per real transition; kopf's per-handler events are noise.
    settings.posting.enabled = False
    # No handler reads a diff: skip kopf's deep copy of every body for one (docs/benchmarks.md).
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.networking.error_backoffs = [1, 2, 5, 10]
    # Filter on the server: the cluster's other pods and ConfigMaps, and the archived logs,
    # never reach us. (A kopf without server-side selectors still filters in the handlers.)
    selectors = getattr(settings.watching, "label_selectors", None)
    if selectors is not None:
        selectors["v1", "pods"] = selectors["v1", "services"] = JOB_NAME_LABEL
        if KUEUE_ENABLED:
            selectors[KUEUE_GROUP, KUEUE_VERSION, "workloads"] = JOB_NAME_LABEL
        selectors["v1", "configmaps"] = f"{JOB_NAME_LABEL},!{ATTEMPT_LABEL}"
    OPERATOR.indexes.clear()  # a second operator in one process (tests) starts afresh
    OPERATOR.reconciler = Reconciler(Kube.from_environment())
    OPERATOR.clock = Clock(OPERATOR.reconcile, OPERATOR.reconciler.refresh_progress)
    OPERATOR.clock_task = asyncio.create_task(_run_clock(), name="accelerate-operator-clock")
    log.info("%s started", FIELD_MANAGER)


async def _run_clock() -> None:
    while not OPERATOR.indexes:  # until a handler has handed over the indexes
        await asyncio.sleep(1)
    await OPERATOR.clock.run()


@kopf.on.cleanup()
async def stop_clock(**_: Any) -> None:
    if OPERATOR.clock_task is not None:
        OPERATOR.clock_task.cancel()
    if OPERATOR.reconciler is not None:
        await OPERATOR.reconciler.kube.close()


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf builds a deep copy of every object it sees ("the essence"), for the diffs that only
    on.create/on.update handlers read. This operator has none (event handlers and indexes only):
    that copy was a tenth of its CPU per job."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        return None


def _metadata_without_managed_fields(body: kopf.Body) -> dict:
    """managedFields are most of an object's metadata, and nothing here reads them."""
    return {key: value for key, value in body.metadata.items() if key != "managedFields"}


# Indexes are async so kopf calls them inline instead of in its thread pool.
@kopf.index(GROUP, VERSION, PLURAL)
async def job_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    metadata = _metadata_without_managed_fields(body)
    return {(namespace, name): {"metadata": metadata, "spec": dict(body.spec),
                                "status": dict(body.status)}}


def _owner_uid(body: kopf.Body) -> str | None:
    return next((ref.get("uid") for ref in body.metadata.get("ownerReferences") or []
                 if ref.get("kind") == KIND), None)


@kopf.index("v1", "pods", labels=OURS)
async def pod_index(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels[JOB_NAME_LABEL]): (_owner_uid(body), read_pod_state(body))}


if KUEUE_ENABLED:
    @kopf.index(KUEUE_GROUP, KUEUE_VERSION, "workloads", labels=OURS)
    async def workload_index(namespace: str, labels: kopf.Labels, body: kopf.Body,
                             **_: Any) -> dict:
        return {(namespace, labels[JOB_NAME_LABEL]): (_owner_uid(body), {
            "apiVersion": body.get("apiVersion"),
            "metadata": _metadata_without_managed_fields(body),
            "spec": {"active": body.spec.get("active", True)}, "status": dict(body.status)})}

    @kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, "workloads", labels=OURS, id="workload-event")
    async def on_workload_event(namespace: str, labels: kopf.Labels, **kwargs: Any) -> None:
        """Admitted, evicted, released: the job's next pass acts on it."""
        await _reconcile_owner(namespace, labels, kwargs)


@kopf.index("v1", "configmaps", labels=RENDERED_CONFIGMAPS)
async def configmap_index(namespace: str, name: str, labels: kopf.Labels, **_: Any) -> dict:
    return {(namespace, labels[JOB_NAME_LABEL]): ("ConfigMap", name)}


@kopf.index("v1", "services", labels=OURS)
async def service_index(namespace: str, name: str, labels: kopf.Labels, **_: Any) -> dict:
    return {(namespace, labels[JOB_NAME_LABEL]): ("Service", name)}


# Level-triggered: every event of a job (its creation, a spec change, the listing at start-up,
# our own status writes) reconciles it from scratch; a pass with nothing to change is free.
@kopf.on.event(GROUP, VERSION, PLURAL, id="job-event")
async def on_job(type: str, body: kopf.Body, **kwargs: Any) -> None:
    OPERATOR.remember_indexes(**_indexes(kwargs))
    uid = body["metadata"]["uid"]
    if type == "DELETED":
        OPERATOR.reconciler.forget(uid)
        OPERATOR.clock.forget(uid)
        return
    OPERATOR.clock.track(body)
    await OPERATOR.clock.run_pass(body)


@kopf.on.event("v1", "pods", labels=OURS, id="pod-event")
async def on_pod_event(namespace: str, labels: kopf.Labels, **kwargs: Any) -> None:
    await _reconcile_owner(namespace, labels, kwargs)


@kopf.on.event("v1", "services", labels=OURS, id="service-event")
@kopf.on.event("v1", "configmaps", labels=RENDERED_CONFIGMAPS, id="configmap-event")
async def on_child_event(type: str, namespace: str, labels: kopf.Labels, **kwargs: Any) -> None:
    """A ConfigMap or Service deleted (by hand, say): the next pass recreates it."""
    if type == "DELETED":
        await _reconcile_owner(namespace, labels, kwargs)


async def _reconcile_owner(namespace: str, labels: kopf.Labels, kwargs: dict[str, Any]) -> None:
    indexes = _indexes(kwargs)
    OPERATOR.remember_indexes(**indexes)
    # A snapshot: the index may change while this handler awaits.
    for job in list(indexes["job_index"].get((namespace, labels[JOB_NAME_LABEL]), [])):
        await OPERATOR.clock.run_pass(job)


def _indexes(kwargs: dict[str, Any]) -> dict[str, kopf.Index]:
    return {key: value for key, value in kwargs.items() if key.endswith("_index")}
