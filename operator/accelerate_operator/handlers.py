"""kopf handlers: thin. Each one finds the job and its pods and hands them to the Reconciler.

Pods are tracked through a kopf index (an in-memory view fed by one watch), so a pod event
reconciles its job without a single GET."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from .constants import (
    FIELD_MANAGER,
    FINISHED_PHASES,
    GROUP,
    JOB_NAME_LABEL,
    PLURAL,
    RUNNING,
    VERSION,
)
from .kube import Kube
from .reconciler import Reconciler
from .status import PodState, read_pod_state

log = logging.getLogger("accelerate_operator")
RECONCILER: Reconciler | None = None
PROGRESS_INTERVAL = 5.0


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    global RECONCILER
    # Keep kopf's bookkeeping in annotations: status belongs to the job's schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # We post our own events, one per real transition; kopf's per-handler events are noise.
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.networking.error_backoffs = [1, 2, 5, 10]
    RECONCILER = Reconciler(Kube.from_environment())
    log.info("%s started", FIELD_MANAGER)


@kopf.index(GROUP, VERSION, PLURAL)
def job_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): {"metadata": dict(body.metadata), "spec": dict(body.spec),
                                "status": dict(body.status)}}


@kopf.index("v1", "pods", labels={JOB_NAME_LABEL: kopf.PRESENT})
def pod_index(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels[JOB_NAME_LABEL]): read_pod_state(body)}


def _pods_of(pod_index: kopf.Index, namespace: str, name: str) -> list[PodState]:
    return list(pod_index.get((namespace, name), []))


@kopf.on.resume(GROUP, VERSION, PLURAL, id="job-resume")
@kopf.on.create(GROUP, VERSION, PLURAL, id="job-create")
@kopf.on.update(GROUP, VERSION, PLURAL, id="job-update")
async def on_job(body: kopf.Body, namespace: str, name: str, pod_index: kopf.Index,
                 **_: Any) -> None:
    await RECONCILER.reconcile(body, _pods_of(pod_index, namespace, name))


@kopf.on.event("v1", "pods", labels={JOB_NAME_LABEL: kopf.PRESENT}, id="pod-event")
async def on_pod_event(namespace: str, labels: kopf.Labels, job_index: kopf.Index,
                       pod_index: kopf.Index, **_: Any) -> None:
    name = labels[JOB_NAME_LABEL]
    for job in job_index.get((namespace, name), []):
        await RECONCILER.reconcile(job, _pods_of(pod_index, namespace, name))


def _needs_clock(spec: kopf.Spec, status: kopf.Status, **_: Any) -> bool:
    """Only jobs with a deadline still to reach, or a TTL still to expire, get a timer."""
    policy = spec.get("runPolicy") or {}
    finished = status.get("phase") in FINISHED_PHASES
    return bool(policy.get("activeDeadlineSeconds")) and not finished or (
        policy.get("ttlSecondsAfterFinished") is not None and finished
    )


@kopf.timer(GROUP, VERSION, PLURAL, interval=2.0, when=_needs_clock, id="job-clock")
async def on_clock(body: kopf.Body, namespace: str, name: str, pod_index: kopf.Index,
                   **_: Any) -> None:
    await RECONCILER.reconcile(body, _pods_of(pod_index, namespace, name))


def _is_training(status: kopf.Status, **_: Any) -> bool:
    return status.get("phase") == RUNNING


@kopf.timer(GROUP, VERSION, PLURAL, interval=PROGRESS_INTERVAL, when=_is_training,
            id="job-progress")
async def on_progress(body: kopf.Body, **_: Any) -> None:
    """Rank 0's progress, read from its log: training pods have no write access to anything."""
    await RECONCILER.refresh_progress(body)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True, id="job-delete")
def on_job_deleted(uid: str, **_: Any) -> None:
    """Children go with the job through owner references; only our memory needs clearing."""
    if RECONCILER is not None:
        RECONCILER.forget(uid)
