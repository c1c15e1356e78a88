"""kopf handlers: thin. Each one finds the job and its pods and hands them to the Reconciler.

Pods are tracked through a kopf index (an in-memory view fed by one watch), so a pod event
reconciles its job without a single GET. Only event handlers and indexes are used: kopf then
writes nothing to a job (state-based create/update handlers would add an annotation patch per
job; timers and daemons would add a finalizer, which blocks deleting jobs while the operator is
down, kopf issue 1074). What depends on time alone runs on one operator-wide clock task."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
from accelerate_trainer.contract import JOB_NAME_LABEL

from .constants import FIELD_MANAGER, GROUP, PLURAL, VERSION
from .kube import Kube
from .reconciler import Reconciler
from .status import PodState, read_pod_state

log = logging.getLogger("accelerate_operator")
RECONCILER: Reconciler | None = None
POD_INDEX: kopf.Index | None = None
CLOCK: asyncio.Task | None = None
API_THREADS = 32
CLOCK_SECONDS = 2.0


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    global RECONCILER, CLOCK
    # No handler needs a finalizer now; naming the one older versions added lets kopf find and
    # drop it, so those jobs can still be deleted.
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # We post our own events, one per real transition; kopf's per-handler events are noise.
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.networking.error_backoffs = [1, 2, 5, 10]
    # Every API call runs in a thread (the official client is synchronous). asyncio's default
    # pool has min(32, cores + 4) threads, 6 on a 2-core node, which capped the whole operator at
    # 6 calls in flight: 32 lets creates of many jobs overlap (docs/benchmarks.md, finding 1).
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=API_THREADS, thread_name_prefix="kube"))
    RECONCILER = Reconciler(Kube.from_environment(pool_size=API_THREADS))
    CLOCK = asyncio.create_task(_run_clock(), name="accelerate-operator-clock")
    log.info("%s started", FIELD_MANAGER)


@kopf.on.cleanup()
async def stop_clock(**_: Any) -> None:
    if CLOCK is not None:
        CLOCK.cancel()


async def _run_clock() -> None:
    while True:
        await asyncio.sleep(CLOCK_SECONDS)
        if RECONCILER is not None and POD_INDEX is not None:
            try:
                await RECONCILER.tick(_pods_of)
            except Exception:  # the clock must outlive any one bad pass
                log.exception("clock tick failed")


# Indexes are async so kopf calls them inline instead of in its thread pool.
@kopf.index(GROUP, VERSION, PLURAL)
async def job_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): {"metadata": dict(body.metadata), "spec": dict(body.spec),
                                "status": dict(body.status)}}


@kopf.index("v1", "pods", labels={JOB_NAME_LABEL: kopf.PRESENT})
async def pod_index(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels[JOB_NAME_LABEL]): read_pod_state(body)}


def _pods_of(namespace: str, name: str) -> list[PodState]:
    return list(POD_INDEX.get((namespace, name), [])) if POD_INDEX is not None else []


# Level-triggered: every event of a job (its creation, a spec change, the listing at start-up,
# our own status writes) reconciles it from scratch; a pass with nothing to change is free.
@kopf.on.event(GROUP, VERSION, PLURAL, id="job-event")
async def on_job(type: str, body: kopf.Body, namespace: str, name: str,
                 pod_index: kopf.Index, **_: Any) -> None:
    global POD_INDEX
    POD_INDEX = pod_index
    if type == "DELETED":
        RECONCILER.forget(body["metadata"]["uid"])
        return
    RECONCILER.remember(body)
    await RECONCILER.reconcile(body, _pods_of(namespace, name))


@kopf.on.event("v1", "pods", labels={JOB_NAME_LABEL: kopf.PRESENT}, id="pod-event")
async def on_pod_event(namespace: str, labels: kopf.Labels, job_index: kopf.Index,
                       pod_index: kopf.Index, **_: Any) -> None:
    global POD_INDEX
    POD_INDEX = pod_index
    name = labels[JOB_NAME_LABEL]
    # A snapshot: the index may change while this handler awaits.
    for job in list(job_index.get((namespace, name), [])):
        await RECONCILER.reconcile(job, _pods_of(namespace, name))
