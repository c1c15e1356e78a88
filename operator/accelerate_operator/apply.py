"""Apply: carry a pass's Actions out through kube.py, and read rank 0's progress (and, once per
attempt, the trainer's versions) into the status.

Decides nothing (plan.py has): it only orders the calls, runs them with bounded parallelism,
and records in Memory what the next pass must know: what it created, the status it wrote, a pod
the API server refused."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from .api import JobSpec
from .kube import Kube, Rejected
from .memory import Memory
from .naming import pod_name, trainer_container_name
from .observe import Observed
from .plan import Actions, Archive, WorkloadWrite
from .progress import (
    build_progress_status,
    build_trainer_status,
    parse_progress,
    parse_trainer_info,
    progress_changed,
)
from .resources.logs import ARCHIVED_LINES, build_logs_configmap

log = logging.getLogger("accelerate_operator")

# Bounded parallelism when creating many pods (JobSet uses 50): fast, without flooding the server.
CREATE_PARALLELISM = 16
# Rank 0 prints a progress line at most every ~2 s; other output between two of them fits here.
PROGRESS_TAIL_LINES = 200
# The trainer prints its versions first thing; pip's output may come before a second line.
TRAINER_INFO_BYTES = 64 * 1024


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None, microsecond=0)


class Applier:
    def __init__(self, kube: Kube, memory: Memory):
        self.kube = kube
        self.memory = memory
        self._create_slots = asyncio.Semaphore(CREATE_PARALLELISM)

    async def apply(self, seen: Observed, actions: Actions, now: datetime) -> bool:
        """Carry the actions out. Returns False, having written no status, when the API server
        refused a child: the refusal is kept for the next pass, which plans with it."""
        job = seen.job
        if actions.archive:
            await self._archive_logs(job, actions.archive)
        if actions.read_final_progress:
            await self._final_progress(seen.body)
        await asyncio.gather(*(self.kube.delete_pod(job.namespace, name)
                               for name in actions.delete))
        for write in actions.workload_writes:  # after the deletes: a release needs no pod left
            await self._write_workload(job.namespace, write)
        children = actions.children + ((actions.workload,) if actions.workload else ())
        for manifests in (children, actions.pods):  # the pods mount the ConfigMap
            if not await self._create_all(job, manifests):
                return False
        if actions.status is not None:
            await self.kube.patch_job_status(job.namespace, job.name, actions.status)
            self.memory.written.remember(job.uid, actions.status)
        for event in actions.events:
            await self.kube.post_event(seen.body, event, now)
        if actions.delete_job:
            log.info("deleting %s/%s: ttlSecondsAfterFinished has passed", job.namespace, job.name)
            await self.kube.delete_job(job.namespace, job.name)
        return True

    async def _write_workload(self, namespace: str, write: WorkloadWrite) -> None:
        if write.part == "spec":
            await self.kube.patch_workload(namespace, write.name, write.body)
        elif write.part == "status-merge":
            await self.kube.patch_workload_status(namespace, write.name, write.body)
        else:
            await self.kube.apply_workload_status(namespace, write.name, write.body,
                                                  write.manager)

    async def _create_all(self, job: JobSpec, manifests: Sequence[Mapping[str, Any]]) -> bool:
        results = await asyncio.gather(*(self._create(m) for m in manifests),
                                       return_exceptions=True)
        self.memory.in_flight.record(job.uid, [
            m for m, result in zip(manifests, results, strict=True)
            if not isinstance(result, BaseException)])
        errors = [r for r in results if isinstance(r, BaseException)]
        rejected = [r for r in errors if isinstance(r, Rejected)]
        if len(rejected) < len(errors):
            raise next(r for r in errors if not isinstance(r, Rejected))
        if rejected:
            # Pod Security or a quota refusing the template: the next pass fails the job with
            # the server's reason rather than retrying the same pod forever.
            log.warning("%s/%s: %s", job.namespace, job.name, rejected[0])
            self.memory.refusals.record(job.uid, str(rejected[0]))
            return False
        return True

    async def _create(self, manifest: Mapping[str, Any]) -> None:
        async with self._create_slots:
            await self.kube.create_if_absent(manifest)

    async def _archive_logs(self, job: JobSpec, archive: Archive) -> None:
        """Keep the last lines of the pods about to be deleted for a restart, in the ConfigMap
        `<job>-logs-attempt-<attempt>`. Best effort: a restart never waits on a failed archive."""
        try:
            texts = await asyncio.gather(*(
                self.kube.read_pod_log(job.namespace, name, ARCHIVED_LINES,
                                       container=archive.container)
                for name in archive.pods))
            logs = dict(zip(archive.pods, texts, strict=True))
            await self._create(build_logs_configmap(job, archive.attempt, logs))
        except Exception as error:  # best effort: the restart goes on
            log.warning("could not archive the logs of %s/%s attempt %d: %s",
                        job.namespace, job.name, archive.attempt, error)

    async def _final_progress(self, body: Mapping[str, Any]) -> None:
        """The clock reads progress only while the job is Running: catch the last report."""
        try:
            await self.refresh_progress(body)
        except Exception as error:  # best effort, like the clock's reads
            log.warning("could not read the final progress of %s/%s: %s",
                        body["metadata"]["namespace"], body["metadata"]["name"], error)

    async def refresh_progress(self, body: Mapping[str, Any]) -> None:
        """Copy rank 0's latest progress report from the tail of pod `<job>-0`'s log into
        status.progress, only when it changed (every write is an event for every watcher)."""
        metadata = body["metadata"]
        namespace, name = metadata["namespace"], metadata["name"]
        template = (body.get("spec") or {}).get("template") or {}
        await self._trainer_versions(body, template)
        text = await self.kube.read_pod_log(namespace, pod_name(name, 0), PROGRESS_TAIL_LINES,
                                            container=trainer_container_name(template))
        report = parse_progress(text)
        if report is None:
            return
        current = (body.get("status") or {}).get("progress") or {}
        new = build_progress_status(report, utcnow())
        if not progress_changed(current, new):
            return
        # A merge patch keeps keys it does not name: null out those the new report lacks.
        patch = {**{key: None for key in current if key not in new}, **new}
        await self.kube.patch_job_status(namespace, name, {"progress": patch})

    async def _trainer_versions(self, body: Mapping[str, Any], template: Mapping[str, Any]
                                ) -> None:
        """Once per attempt: the versions pod `<job>-0`'s trainer printed at the head of its log,
        into status.trainer. status.trainer.attempt records that the read was done (versions or
        not), so an image that prints none costs one read per attempt, not one per tick."""
        metadata, status = body["metadata"], body.get("status") or {}
        attempt = int(status.get("attempt") or 0)
        if (status.get("trainer") or {}).get("attempt") == attempt:
            return
        container = trainer_container_name(template)
        head = await self.kube.read_pod_log(
            metadata["namespace"], pod_name(metadata["name"], 0), None,
            container=container, limit_bytes=TRAINER_INFO_BYTES)
        if not head:
            return  # nothing logged yet: the next read tries again
        containers = (template.get("spec") or {}).get("containers") or [{}]
        trainer = build_trainer_status(parse_trainer_info(head), attempt,
                                       containers[0].get("image"))
        await self.kube.patch_job_status(metadata["namespace"], metadata["name"],
                                         {"trainer": trainer})
