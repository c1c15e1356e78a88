"""The operator's kopf handlers: thin. kopf lists and watches the AccelerateJobs and what they
own (each owned kind filtered on the server by our job-name label), keeps what a pass reads of
each object in its indexes, and hands every event to the controller (controller.py), whose work
queue runs the job's pass.

- Indexes (`@kopf.index`): the jobs, their pods (as PodState), Services, rendered ConfigMaps,
  PodDisruptionBudgets and, with the Kueue integration, Workloads, each by (namespace, job
  name).
- Event handlers (`@kopf.on.event`): put the job on the work queue.
- Start-up: settings, and the controller started with the indexes; cleanup stops it; the probe
  answers kopf's liveness endpoint (`--liveness`).

Every handler is a coroutine: kopf runs a plain function in a thread pool, a thread hop per
event. Only event and index handlers: kopf writes nothing to a job (no finalizer, which would block
deleting jobs while the operator is down; no annotation, no diff-base) and posts no events of
its own; the operator's events are the only events. The one write kopf makes is its peering
keep-alive, when peering is on (the chart runs two replicas: one active, one paused)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from . import heap, metrics
from .constants import GROUP, PLURAL
from .controller import (
    CONFIGMAP_SELECTOR,
    LEGACY_FINALIZER,
    PDB_SELECTOR,
    POD_SELECTOR,
    SERVICE_SELECTOR,
    WORKLOAD_SELECTOR,
    Controller,
    PauseTracker,
    WatchRestartCounter,
    lean_job,
    lean_workload,
    owner_uid,
    owning_job,
    pod_entry,
)
from .kube import Kube
from .kueue import KUEUE_GROUP

log = logging.getLogger("accelerate_operator")

KUEUE_ENABLED = os.environ.get("ACCELERATE_OPERATOR_KUEUE", "").lower() in ("1", "true")
# A kopf worker per object exits after this long without events, and drops the decoded body it
# holds (kopf's default is 5 s: at 1,000 pods starting, 1,000 bodies held; docs/benchmarks.md).
WORKER_IDLE_SECONDS = 0.5
LIST_CHUNK = 500


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf builds a diff-base "essence" of every watched object on every watch event, a deep
    copy of its body (and a second one in the progress storage's clear), whether or not any
    handler reads it. Only on.create/update/resume handlers do, and this operator has none (a
    unit test holds it): the essence is empty and never stored. Measured: the two deep copies
    were 18 % of the operator's CPU in a burst of 500 two-node jobs (docs/benchmarks.md,
    "Issue 23: kopf again")."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return {}

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


class _Runtime:
    """The one controller of this process, created at start-up (kopf's login comes first)."""

    controller: Controller | None = None
    connection: kopf.ConnectionInfo | None = None
    namespaces: list[str] = []  # those watched (set by __main__); none: every namespace
    pause_tracker: PauseTracker | None = None
    metrics_served = False
    # The operator's own process (set by __main__), not a test's: the collector's settings are
    # the whole process's.
    settle_gc = False


RUNTIME = _Runtime()


def _login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """In a pod, the service account (kopf's own login; the image has no `kubernetes` client:
    17 MiB of idle memory, finding 10); elsewhere the kubeconfig, through the official client
    where it is installed (exec plugins, OIDC and token refresh included), else kopf's own
    kubeconfig reader."""
    failures = []
    # The official client reads $KUBECONFIG as it was when `kubernetes` was first imported;
    # kopf's own reader reads it now (it matters where a test or a shell sets it later).
    for way in (kopf.login_with_service_account, kopf.login_via_client,
                kopf.login_with_kubeconfig):
        try:
            info = way(settings=settings, logger=log)
        except Exception as error:  # noqa: BLE001 - the next way may work
            failures.append(f"{way.__name__}: {error}")
            continue
        if info is not None:
            return info
    raise kopf.LoginError("no credentials: neither a service account nor a kubeconfig ("
                          + "; ".join(failures) + ")")


def kube_from_environment() -> Kube:
    """A Kube logged in as the operator logs in (tests and benchmarks, outside kopf's run)."""
    settings = kopf.OperatorSettings()

    async def login() -> kopf.ConnectionInfo:
        return await asyncio.to_thread(_login, settings)
    return Kube(login)


@kopf.on.login(id="login")
async def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    # In a thread: a kubeconfig's exec plugin may run for seconds.
    RUNTIME.connection = await asyncio.to_thread(_login, settings)
    return RUNTIME.connection


@kopf.on.startup(id="configure")
async def configure(settings: kopf.OperatorSettings, **indexes: Any) -> None:
    settings.posting.enabled = False
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.scanning.disabled = True  # no CRD or namespace watching, and no RBAC for it
    settings.queueing.idle_timeout = WORKER_IDLE_SECONDS
    settings.watching.chunk_size = LIST_CHUNK
    selectors = settings.watching.label_selectors
    selectors["v1", "pods"] = POD_SELECTOR
    selectors["v1", "services"] = SERVICE_SELECTOR
    selectors["v1", "configmaps"] = CONFIGMAP_SELECTOR
    selectors[KUEUE_GROUP, "workloads"] = WORKLOAD_SELECTOR
    selectors["policy", "poddisruptionbudgets"] = PDB_SELECTOR

    async def login_again() -> kopf.ConnectionInfo:
        # Before our first request, and after a 401 (the token may have rotated): kopf's login.
        RUNTIME.connection = await asyncio.to_thread(_login, settings)
        return RUNTIME.connection

    controller = Controller(Kube(login_again), kueue=KUEUE_ENABLED)
    if KUEUE_ENABLED:
        # v1beta2 where served (Kueue >= 0.15; v0.20 serves nothing else), else v1beta1; kopf
        # watches the preferred version itself, and the pure code reads both shapes.
        version = await controller.kube.discover_kueue_version()
        log.info("Kueue integration on: Workloads %s", version or "not served (Kueue absent)")
    if settings.peering.mandatory and not settings.peering.standalone:
        # Created before kopf's peering starts (after the start-up handlers); this replica runs
        # no pass until kopf's peering resumes it.
        await controller.kube.ensure_peering(settings.peering.name, RUNTIME.namespaces)
        controller.queue.paused = True
    RUNTIME.pause_tracker = PauseTracker(controller.queue)
    peering_log = logging.getLogger(PauseTracker.LOGGER)
    peering_log.addHandler(RUNTIME.pause_tracker)
    # Pausing and resuming are logged too: what failover did, in the operator's log.
    peering_log.setLevel(min(peering_log.getEffectiveLevel(), logging.INFO))
    controller.start({name: index for name, index in indexes.items()
                      if isinstance(index, kopf.Index)})
    RUNTIME.controller = controller
    WatchRestartCounter.install()
    if RUNTIME.settle_gc:  # start-up is over: what exists now stays (heap.py)
        heap.settle_garbage_collector()
        log.info("garbage collector: %d start-up objects frozen, young threshold %d",
                 gc.get_freeze_count(), gc.get_threshold()[0])
    port = os.environ.get("ACCELERATE_OPERATOR_METRICS_PORT")
    if port and not RUNTIME.metrics_served:
        metrics.count_jobs_from(controller.job_statuses)
        metrics.start_metrics_server(int(port))
        RUNTIME.metrics_served = True  # one server per process, across kopf runs in tests


@kopf.on.cleanup(id="stop")
async def stop(**_: Any) -> None:
    if RUNTIME.pause_tracker is not None:
        logging.getLogger(PauseTracker.LOGGER).removeHandler(RUNTIME.pause_tracker)
        RUNTIME.pause_tracker = None
    if RUNTIME.controller is not None:
        await RUNTIME.controller.stop()
        RUNTIME.controller = None


@kopf.on.probe(id="jobs")
async def probe(**_: Any) -> dict[str, Any]:
    """kopf's liveness endpoint answers only while its event loop does; this adds what the
    operator holds."""
    controller = RUNTIME.controller
    if controller is None:
        return {"started": False}
    return {"jobs": len(controller.states), "queued": len(controller.queue),
            "paused": controller.queue.paused, "passes": controller.queue.passes}


# ---- indexes: what a pass reads, by (namespace, job name) ---------------------------------------
@kopf.index(GROUP, PLURAL, id="job_bodies")
async def job_bodies(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict:
    return {(namespace or "", name): lean_job(body)}


@kopf.index("v1", "pods", id="job_pods")
async def job_pods(body: kopf.Body, meta: Mapping[str, Any], **_: Any) -> dict | None:
    key = owning_job(meta)
    return {key: pod_entry(body)} if key else None


@kopf.index("v1", "services", id="job_services")
async def job_services(meta: Mapping[str, Any], name: str, **_: Any) -> dict | None:
    key = owning_job(meta)
    return {key: name} if key else None


@kopf.index("v1", "configmaps", id="job_configmaps")
async def job_configmaps(meta: Mapping[str, Any], name: str, **_: Any) -> dict | None:
    key = owning_job(meta)
    return {key: name} if key else None


@kopf.index("policy", "poddisruptionbudgets", id="job_pdbs")
async def job_pdbs(meta: Mapping[str, Any], name: str, **_: Any) -> dict | None:
    key = owning_job(meta)
    return {key: name} if key else None


if KUEUE_ENABLED:
    @kopf.index(KUEUE_GROUP, "workloads", id="job_workloads")
    async def job_workloads(body: kopf.Body, meta: Mapping[str, Any], **_: Any) -> dict | None:
        key = owning_job(meta)
        return {key: (owner_uid(meta), lean_workload(body))} if key else None

    @kopf.on.event(KUEUE_GROUP, "workloads", id="workload_events")
    async def workload_events(type: str | None, body: kopf.Body, **_: Any) -> None:  # noqa: A002
        if RUNTIME.controller is not None:
            RUNTIME.controller.on_child(type, "Workload", body)


# ---- events: put the job on the work queue ------------------------------------------------------
# kopf's `when` filters: an event that would change nothing (the echo of our own status write, a
# created pod's first event, a Service created) is not handed to the handler at all, which
# saves kopf's per-handler machinery for about half the events of a job (docs/benchmarks.md).
def _job_event_matters(type: str | None, body: kopf.Body, **_: Any) -> bool:  # noqa: A002
    return RUNTIME.controller is not None and RUNTIME.controller.job_event_matters(type, body)


def _pod_event_matters(type: str | None, body: kopf.Body, **_: Any) -> bool:  # noqa: A002
    return RUNTIME.controller is not None and RUNTIME.controller.pod_event_matters(type, body)


def _child_event_matters(type: str | None, **_: Any) -> bool:  # noqa: A002
    return RUNTIME.controller is not None and RUNTIME.controller.child_event_matters(type)


@kopf.on.event(GROUP, PLURAL, id="job_events", when=_job_event_matters)
async def job_events(type: str | None, body: kopf.Body, meta: Mapping[str, Any],  # noqa: A002
                     **_: Any) -> None:
    controller = RUNTIME.controller
    if controller is None:
        return
    if meta.get("deletionTimestamp") and LEGACY_FINALIZER in (meta.get("finalizers") or ()):
        # Versions before 0.1 put a finalizer on jobs: without this, such a job never goes.
        await controller.kube.remove_finalizer(body, LEGACY_FINALIZER)
    controller.on_job(type, body)


@kopf.on.event("v1", "pods", id="pod_events", when=_pod_event_matters)
async def pod_events(type: str | None, body: kopf.Body, **_: Any) -> None:  # noqa: A002
    if RUNTIME.controller is not None:
        RUNTIME.controller.on_pod(type, body)


@kopf.on.event("v1", "services", id="service_events", when=_child_event_matters)
async def service_events(type: str | None, body: kopf.Body, **_: Any) -> None:  # noqa: A002
    if RUNTIME.controller is not None:
        RUNTIME.controller.on_child(type, "Service", body)


@kopf.on.event("policy", "poddisruptionbudgets", id="pdb_events",
               when=_child_event_matters)
async def pdb_events(type: str | None, body: kopf.Body, **_: Any) -> None:  # noqa: A002
    if RUNTIME.controller is not None:
        RUNTIME.controller.on_child(type, "PodDisruptionBudget", body)


@kopf.on.event("v1", "configmaps", id="configmap_events",
               when=_child_event_matters)
async def configmap_events(type: str | None, body: kopf.Body, **_: Any) -> None:  # noqa: A002
    if RUNTIME.controller is not None:
        RUNTIME.controller.on_child(type, "ConfigMap", body)
