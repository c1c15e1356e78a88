"""One reconcile pass: parse, render, plan (pure), then carry the plan out through kube.py.

Holds the operator's only in-memory state: a lock per job (a job event and a pod event must not
plan at once), the last status written per job (the job index may lag behind our own writes, and
a stale attempt number must not recreate a deleted group), and which jobs already have their
ConfigMap and Service (so a pod event costs no API call).

status.progress is not the planner's: only `refresh_progress` (the progress timer) writes it, from
rank 0's log, so a reconcile pass never writes it and never compares it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

from accelerate_trainer.config import ConfigError

from .api import JobSpec, SpecError, parse_job
from .constants import FINISHED_PHASES
from .kube import ConfigMapMissing, Kube, Rejected
from .naming import pod_name
from .progress import build_progress_status, parse_progress, progress_changed
from .resources.configmap import prepare_config
from .resources.logs import ARCHIVED_LINES, build_logs_configmap
from .resources.pods import build_pod
from .resources.service import build_service
from .status import PodState, plan_reconcile

log = logging.getLogger("accelerate_operator")

# Bounded parallelism when creating many pods (JobSet uses 50): fast, without flooding the server.
CREATE_PARALLELISM = 16
# Rank 0 prints a progress line at most every ~2 s; other output between two of them fits here.
PROGRESS_TAIL_LINES = 200


CREATED_MEMORY_SECONDS = 30.0
RESYNC_SECONDS = 30.0
PROGRESS_SECONDS = 5.0


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None, microsecond=0)


class Reconciler:
    def __init__(self, kube: Kube):
        self.kube = kube
        self._locks: dict[str, asyncio.Lock] = {}
        self._written: dict[str, dict[str, Any]] = {}
        self._children_ready: set[str] = set()
        # Jobs the clock looks at (see remember), and when each is next due.
        self._clocked: dict[str, Mapping[str, Any]] = {}
        self._next_resync: dict[str, float] = {}
        self._next_progress: dict[str, float] = {}
        # Pods created but perhaps not yet in the pod index: uid -> (attempt, {index: when}).
        self._created: dict[str, tuple[int, dict[int, float]]] = {}
        self._create_slots = asyncio.Semaphore(CREATE_PARALLELISM)

    def remember(self, body: Mapping[str, Any]) -> None:
        """Track a job for the clock while it can still change with time: unfinished (deadline,
        progress, resync), or finished with a TTL to expire."""
        uid = body["metadata"]["uid"]
        status = body.get("status") or {}
        policy = (body.get("spec") or {}).get("runPolicy") or {}
        finished = status.get("phase") in FINISHED_PHASES
        if finished and policy.get("ttlSecondsAfterFinished") is None:
            self._clocked.pop(uid, None)
            return
        if uid not in self._clocked:
            self._next_resync[uid] = time.monotonic() + RESYNC_SECONDS
        self._clocked[uid] = body

    async def tick(self, pods_of: Callable[[str, str], list[PodState]]) -> None:
        """One beat of the operator's clock (handlers.py runs it every CLOCK_SECONDS): the
        passes that time alone makes due. Deadlines and TTLs are checked on every beat (a pass
        with nothing to change makes no API call), every unfinished job is re-planned every
        RESYNC_SECONDS (event handlers are not retried, so this repeats a pass that failed on a
        passing API error), and a Running job's progress is read every PROGRESS_SECONDS."""
        now = time.monotonic()
        passes, progress = [], []
        for uid, body in list(self._clocked.items()):
            metadata = body["metadata"]
            phase = (body.get("status") or {}).get("phase")
            policy = (body.get("spec") or {}).get("runPolicy") or {}
            due = phase in FINISHED_PHASES or bool(policy.get("activeDeadlineSeconds"))
            if phase not in FINISHED_PHASES and now >= self._next_resync.get(uid, 0):
                self._next_resync[uid] = now + RESYNC_SECONDS
                due = True
            if due:
                passes.append(self.reconcile(body, pods_of(metadata["namespace"],
                                                           metadata["name"])))
            if phase == "Running" and now >= self._next_progress.get(uid, 0):
                self._next_progress[uid] = now + PROGRESS_SECONDS
                progress.append(self.refresh_progress(body))
        results = await asyncio.gather(*passes, *progress, return_exceptions=True)
        for error in results:
            if isinstance(error, Exception):
                log.warning("clock pass failed: %s", error)

    def forget(self, uid: str) -> None:
        self._clocked.pop(uid, None)
        self._next_resync.pop(uid, None)
        self._next_progress.pop(uid, None)
        self._locks.pop(uid, None)
        self._written.pop(uid, None)
        self._children_ready.discard(uid)
        self._created.pop(uid, None)

    def _with_pods_in_flight(self, uid: str, job: JobSpec, attempt_now: int,
                             pods: list[PodState]) -> list[PodState]:
        """Add the pods this operator just created that the index does not show yet, as Pending.
        Without them a pod event arriving first would plan those pods again (a 409 each) and
        patch the status twice (docs/benchmarks.md, finding 2). Entries expire after
        CREATED_MEMORY_SECONDS, so a pod deleted before the index saw it is not hidden for long."""
        attempt, created = self._created.get(uid, (None, {}))
        if attempt != attempt_now:
            self._created.pop(uid, None)  # a restart: the pods of that attempt are going
            return pods
        if not created:
            return pods
        seen = {p.index for p in pods if p.attempt == attempt}
        now = time.monotonic()
        for index, when in list(created.items()):
            if index in seen or now - when > CREATED_MEMORY_SECONDS:
                del created[index]
        return pods + [PodState(name=pod_name(job.name, index), index=index, attempt=attempt,
                                phase="Pending") for index in created]

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
            job = parse_job(body, status)
            finished = status.get("phase") in FINISHED_PHASES
            if (uid not in self._children_ready or not job.topology_resolved) and not finished:
                job = await self._ensure_children(job)
                self._children_ready.add(uid)
        except (SpecError, ConfigError, ConfigMapMissing) as error:
            config_error = str(error)
        if job is None:
            # parse_job failed on the body itself: plan with a minimal view of the job.
            log.warning("job %s/%s cannot be parsed: %s", body["metadata"].get("namespace"),
                        body["metadata"]["name"], config_error)
            return

        if body["metadata"].get("deletionTimestamp"):
            return  # the job is being deleted; its children go with it
        pods = self._with_pods_in_flight(uid, job, int(status.get("attempt") or 0), pods)
        now = utcnow()
        plan = plan_reconcile(job, status, pods, now, config_error=config_error)

        namespace = job.namespace
        previous_attempt = int(status.get("attempt") or 0)
        if plan.attempt > previous_attempt and plan.delete:
            await self._archive_logs(job, previous_attempt, pods, plan.delete)
        finishing = status.get("phase") not in FINISHED_PHASES
        if finishing and plan.status.get("phase") in FINISHED_PHASES:
            # The progress timer runs only while the job is Running: catch the last report.
            try:
                await self.refresh_progress(body)
            except Exception as error:  # best effort, like the timer
                log.warning("could not read the final progress of %s/%s: %s",
                            namespace, job.name, error)
        await asyncio.gather(*(asyncio.to_thread(self.kube.delete_pod, namespace, name)
                               for name in plan.delete))
        if plan.create:
            results = await asyncio.gather(
                *(self._create(build_pod(job, index, plan.attempt)) for index in plan.create),
                return_exceptions=True,
            )
            attempt, created = self._created.get(uid, (plan.attempt, {}))
            if attempt != plan.attempt:
                created = {}
            created.update({index: time.monotonic() for index, result in zip(
                plan.create, results, strict=True) if not isinstance(result, BaseException)})
            self._created[uid] = (plan.attempt, created)
            errors = [r for r in results if isinstance(r, BaseException)]
            rejected = [r for r in errors if isinstance(r, Rejected)]
            if len(rejected) < len(errors):
                raise next(r for r in errors if not isinstance(r, Rejected))
            if rejected:
                # Pod Security or a quota refusing the template: fail the job with the server's
                # reason rather than retrying the same pod forever.
                log.warning("%s/%s: %s", namespace, job.name, rejected[0])
                plan = plan_reconcile(job, status, pods, now, config_error=str(rejected[0]),
                                      config_error_reason="PodRejected")
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

    async def _archive_logs(self, job: JobSpec, attempt: int, pods: list[PodState],
                            deleting: Iterable[str]) -> None:
        """Keep the last lines of the pods about to be deleted for a restart, in the ConfigMap
        `<job>-logs-attempt-<attempt>`. Best effort: a restart never waits on a failed archive."""
        names = sorted({p.name for p in pods if p.attempt == attempt} & set(deleting))
        if not names:
            return
        try:
            container = _trainer_container(job.template)
            texts = await asyncio.gather(*(
                asyncio.to_thread(self.kube.read_pod_log, job.namespace, name, ARCHIVED_LINES,
                                  container=container)
                for name in names))
            manifest = build_logs_configmap(job, attempt, dict(zip(names, texts, strict=True)))
            await self._create(manifest)
        except Exception as error:  # best effort: the restart goes on
            log.warning("could not archive the logs of %s/%s attempt %d: %s",
                        job.namespace, job.name, attempt, error)

    async def refresh_progress(self, body: Mapping[str, Any]) -> None:
        """Copy rank 0's latest progress report from the tail of pod `<job>-0`'s log into
        status.progress, only when it changed (every write is an event for every watcher)."""
        metadata = body["metadata"]
        namespace, name = metadata["namespace"], metadata["name"]
        text = await asyncio.to_thread(
            self.kube.read_pod_log, namespace, pod_name(name, 0), PROGRESS_TAIL_LINES,
            container=_trainer_container((body.get("spec") or {}).get("template") or {}),
        )
        report = parse_progress(text)
        if report is None:
            return
        current = (body.get("status") or {}).get("progress") or {}
        new = build_progress_status(report, utcnow())
        if not progress_changed(current, new):
            return
        # A merge patch keeps keys it does not name: null out those the new report lacks.
        patch = {**{key: None for key in current if key not in new}, **new}
        await asyncio.to_thread(self.kube.patch_job_status, namespace, name, {"progress": patch})

    async def _create(self, manifest: Mapping[str, Any]) -> None:
        async with self._create_slots:
            await asyncio.to_thread(self.kube.create_if_absent, manifest)

    async def _ensure_children(self, job: JobSpec) -> JobSpec:
        """Create the ConfigMap and the Service; returns the job with its topology resolved
        against the accelerate YAML (read from its ConfigMap, with the files beside it)."""
        source = None
        if job.config_from:
            ref = job.config_from
            source = await asyncio.to_thread(
                self.kube.read_config_source, job.namespace, ref.name, ref.key
            )
        job, configmap = prepare_config(job, source)
        await asyncio.gather(
            self._create(configmap),
            self._create(build_service(job)),
        )
        return job


def _trainer_container(template: Mapping[str, Any]) -> str | None:
    """The first container trains (as the pod builder assumes); its name picks its log."""
    containers = (template.get("spec") or {}).get("containers") or [{}]
    return containers[0].get("name")
