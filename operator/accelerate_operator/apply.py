"""Apply: carry a pass's Actions out through kube.py.

Decides nothing (plan.py has): it only orders the calls, runs them with bounded parallelism, and
records in the job's JobState what the next pass must know: what it created and the status it
wrote. A child the API server refuses for good (Pod Security, a quota, validation) is returned
as a value, before any status is written: the reconciler plans again with it (the job fails
with the server's reason instead of retrying the same pod forever)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from .api import JobSpec
from .kube import Kube, Rejected
from .metrics import merged, record_status_change
from .observed import Observed, Refusal
from .plan import Actions, Archive, WorkloadWrite
from .resources.logs import ARCHIVED_LINES, build_logs_configmap
from .state import JobState
from .timefmt import parse_time

log = logging.getLogger("accelerate_operator")

# Bounded parallelism when creating many pods (JobSet uses 50): fast, without flooding the server.
CREATE_PARALLELISM = 16


class Applier:
    def __init__(self, kube: Kube, clock: Callable[[], float]):
        self.kube = kube
        self.clock = clock
        self._create_slots = asyncio.Semaphore(CREATE_PARALLELISM)

    async def apply(self, state: JobState, seen: Observed, actions: Actions,
                    now: datetime) -> Refusal | None:
        """Carry the actions out. Returns the API server's refusal of a child, having written
        no status (the caller plans again with it), or None."""
        job, plan = seen.job, actions.plan
        if actions.archive:
            await self._archive_logs(job, actions.archive)
        await asyncio.gather(*(self.kube.delete_pod(job.namespace, name)
                               for name in plan.delete),
                             *(self.kube.delete_pod(job.namespace, name, grace_period_seconds=0)
                               for name in plan.force_delete))
        for write in actions.workload_writes:  # after the deletes: a release needs no pod left
            await self._write_workload(job.namespace, write)
        children = actions.children + ((actions.workload,) if actions.workload else ())
        # The pods mount the ConfigMap: the children first.
        for manifests in (children, actions.pods):
            refused = await self._create_all(state, job, manifests)
            if refused is not None:
                return refused
        if actions.status is not None:
            await self.kube.patch_job_status(job.namespace, job.name, actions.status)
            state.remember_status(actions.status)
            created = parse_time(seen.body["metadata"].get("creationTimestamp"))
            record_status_change(seen.status, merged(seen.status, actions.status),
                                 created_at=created or now, now=now)
        await asyncio.gather(*(self.kube.tell_attempt(job.namespace, name, plan.attempt)
                               for name in plan.tell))
        for event in plan.events:
            await self.kube.post_event(seen.body, event, now)
        if plan.delete_job:
            log.info("deleting %s/%s: ttlSecondsAfterFinished has passed", job.namespace, job.name)
            await self.kube.delete_job(job.namespace, job.name)
        return None

    async def _write_workload(self, namespace: str, write: WorkloadWrite) -> None:
        if write.part == "spec":
            await self.kube.patch_workload(namespace, write.name, write.body)
        elif write.part == "status-merge":
            await self.kube.patch_workload_status(namespace, write.name, write.body)
        else:
            await self.kube.apply_workload_status(namespace, write.name, write.body,
                                                  write.manager)

    async def _create_all(self, state: JobState, job: JobSpec,
                          manifests: Sequence[Mapping[str, Any]]) -> Refusal | None:
        results = await asyncio.gather(*(self._create(m) for m in manifests),
                                       return_exceptions=True)
        state.record_created([m for m, result in zip(manifests, results, strict=True)
                              if not isinstance(result, BaseException)], self.clock())
        errors = [r for r in results if isinstance(r, BaseException)]
        rejected = [r for r in errors if isinstance(r, Rejected)]
        if len(rejected) < len(errors):
            raise next(r for r in errors if not isinstance(r, Rejected))
        if rejected:
            log.warning("%s/%s: %s", job.namespace, job.name, rejected[0])
            return Refusal(rejected[0].kind, str(rejected[0]))
        return None

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
