"""One reconcile pass: parse, render, plan (pure), then carry the plan out through kube.py.

Holds the operator's only in-memory state: a lock per job (a job event and a pod event must not
plan at once), the last status written per job (the job index may lag behind our own writes, and
a stale attempt number must not recreate a deleted group), and which jobs already have their
ConfigMap and Service (so a pod event costs no API call)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

from accelerate_trainer.config import ConfigError, parse_accelerate_yaml

from .api import JobSpec, SpecError, parse_job
from .kube import ConfigMapMissing, Kube
from .resources.configmap import build_configmap, render_accelerate_config
from .resources.pods import build_pod
from .resources.service import build_service
from .status import PodState, plan_reconcile

log = logging.getLogger("accelerate_operator")

# Bounded parallelism when creating many pods (JobSet uses 50): fast, without flooding the server.
CREATE_PARALLELISM = 16


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None, microsecond=0)


class Reconciler:
    def __init__(self, kube: Kube):
        self.kube = kube
        self._locks: dict[str, asyncio.Lock] = {}
        self._written: dict[str, dict[str, Any]] = {}
        self._children_ready: set[str] = set()
        self._create_slots = asyncio.Semaphore(CREATE_PARALLELISM)

    def forget(self, uid: str) -> None:
        self._locks.pop(uid, None)
        self._written.pop(uid, None)
        self._children_ready.discard(uid)

    async def reconcile(self, body: Mapping[str, Any], pods: Iterable[PodState]) -> None:
        uid = body["metadata"]["uid"]
        lock = self._locks.setdefault(uid, asyncio.Lock())
        async with lock:
            await self._reconcile(body, list(pods))

    def _latest_status(self, uid: str, status: Mapping[str, Any]) -> dict[str, Any]:
        """The job's status as of our last write, unless the server already shows a newer one."""
        written = self._written.get(uid)
        if written and int(written.get("attempt", 0)) >= int(status.get("attempt") or 0):
            return {**dict(status), **written}
        return dict(status)

    async def _reconcile(self, body: Mapping[str, Any], pods: list[PodState]) -> None:
        uid = body["metadata"]["uid"]
        status = self._latest_status(uid, body.get("status") or {})
        config_error = None
        job: JobSpec | None = None
        try:
            job = parse_job(body)
            if uid not in self._children_ready and status.get("phase") not in ("Succeeded", "Failed"):
                await self._ensure_children(job)
                self._children_ready.add(uid)
        except (SpecError, ConfigError, ConfigMapMissing) as error:
            config_error = str(error)
        if job is None:
            # parse_job failed on the body itself: plan with a minimal view of the job.
            log.warning("job %s/%s cannot be parsed: %s", body["metadata"].get("namespace"),
                        body["metadata"]["name"], config_error)
            return

        now = utcnow()
        plan = plan_reconcile(job, status, pods, now, config_error=config_error)

        namespace = job.namespace
        await asyncio.gather(*(asyncio.to_thread(self.kube.delete_pod, namespace, name)
                               for name in plan.delete))
        if plan.create:
            await asyncio.gather(*(self._create(build_pod(job, index, plan.attempt))
                                   for index in plan.create))
        public = {k: v for k, v in plan.status.items() if k != "progress"}
        previous = {k: v for k, v in status.items() if k != "progress"}
        if public != previous:
            await asyncio.to_thread(self.kube.patch_job_status, namespace, job.name, public)
            self._written[uid] = public
        for event in plan.events:
            await asyncio.to_thread(self.kube.post_event, body, event, now)
        if plan.delete_job:
            log.info("deleting %s/%s: ttlSecondsAfterFinished has passed", namespace, job.name)
            await asyncio.to_thread(self.kube.delete_job, namespace, job.name)

    async def _create(self, manifest: Mapping[str, Any]) -> None:
        async with self._create_slots:
            await asyncio.to_thread(self.kube.create_if_absent, manifest)

    async def _ensure_children(self, job: JobSpec) -> None:
        if job.config_from:
            ref = job.config_from
            text = await asyncio.to_thread(
                self.kube.read_configmap_key, job.namespace, ref.name, ref.key
            )
            user_config = parse_accelerate_yaml(
                text, source=f"ConfigMap {ref.name!r} key {ref.key!r}"
            )
        else:
            user_config = dict(job.accelerate_config or {})
        rendered = render_accelerate_config(job, user_config)
        await asyncio.gather(
            self._create(build_configmap(job, rendered)),
            self._create(build_service(job)),
        )
