"""What kopf's handlers (handlers.py) hand their events to, and the one straight path from an
event to a job's pass, as a controller-runtime reader expects:

    hands_over (does the event matter? event_filter.py, from the event alone; kopf's `when=`)
      -> on_event
      -> the work queue (workqueue.py: a job's events merge, one pass per job at a time,
         "requeue after" for what time alone changes, backoff for a pass that failed)
      -> reconcile (reads kopf's indexes) -> Reconciler.reconcile (reconciler.py)

Every write for a job happens inside its pass; what comes from elsewhere, a pod's report (the
report endpoint's `take_report`) or a renewed CA bundle (`use_report_endpoint`), only queues the
job's pass: a report that changes a decision at once, one that brings only progress for when
the next progress write is due, a sign of life alone none. The job's in-memory state is one
JobState (state.py), dropped in one place, `forget`, and all at once when this replica becomes
the active one (`set_active`: the caches sync first, cache_sync.py). No kopf import here, so it
is tested without an operator running.

One of the small pieces kopf lacks lives here, on its public API (the work queue, the index audit,
the cache sync and following kopf's peering are the others: workqueue.py, audit.py, cache_sync.py,
peering.py): **the deletion grace check.** When a job is deleted, the garbage collector deletes its
children, and their DELETED events (on other watches than the job's) can come more than a second
before the job's own: a pass run on them would recreate the children of a job that is gone. So a
pass that a deletion asked for runs DELETION_GRACE_SECONDS later, and only once the API server
confirms that the job still exists."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any, Protocol

from .apierrors import server_message
from .audit import Audit, Index
from .cache_sync import CacheSync
from .constants import KIND
from .event_filter import is_deletion, job_key
from .indexes import JobKey
from .kube import ApiException, Kube, NamespaceTerminating
from .kueue.workload import KueueView
from .metrics import observe_pass
from .naming import configmap_name
from .pod_state import PodState, with_report
from .report_checks import (
    PASS_NOW,
    PASS_WHEN_DUE,
    JobGroup,
    Refused,
    ReportBody,
    job_pod,
    may_write,
    next_report_seconds,
    pass_for_report,
)
from .report_store import BadReport, ReportStore
from .report_tokens import Caller
from .resources.pods import DEFAULT_REPORT_ENDPOINT, ReportEndpoint
from .state import JobState, JobStates
from .status import Event, group_attempt
from .timefmt import utcnow
from .workqueue import WorkQueue

log = logging.getLogger("accelerate_operator")

DELETION_GRACE_SECONDS = 1.0
# A job whose namespace is being deleted runs no pass for this long (nothing can be created
# there: the namespace controller deletes the pods and children before the jobs, and each of
# their deletions would otherwise run a pass that is refused again).
TERMINATING_NAMESPACE_SECONDS = 60.0


# A pass that keeps failing (an admission webhook whose service is down, a quota controller
# that refuses, an API server that errors) is retried with backoff; the job's own events say so
# after this many failures in a row (about 7 s of backoff), and every REPEAT after that, so a
# user reading `kubectl describe` learns why nothing happens instead of seeing no status at all.
FAILING_PASSES_FIRST_WARNING = 3
FAILING_PASSES_WARNING_REPEAT = 10


def failing_pass_event(failures: int, error: BaseException) -> Event | None:
    """The Warning a job gets when its passes keep failing, None when it is not yet due."""
    due = failures - FAILING_PASSES_FIRST_WARNING
    if due < 0 or due % FAILING_PASSES_WARNING_REPEAT:
        return None
    detail = server_message(error) if isinstance(error, ApiException) else repr(error)
    return Event("Warning", "ReconcileFailing",
                 f"the operator's last {failures} attempts to act on this job failed; it keeps "
                 f"retrying (backoff up to 60 s). The API server said: {detail}")


class Reconciler(Protocol):
    """A job's pass (reconciler.Reconciler), over what the indexes show of the job."""

    async def reconcile(self, state: JobState, body: Mapping[str, Any],
                        pods: Iterable[PodState], children: Iterable[tuple[str, str]] = (),
                        kueue: KueueView | None = None, *, configmap_ca: str | None = None,
                        endpoint: ReportEndpoint = DEFAULT_REPORT_ENDPOINT,
                        report_ca: str | None = None,
                        placeholders: Iterable[PodState] = ()) -> float | None: ...


class Controller:
    """`reconciler` runs a job's pass (reconciler.Reconciler, given by handlers.py: the
    controller only decides when)."""

    def __init__(self, kube: Kube, reconciler: Reconciler, kueue: bool = False,
                 clock: Callable[[], float] = time.monotonic, namespaces: Iterable[str] = ()):
        self.kube = kube
        self.kueue = kueue
        self.clock = clock
        self.reconciler = reconciler
        self.states = JobStates(clock)
        self.queue = WorkQueue(self.reconcile, clock=clock)
        # The pods' latest reports, taken by the report endpoint (take_report).
        self.reports = ReportStore()
        self.indexes: dict[str, Index] = {}
        namespaces = list(namespaces)
        self.audit = Audit(lambda kind: self.kube.list_owned(kind, namespaces), self.queue.add)
        # Whether this replica is the active one (peering.py); becoming it syncs the caches.
        self.active = True
        self.sync = CacheSync(lambda kind: self.kube.list_owned(kind, namespaces), clock)
        self._resuming: asyncio.Task | None = None
        # Where the pods report, and the CA bundle they must trust (None: not known yet).
        self.endpoint: ReportEndpoint = DEFAULT_REPORT_ENDPOINT
        self.report_ca: Callable[[], str | None] = lambda: None

    # ---- events (from handlers.py) ------------------------------------------------------------
    def on_event(self, kind: str, event_type: str | None, body: Mapping[str, Any]) -> None:
        """An event kopf handed over (hands_over). Level-triggered: it only says which job to
        look at; the pass starts from what is there. A deleted job is forgotten; a deleted child
        runs its job's pass after the grace check."""
        metadata = body["metadata"]
        key = job_key(kind, metadata)
        if key is None:
            return
        self.audit.seen(kind, event_type, metadata)
        if kind == "Pod" and event_type == "DELETED":
            self.reports.forget_pod(key, metadata.get("uid") or "")
        if kind == KIND and event_type == "DELETED":
            self.forget(key)
        elif is_deletion(kind, event_type, metadata):
            self.after_deletion(key, kind, event_type, metadata)
        else:
            self.queue.add(key)

    def after_deletion(self, key: JobKey, kind: str, event_type: str | None,
                       metadata: Mapping[str, Any]) -> None:
        """A pass after the grace check, for a job still indexed. One that is not (deleted
        before its children, or not listed yet: its own event runs its pass) needs none."""
        body = self.job_body(key)
        if body is None:
            return
        state = self.states.get(key, body["metadata"]["uid"])
        if event_type == "DELETED":
            state.gone(kind, metadata)
        state.check_exists = True
        self.queue.add_after(key, DELETION_GRACE_SECONDS)

    def forget(self, key: JobKey) -> None:
        self.states.forget(key)
        self.queue.forget(key)
        self.reports.forget_job(key)

    # ---- peering (handlers.py follows it: peering.py) -------------------------------------------
    def set_active(self, active: bool) -> None:
        """Whether this replica is the active one. Paused, it runs no pass. Becoming active, it
        drops what it kept of its last active spell (the jobs' states, the pods' reports: the
        other replica acted since, and the pods reported to it) and runs no pass until kopf's
        indexes show what the API server lists (cache_sync.py) and the index audit has hidden the
        ghosts of what was deleted meanwhile (audit.py); then every job's pass runs."""
        if self._resuming is not None:
            self._resuming.cancel()
            self._resuming = None
        self.queue.paused = True
        self.active = active
        if active:
            self.states = JobStates(self.clock)
            self.reports = ReportStore()
            self._resuming = asyncio.create_task(self._resume(), name="cache sync")

    async def _resume(self) -> None:
        await self.sync.wait(self.indexes)
        await self.audit.run_once()  # what was deleted while paused: no pass sees its ghost
        self.queue.paused = False
        for key in list(self.indexes.get("job_bodies") or ()):
            self.queue.add(key)

    # ---- from the report endpoint (report_server.py) ------------------------------------------
    @property
    def paused(self) -> bool:
        """Another replica is the active one (peering.py): it takes the reports. While the
        caches sync, this one takes them already: they wait for its passes."""
        return not self.active

    def report_pod(self, key: JobKey, caller: Caller) -> PodState:
        """The caller's pod (the one its token is bound to) when it is a live pod the operator
        made for the job, of its current group; else Refused 403, or 404 for a job not indexed
        (report_checks.job_pod). Asked before the report's body is read."""
        body, group = self.job_body(key), self.current_group(key)
        if body is None or group is None:
            return job_pod(caller, key[0], key[1], None)
        topology = (body.get("status") or {}).get("topology") or {}
        nodes = topology.get("numNodes") or (body.get("spec") or {}).get("numNodes")
        return job_pod(caller, key[0], key[1], JobGroup(
            group[0], group[1], nodes if isinstance(nodes, int) else None,
            self.pod_entries(key)))

    def take_report(self, key: JobKey, pod: PodState, body: ReportBody,
                    now: datetime) -> float | None:
        """A report of `pod` (report_pod's answer), parsed: kept as the pod's latest, and the
        job's pass queued now when the report changes a decision, or for when a progress write
        is due when it brings only what the status shows (report_checks.pass_for_report).
        Returns, for pod 0, the seconds until its next progress report is due (the job's next
        progress write: report_checks.next_report_seconds). Refused 403 for what that pod may
        not write (progress from a pod other than 0), 400 for a trainerStatus that contradicts
        itself."""
        may_write(pod, body, key[1])
        before = self.reports.text(pod.uid)
        try:
            if body.report is not None:
                self.reports.take_report(key, pod.uid, body.report, now)
            if body.trainer_status is not None:
                self.reports.take_trainer_status(key, pod.uid, body.trainer_status, now)
        except BadReport as error:
            raise Refused(400, f"trainerStatus: {error}") from None
        when = pass_for_report(before, self.reports.text(pod.uid) or "")
        state, clock = self.states.peek(key), self.clock()
        next_write = state.next_progress_write if state is not None else 0.0
        if when == PASS_NOW:
            self.queue.add(key)
        elif when == PASS_WHEN_DUE:
            self.queue.add_after(key, max(0.0, next_write - clock))
        return next_report_seconds(clock, next_write, self.reconciler.progress_write_seconds) \
            if pod.index == 0 else None

    def use_report_endpoint(self, endpoint: ReportEndpoint,
                            report_ca: Callable[[], str | None]) -> None:
        """Where the pods report from now on, and the CA bundle they must trust (read at each
        pass). Every job's pass runs: each brings its ConfigMap up to the bundle (decide.py);
        call it again when the bundle changes."""
        self.endpoint, self.report_ca = endpoint, report_ca
        for key in list(self.indexes.get("job_bodies") or ()):
            self.queue.add(key)

    # ---- what a pass reads ------------------------------------------------------------------
    def _values(self, index: str, key: JobKey) -> list[Any]:
        found = self.indexes[index].get(key) if index in self.indexes else None
        return list(found or ())

    def job_body(self, key: JobKey) -> Mapping[str, Any] | None:
        """The job as kopf's index shows it; not the ghost of one deleted while unwatched."""
        bodies = [body for body in self._values("job_bodies", key) if not self._ghost(body)]
        return bodies[0] if bodies else None

    def _ghost(self, job: Mapping[str, Any]) -> bool:
        """A job the index audit found deleted while unwatched."""
        metadata = job["metadata"]
        return self.audit.hides(KIND, metadata.get("namespace") or "", metadata["name"],
                                metadata.get("uid"))

    def pods_of(self, key: JobKey, uid: str) -> list[PodState]:
        """The job's pods, each with its latest report. A pod of an earlier job of the same
        name (deleted, its pods still terminating) is no pod of this one: the pass sees it as a
        stale pod on its way out, so the new group waits for the name without counting the
        deletion as a failure."""
        pods = [with_report(state, self.reports.text(state.uid)) if owner == uid
                else replace(state, attempt=-1, deleting=True)
                for owner, state in self.pod_entries(key)]
        self.reports.keep_only(key, [p.uid for p in pods if p.attempt != -1])
        return pods

    def placeholders_of(self, key: JobKey, uid: str) -> list[PodState]:
        """An elastic job's placeholder pods (an earlier job's of the same name left out)."""
        return [state for owner, state in self._values("job_placeholders", key)
                if owner == uid and not self.audit.hides("Pod", key[0], state.name, state.uid)]

    def pod_entries(self, key: JobKey) -> list[tuple[str | None, PodState]]:
        """(owner uid, pod) of every pod indexed under the job's key, ghosts left out."""
        return [(owner, state) for owner, state in self._values("job_pods", key)
                if not self.audit.hides("Pod", key[0], state.name, state.uid)]

    def current_group(self, key: JobKey) -> tuple[str, int] | None:
        """(job uid, the attempt of its current pods) as the latest status says, our own last
        write included; None for a job not indexed."""
        body = self.job_body(key)
        if body is None:
            return None
        uid, state = body["metadata"]["uid"], self.states.peek(key)
        status = body.get("status") or {}
        if state is not None and state.uid == uid:
            status = state.latest_status(status)
        return uid, group_attempt(status)

    def children_of(self, key: JobKey) -> tuple[set[tuple[str, str]], str | None]:
        """(kind, name) of the job's ConfigMaps, Services and PDB, and the digest of the report
        CA bundle its rendered ConfigMap holds (None: not indexed)."""
        children, ca = set(), None
        for kind, index in (("ConfigMap", "job_configmaps"), ("Service", "job_services"),
                            ("PodDisruptionBudget", "job_pdbs")):
            for value in self._values(index, key):
                name = value[0] if kind == "ConfigMap" else value
                if not self.audit.hides(kind, key[0], name):
                    children.add((kind, name))
                    if name == configmap_name(key[1]) and kind == "ConfigMap":
                        ca = value[1]
        return children, ca

    def kueue_of(self, key: JobKey, uid: str) -> KueueView | None:
        """The job's Workload, None when the Kueue integration is off."""
        if not self.kueue:
            return None
        owned = [workload for owner, workload in self._values("job_workloads", key)
                 if owner == uid and not self.audit.hides(
                     "Workload", key[0], workload["metadata"]["name"],
                     workload["metadata"].get("uid"))]
        return KueueView(workload=owned[0] if owned else None, version=self.kube.kueue_version)

    def job_bodies(self) -> list[Any]:
        """Every job as kopf's index shows it (metadata and status), for the jobs{phase} and
        goodput gauges. Read from the metrics server's thread: list() snapshots each view in one
        step under the GIL."""
        index = self.indexes.get("job_bodies")
        if index is None:
            return []
        return [body for bodies in list(index.values()) for body in list(bodies)
                if not self._ghost(body)]

    # ---- the pass -----------------------------------------------------------------------------
    async def reconcile(self, key: Hashable) -> float | None:
        """The job's pass, from what the indexes show now; none for a job that is gone.
        Returns when time alone will next change the job (seconds), or None."""
        body = self.job_body(key)
        if body is None:
            self.forget(key)
            return None
        uid = body["metadata"]["uid"]
        state = self.states.get(key, uid)
        paused_for = state.terminating_until - self.clock()
        if paused_for > 0:
            return paused_for  # the namespace is being deleted: nothing can be created there
        if state.check_exists:
            state.check_exists = False
            if not await self.kube.job_exists(key[0], key[1], uid):
                return None
        started = time.perf_counter()
        try:
            return await self._pass(state, key, body)
        finally:
            observe_pass(time.perf_counter() - started)

    async def _pass(self, state: JobState, key: JobKey, body: Mapping[str, Any]
                    ) -> float | None:
        """The Reconciler's pass. One that fails is retried by the queue with backoff; the
        job's events say so once failures persist (failing_pass_event)."""
        uid = body["metadata"]["uid"]
        children, ca = self.children_of(key)
        try:
            return await self.reconciler.reconcile(
                state, body, self.pods_of(key, uid), children, self.kueue_of(key, uid),
                configmap_ca=ca, endpoint=self.endpoint, report_ca=self.report_ca(),
                placeholders=self.placeholders_of(key, uid))
        except NamespaceTerminating:
            log.info("namespace %s is being deleted: job %s waits", key[0], key[1])
            state.terminating_until = self.clock() + TERMINATING_NAMESPACE_SECONDS
            return TERMINATING_NAMESPACE_SECONDS
        except Exception as error:
            # The queue counts the failures in a row (its backoff); this one is not in it yet.
            event = failing_pass_event(self.queue.num_requeues(key) + 1, error)
            if event is not None:
                await self.kube.post_event(body, event, utcnow())
            raise

    # ---- the whole run ----------------------------------------------------------------------
    def start(self, indexes: Mapping[str, Index]) -> None:
        """kopf's indexes (as its start-up handler receives them), then the workers."""
        self.indexes = dict(indexes)
        self.queue.start()
        self.audit.start(self.indexes)

    async def stop(self) -> None:
        if self._resuming is not None:
            self._resuming.cancel()
        await self.audit.stop()
        await self.queue.stop()
        await self.kube.close()
