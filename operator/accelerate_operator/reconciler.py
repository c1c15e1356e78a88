"""One reconcile pass, in four steps: parse (api.py) and snapshot (what the indexes and the
job's JobState show, snapshot.py), read (the few reads from the API server, reads.py), decide
(decide.py, pure: the one function that decides), apply (Applier, through kube/). The work
queue (workqueue.py) runs at most one pass per job at a time, so a pass owns its job's JobState
while it runs.

Level-triggered: a pass starts from what is there, never from what happened, so any event of a
job, or a requeue, may run it, and a pass with nothing to change makes no API call. The status is
written once per pass, progress included.

Applying decides nothing: it only orders the calls, runs them with bounded parallelism, and
records in the job's JobState what the next pass must know, once each write is done: what it
created, the status it wrote, when a progress write is next allowed. A child the API server
refuses for good (Pod Security, a quota, validation) ends the pass before any status is written,
recorded in the JobState: the next pass, at once, fails the job with the server's reason instead
of retrying the same pod forever."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .api import JobSpec, SpecError, parse_job
from .decide import Archive, Decision, decide
from .kube import Kube, Rejected
from .kueue import KueueView, WorkloadWrite, priority_class
from .metrics import record_status_change
from .pod_state import PodState
from .reads import read
from .report_settings import PROGRESS_WRITE_SECONDS
from .resources.logs import ARCHIVED_LINES, build_logs_configmap
from .resources.pods import DEFAULT_REPORT_ENDPOINT, ReportEndpoint
from .snapshot import Snapshot
from .state import JobState, Refusal
from .status import Event, group_attempt, merge_patch
from .timefmt import parse_time, utcnow

log = logging.getLogger("accelerate_operator")


def parse_spec(body: Mapping[str, Any], status: Mapping[str, Any]) -> JobSpec | None:
    """The parsed job, or None (logged) when it cannot be parsed or is being deleted (its
    children go with it). `status` is the latest one (our own last write may be newer than the
    body's): its topology, once resolved, is not read from the ConfigMap again."""
    metadata = body["metadata"]
    try:
        job = parse_job(body, status)
    except SpecError as error:
        log.warning("job %s/%s cannot be parsed: %s", metadata.get("namespace"),
                    metadata["name"], error)
        return None
    return None if metadata.get("deletionTimestamp") else job


# Bounded parallelism when creating many pods (JobSet uses 50): fast, without flooding the server.
CREATE_PARALLELISM = 16


class Applier:
    def __init__(self, kube: Kube, clock: Callable[[], float],
                 progress_write_seconds: float = PROGRESS_WRITE_SECONDS):
        self.kube = kube
        self.clock = clock
        self.progress_write_seconds = progress_write_seconds
        self._create_slots = asyncio.Semaphore(CREATE_PARALLELISM)

    async def apply(self, state: JobState, seen: Snapshot, decision: Decision) -> bool:
        """Carry the decision out. False when the API server refused a child: the pass ended
        there, with no status written, and the refusal is in the JobState."""
        job, outcome = seen.job, decision.outcome
        if decision.archive:
            await self._archive_logs(job, decision.archive)
        await asyncio.gather(*(self.kube.delete_pod(job.namespace, name)
                               for name in outcome.delete),
                             *(self.kube.delete_pod(job.namespace, name, grace_period_seconds=0)
                               for name in outcome.force_delete))
        for write in decision.workload_writes:  # after the deletes: a release needs no pod left
            await self._write_workload(job.namespace, write)
        # The pods mount the ConfigMap: the children first.
        for manifests in (decision.children, decision.pods):
            refused = await self._create_all(state, job, manifests)
            if refused is not None:
                state.refused = refused
                return False
        await self._create_placeholders(state, seen, decision.placeholders)
        if decision.ca_patch is not None:
            await self.kube.patch_configmap(job.namespace, *decision.ca_patch)
        if decision.status is not None:
            await self._write_status(state, seen, decision)
        await asyncio.gather(*(self.kube.tell_attempt(job.namespace, name, outcome.attempt)
                               for name in outcome.tell))
        for event in outcome.events:
            await self.kube.post_event(seen.body, event, seen.now)
        if outcome.delete_job:
            log.info("deleting %s/%s: ttlSecondsAfterFinished has passed", job.namespace, job.name)
            await self.kube.delete_job(job.namespace, job.name)
        return True

    async def _create_placeholders(self, state: JobState, seen: Snapshot,
                                   manifests: Sequence[Mapping[str, Any]]) -> None:
        """An elastic job's placeholders: one the API server refuses (no PriorityClass
        accelerate-operator-placeholder, a quota) fails nothing, the group trains on at its
        size; a Warning event says why, once per cause."""
        results = await asyncio.gather(*(self._create(m) for m in manifests),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if any(not isinstance(r, Rejected) for r in errors):
            raise next(r for r in errors if not isinstance(r, Rejected))
        if not errors or str(errors[0]) == state.placeholder_refused:
            return
        state.placeholder_refused = str(errors[0])
        log.warning("%s/%s: %s", seen.job.namespace, seen.job.name, errors[0])
        await self.kube.post_event(seen.body, Event(
            "Warning", "PlaceholderRejected",
            f"{errors[0]}; the job trains on at its reduced size, and grows back only once its "
            "placeholder pods can be created (docs: Elastic jobs)"), seen.now)

    async def _write_status(self, state: JobState, seen: Snapshot, decision: Decision) -> None:
        """The one status write; then the JobState and the metrics learn of it."""
        await self.kube.patch_job_status(seen.job.namespace, seen.job.name, decision.status)
        state.remember_status(decision.status)
        if decision.progress_written:
            state.next_progress_write = self.clock() + self.progress_write_seconds
        record_status_change(seen.status, merge_patch(seen.status, decision.status),
                             created_at=seen.created, now=seen.now)

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


class Reconciler:
    def __init__(self, kube: Kube, clock: Callable[[], float] = time.monotonic,
                 progress_write_seconds: float = PROGRESS_WRITE_SECONDS):
        self.kube = kube
        self.clock = clock
        self.applier = Applier(kube, clock, progress_write_seconds)

    @property
    def progress_write_seconds(self) -> float:
        """How often a job's status.progress is written (the Applier holds the writes to it):
        pod 0 is told to report at that pace (Controller.take_report)."""
        return self.applier.progress_write_seconds

    async def reconcile(self, state: JobState, body: Mapping[str, Any],
                        pods: Iterable[PodState], children: Iterable[tuple[str, str]] = (),
                        kueue: KueueView | None = None, *, configmap_ca: str | None = None,
                        endpoint: ReportEndpoint = DEFAULT_REPORT_ENDPOINT,
                        report_ca: str | None = None,
                        placeholders: Iterable[PodState] = ()) -> float | None:
        """Bring one job's children and status in line with its spec. `pods` (each with its
        latest report) and `children` ((kind, name) of its ConfigMaps, Services, PDB) are what
        the indexes show, `placeholders` an elastic job's placeholder pods, `kueue` what they
        show of Kueue (None: the integration is off),
        `configmap_ca` the digest of the CA bundle in its rendered ConfigMap (None: not
        indexed); the pods report to `endpoint`, whose certificate `report_ca` signs. Returns
        when time alone will next change the job (seconds), or None."""
        pods, children = list(pods), frozenset(children)
        if kueue is not None and kueue.workload is not None:
            children |= {("Workload", kueue.workload["metadata"]["name"])}
        status = state.latest_status(body.get("status") or {})
        job = parse_spec(body, status)
        if job is None:
            return None
        seen = self.snapshot(state, body, job, status, pods, children, kueue,
                             configmap_ca=configmap_ca, report_endpoint=endpoint,
                             report_ca=report_ca, placeholders=tuple(placeholders))
        seen = await read(self.kube, seen)
        decision = decide(seen)
        done = await self.applier.apply(state, seen, decision)
        state.prune_in_flight(decision.outcome.group, pods, children, self.clock())
        return decision.requeue_after if done else 0.0

    def snapshot(self, state: JobState, body: Mapping[str, Any], job: JobSpec,
                 status: Mapping[str, Any], pods: list[PodState],
                 children: frozenset[tuple[str, str]], kueue: KueueView | None,
                 **reporting: Any) -> Snapshot:
        """What the indexes and the JobState show of the job now, what this operator created
        that the indexes do not show yet included; `reporting`: where the pods report."""
        clock, now = self.clock(), utcnow()
        if kueue is not None:
            kueue = KueueView(kueue.workload, kueue.version, job.queue_name,
                              priority_class(body))
        all_pods, all_children = state.with_in_flight(group_attempt(status), pods, children,
                                                      clock)
        return Snapshot(body=body, job=job, status=status, pods=tuple(all_pods),
                        children=all_children, now=now,
                        created=parse_time(body["metadata"].get("creationTimestamp")) or now,
                        clock=clock, next_progress_write=state.next_progress_write,
                        refused=state.refused, kueue=kueue, **reporting)
