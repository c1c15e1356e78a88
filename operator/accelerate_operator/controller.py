"""What kopf's handlers (handlers.py) hand their events to: the work queue, each job's JobState,
and the view of kopf's indexes that a pass reads. No kopf import here, so it is tested without an
operator running.

Four small pieces kopf lacks, each on its public API:
- **The deletion grace check** (docs/benchmarks.md, finding 11). When a job is deleted, the
  garbage collector deletes its children, and their DELETED events (on other watches than the
  job's) can come more than a second before the job's own: a pass run on them would recreate
  the children of a job that is gone. So a pass that a deletion asked for (a pod or child
  deleted, a pod being deleted) runs DELETION_GRACE_SECONDS later, and only once the API server
  confirms that the job still exists.
- **Skipping events that change nothing a pass reads**: a pod event whose state is one the
  last pass planned from (a Pending pod's scheduling condition, kubelet heartbeats) runs none.
- **The index audit.** After a watch's resourceVersion expired (410), or when a standby resumes,
  kopf lists again, but an object deleted while it was not watching stays in its indexes for
  good (nothing ever reports its deletion). A pass planning from such a ghost pod would wait
  for it forever. So the owned collections are listed AUDIT_DELAY_SECONDS after kopf re-lists
  (its listing events carry type None) and every AUDIT_SECONDS anyway; indexed objects the
  listing lacks are ghosts: the passes no longer see them, and their jobs are reconciled.
- **Namespaces being deleted.** The namespace controller deletes a namespace's pods before its
  jobs, so each job's pass, after the grace check, would create its pods again, be refused
  ("being terminated"), and write its status: a GET, two refused creates and a patch per job.
  The first refusal ends its pass and marks the namespace; passes of its jobs are not run for
  TERMINATING_NAMESPACE_SECONDS after it. A job created there later (its ADDED event: a
  namespace being deleted accepts no new object, so it is a new namespace of the same name)
  ends the mark at once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import replace
from typing import Any, Protocol

from accelerate_trainer.contract import ATTEMPT_LABEL, JOB_NAME_LABEL

from .apierrors import server_message
from .apply import utcnow
from .constants import GROUP, KIND
from .heap import release_freed_memory
from .kube import ApiError, Kube, NamespaceTerminating
from .kueue import KUEUE_GROUP, KUEUE_VERSION, QueueContext
from .metrics import observe_pass, record_watch_restart
from .reconciler import Reconciler
from .state import JobStates
from .status import Event, PodState, read_pod_state
from .workqueue import WorkQueue

log = logging.getLogger("accelerate_operator")

LEGACY_FINALIZER = f"{GROUP}/finalizer"
DELETION_GRACE_SECONDS = 1.0
AUDIT_SECONDS = 300.0
AUDIT_DELAY_SECONDS = 5.0
# The heap is trimmed at each look (every TRIM_LOOK_SECONDS) while the jobs and children held
# fall, and at this many looks after (Controller._trim).
TRIM_LOOK_SECONDS = 10.0
TRIMS_AFTER_SETTLING = 6
# No pass of a job runs this long after its namespace refused a create for being deleted; a
# deletion held up longer (a finalizer) costs a few refused passes a minute, not one per event.
TERMINATING_NAMESPACE_SECONDS = 60.0
# kubectl apply keeps a full copy of the object in this annotation; nothing here reads it.
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"

# What each owned kind is watched with (server-side, settings.watching.label_selectors) and
# listed with by the audit. The logs archived at a restart are never recreated: not followed.
POD_SELECTOR = JOB_NAME_LABEL
SERVICE_SELECTOR = JOB_NAME_LABEL
CONFIGMAP_SELECTOR = f"{JOB_NAME_LABEL},!{ATTEMPT_LABEL}"
WORKLOAD_SELECTOR = JOB_NAME_LABEL
PDB_SELECTOR = JOB_NAME_LABEL

JobKey = tuple[str, str]  # (namespace, job name)


class Index(Protocol):
    """What a pass reads of a kopf.Index: the values indexed under a key."""

    def get(self, key: Hashable, default: Any = None) -> Iterable[Any] | None: ...


# ---- what the indexes keep of each object (pure; handlers.py's index functions) -------------
def lean_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """managedFields are most of an object's metadata, and nothing here reads them."""
    lean = {key: value for key, value in metadata.items() if key != "managedFields"}
    annotations = lean.get("annotations")
    if annotations and LAST_APPLIED in annotations:
        lean["annotations"] = {k: v for k, v in annotations.items() if k != LAST_APPLIED}
    return lean


def lean_job(body: Mapping[str, Any]) -> dict[str, Any]:
    return {"metadata": lean_metadata(body["metadata"]), "spec": body.get("spec") or {},
            "status": body.get("status") or {}}


def owning_job(metadata: Mapping[str, Any]) -> JobKey | None:
    """The job an object belongs to, by its job-name label."""
    name = (metadata.get("labels") or {}).get(JOB_NAME_LABEL)
    return (metadata.get("namespace") or "", name) if name else None


def owner_uid(metadata: Mapping[str, Any]) -> str | None:
    return next((ref.get("uid") for ref in metadata.get("ownerReferences") or []
                 if ref.get("kind") == KIND), None)


def lean_workload(body: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": body.get("apiVersion") or f"{KUEUE_GROUP}/{KUEUE_VERSION}",
            "metadata": lean_metadata(body["metadata"]),
            "spec": {"active": (body.get("spec") or {}).get("active", True)},
            "status": body.get("status") or {}}


def pod_entry(body: Mapping[str, Any]) -> tuple[str | None, PodState]:
    return owner_uid(body["metadata"]), read_pod_state(body)


class PauseTracker(logging.Handler):
    """Follows kopf's peering: while it has paused this operator (another replica is active),
    the work queue runs no pass. kopf reports pausing and resuming only in its peering log (its
    toggles are not public API), so this reads those two records; tests/unit/test_runtime.py
    checks that the installed kopf still logs them. An upstreamable alternative is described in
    docs/benchmarks.md (a public "paused" flag on kopf's operator)."""

    LOGGER = "kopf._core.engines.peering"

    def __init__(self, queue: WorkQueue) -> None:
        super().__init__(level=logging.INFO)
        self.queue = queue

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Pausing"):
            self.queue.paused = True
        elif message.startswith("Resuming"):
            self.queue.paused = False


class WatchRestartCounter(logging.Handler):
    """Counts kopf's watch restarts for the watch_restarts_total metric: kopf says when a
    watch's resourceVersion expired (410) and it lists again only in a debug record of its
    watching module (tests/unit/test_runtime.py pins the message). The logger is set to DEBUG
    for this handler alone: its records do not propagate, and its warnings and errors are
    passed on to the root logger as before."""

    LOGGER = "kopf._cogs.clients.watching"
    PREFIX = "Restarting the watch-stream for "

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self.PREFIX):
            resource = message[len(self.PREFIX):].split(" ", 1)[0]
            record_watch_restart(resource.split(".", 1)[0].split("/", 1)[0] or "other")
        if record.levelno >= logging.WARNING:
            logging.getLogger().handle(record)

    @classmethod
    def install(cls) -> WatchRestartCounter:
        """Idempotent: one counter per process, however often the operator starts in it (tests
        run it in-process several times), so no restart is counted twice."""
        logger = logging.getLogger(cls.LOGGER)
        installed = next((h for h in logger.handlers if isinstance(h, cls)), None)
        if installed is not None:
            return installed
        handler = cls(level=logging.DEBUG)
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        return handler


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
    detail = server_message(error) if isinstance(error, ApiError) else repr(error)
    return Event("Warning", "ReconcileFailing",
                 f"the operator's last {failures} attempts to act on this job failed; it keeps "
                 f"retrying (backoff up to 60 s). The API server said: {detail}")


class Controller:
    def __init__(self, kube: Kube, kueue: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.kube = kube
        self.kueue = kueue
        self.clock = clock
        self.reconciler = Reconciler(kube, clock)
        self.states = JobStates(clock)
        self.queue = WorkQueue(self.reconcile, clock=clock, on_failure=self._warn_if_failing)
        self.indexes: dict[str, Index] = {}
        self._check_exists: set[JobKey] = set()
        self._ghosts: set[tuple[str, str, str]] = set()  # (kind, namespace, name)
        self._audit_due: asyncio.TimerHandle | None = None
        self._tasks: list[asyncio.Task] = []
        self._held_at_last_look = 0
        self._trims_after_settling = 0
        self._terminating: dict[str, float] = {}  # namespace -> when a create was refused

    # ---- what a pass reads ------------------------------------------------------------------
    def _values(self, index: str, key: JobKey) -> list[Any]:
        found = self.indexes[index].get(key) if index in self.indexes else None
        return list(found or ())

    def job_body(self, key: JobKey) -> Mapping[str, Any] | None:
        bodies = self._values("job_bodies", key)
        return bodies[0] if bodies else None

    def pods_of(self, key: JobKey, uid: str) -> list[PodState]:
        """The job's pods. A pod of an earlier job of the same name (deleted, its pods still
        terminating) is no pod of this one: the pass sees it as a stale pod on its way out, so
        the new group waits for the name without counting the deletion as a failure."""
        return [state if owner == uid else replace(state, attempt=-1, deleting=True)
                for owner, state in self._values("job_pods", key)
                if ("Pod", key[0], state.name) not in self._ghosts]

    def children_of(self, key: JobKey) -> set[tuple[str, str]]:
        return {(kind, name) for kind, index in (("ConfigMap", "job_configmaps"),
                                                 ("Service", "job_services"),
                                                 ("PodDisruptionBudget", "job_pdbs"))
                for name in self._values(index, key) if (kind, key[0], name) not in self._ghosts}

    def queue_of(self, key: JobKey, uid: str) -> QueueContext | None:
        """The job's Workload, None when the Kueue integration is off."""
        if not self.kueue:
            return None
        owned = [workload for owner, workload in self._values("job_workloads", key)
                 if owner == uid and ("Workload", key[0], workload["metadata"]["name"])
                 not in self._ghosts]
        return QueueContext(workload=owned[0] if owned else None,
                            version=self.kube.kueue_version)

    async def reconcile(self, key: Hashable) -> float | None:
        """The job's pass, from what the indexes show now; none for a job that is gone."""
        body = self.job_body(key)
        if body is None:
            self.forget(key)
            return None
        uid = body["metadata"]["uid"]
        wait = self._terminating_wait(key[0])
        if wait is not None:
            return wait  # the namespace is being deleted: nothing can be created there
        if key in self._check_exists:
            self._check_exists.discard(key)
            if not await self.kube.job_exists(key[0], key[1], uid):
                return None
        state = self.states.get(key, uid)
        started = time.perf_counter()
        try:
            return await self.reconciler.reconcile(state, body, self.pods_of(key, uid),
                                                   self.children_of(key), self.queue_of(key, uid))
        except NamespaceTerminating:
            if key[0] not in self._terminating:  # passes that started before the first refusal
                log.info("namespace %s is being deleted: no pass of its jobs for %.0f s",
                         key[0], TERMINATING_NAMESPACE_SECONDS)
            self._terminating[key[0]] = self.clock()
            return TERMINATING_NAMESPACE_SECONDS
        finally:
            observe_pass(time.perf_counter() - started)

    def _terminating_wait(self, namespace: str) -> float | None:
        """Seconds left of the mark of a namespace being deleted, or None: no (live) mark. An
        ended mark is dropped here."""
        marked = self._terminating.get(namespace)
        if marked is None:
            return None
        left = marked + TERMINATING_NAMESPACE_SECONDS - self.clock()
        if left > 0:
            return left
        del self._terminating[namespace]
        return None

    async def _warn_if_failing(self, key: Hashable, failures: int, error: Exception) -> None:
        """The work queue retries a failed pass with backoff; the job's events say so once it
        persists (failing_pass_event)."""
        event = failing_pass_event(failures, error)
        body = self.job_body(key)
        if event is not None and body is not None:
            await self.kube.post_event(body, event, utcnow())

    def job_statuses(self) -> list[Any]:
        """Every job's status as kopf's index shows it, for the jobs{phase} gauge. Read from the
        metrics server's thread: list() snapshots each view in one step under the GIL."""
        index = self.indexes.get("job_bodies")
        if index is None:
            return []
        return [body.get("status") for bodies in list(index.values()) for body in list(bodies)]

    # ---- events (from handlers.py) ------------------------------------------------------------
    def on_job(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Level-triggered: every event of a job (created, its spec changed, listed at start-up,
        changed by anyone else) runs its pass; a pass with nothing to change makes no API call.
        The echo of our own last status write runs none (JobState.written_version)."""
        key = (body["metadata"].get("namespace") or "", body["metadata"]["name"])
        if event_type == "DELETED":
            self.forget(key)
            return
        if event_type == "ADDED":
            self._terminating.pop(key[0], None)  # created: the namespace is a live one
        if self.job_event_matters(event_type, body):
            self.queue.add(key)

    # ---- which events reach the handlers (kopf's `when` filters, handlers.py) ----------------
    # An event these answer False for would change nothing: kopf then skips invoking the
    # handler (its per-event handler machinery, docs/benchmarks.md). The handlers below still
    # decide for themselves, so they hold without the filters.
    def job_event_matters(self, event_type: str | None, body: Mapping[str, Any]) -> bool:
        """Every job event but the echo of our own last status write."""
        if event_type != "MODIFIED":
            return True
        metadata = body["metadata"]
        state = self.states.peek((metadata.get("namespace") or "", metadata["name"]))
        return state is None or not state.is_echo(body)

    def pod_event_matters(self, event_type: str | None, body: Mapping[str, Any]) -> bool:
        """A pod listed (kopf listed again: an audit is due), deleted or being deleted, or in
        a state the last pass did not plan from (PodState.decisive); any event while a ghost is
        suspected."""
        metadata = body["metadata"]
        if event_type in (None, "DELETED") or metadata.get("deletionTimestamp") or self._ghosts:
            return True
        key = owning_job(metadata)
        state = self.states.peek(key) if key is not None else None
        return state is None or not state.planned(read_pod_state(body))

    def child_event_matters(self, event_type: str | None) -> bool:
        """A ConfigMap, Service or PodDisruptionBudget listed or deleted: their other events
        (created, changed) run no pass."""
        return event_type in (None, "DELETED") or bool(self._ghosts)

    def on_pod(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A pod created, scheduled, started, ended: its job's pass runs now. One deleted or
        being deleted may be going with its job: that pass waits for the grace check."""
        metadata = body["metadata"]
        key = owning_job(metadata)
        if key is None:
            return
        self._seen(event_type, "Pod", metadata)
        state = self.states.peek(key)
        if event_type == "DELETED" and state is not None:
            state.gone("Pod", metadata)
        if event_type == "DELETED" or metadata.get("deletionTimestamp"):
            self.after_deletion(key)
            return
        if state is not None and state.planned(read_pod_state(body)):
            return
        self.queue.add(key)

    def on_child(self, event_type: str | None, kind: str, body: Mapping[str, Any]) -> None:
        """A ConfigMap, Service or PodDisruptionBudget deleted (by hand, say): the job's pass
        recreates it. A Workload admitted or evicted: the pass acts on it."""
        metadata = body["metadata"]
        key = owning_job(metadata)
        if key is None:
            return
        self._seen(event_type, kind, metadata)
        if event_type == "DELETED":
            state = self.states.peek(key)
            if state is not None:
                state.gone(kind, metadata)
            self.after_deletion(key)
        elif kind == "Workload":
            self.queue.add(key)

    def after_deletion(self, key: JobKey) -> None:
        """A pass after the grace check, for a job still indexed. One that is not (deleted
        before its children, or not listed yet: its own event runs its pass) needs none; the
        check's entry would have outlived it (one key per deleted job, for good)."""
        if self.job_body(key) is None:
            return
        self._check_exists.add(key)
        self.queue.add_after(key, DELETION_GRACE_SECONDS)

    def forget(self, key: JobKey) -> None:
        self.states.forget(key)
        self.queue.forget(key)
        self._check_exists.discard(key)

    def _seen(self, event_type: str | None, kind: str, metadata: Mapping[str, Any]) -> None:
        """An event proves the object is no ghost; a listing event (type None) means kopf has
        listed again: audit soon."""
        if self._ghosts:
            self._ghosts.discard((kind, metadata.get("namespace") or "", metadata["name"]))
        if event_type is None and self._audit_due is None and self._tasks:
            self._audit_due = asyncio.get_running_loop().call_later(
                AUDIT_DELAY_SECONDS, self._start_audit)

    # ---- the index audit ----------------------------------------------------------------------
    def _indexed(self, kind: str, index: str) -> dict[tuple[str, str], JobKey]:
        """(namespace, name) -> job key of every object of a kind the indexes show."""
        found: dict[tuple[str, str], JobKey] = {}
        source = self.indexes.get(index)
        if source is None:
            return found
        for key in list(source):
            for value in source.get(key) or ():
                if kind == "Pod":
                    name = value[1].name
                elif kind == "Workload":
                    name = value[1]["metadata"]["name"]
                else:
                    name = value
                found[(key[0], name)] = key
        return found

    async def audit(self) -> int:
        """List the owned collections once; every indexed object the lists lack becomes a ghost
        the passes no longer see, and its job is reconciled. Returns the ghosts found."""
        kinds = [("Pod", "job_pods", "/api/v1/pods", POD_SELECTOR),
                 ("Service", "job_services", "/api/v1/services", SERVICE_SELECTOR),
                 ("ConfigMap", "job_configmaps", "/api/v1/configmaps", CONFIGMAP_SELECTOR),
                 ("PodDisruptionBudget", "job_pdbs", "/apis/policy/v1/poddisruptionbudgets",
                  PDB_SELECTOR)]
        if self.kueue and "job_workloads" in self.indexes:
            kinds.append(("Workload", "job_workloads",
                          f"/apis/{self.kube.kueue_group}/{self.kube.kueue_version}/workloads",
                          WORKLOAD_SELECTOR))
        found = 0
        for kind, index, path, selector in kinds:
            before = self._indexed(kind, index)  # what was indexed before the list started
            if not before:
                continue
            listed = {item async for item in self.kube.list_names(path, selector)}
            for (namespace, name), key in before.items():
                if (namespace, name) not in listed and (kind, namespace, name) not in self._ghosts:
                    log.info("%s %s/%s is gone but still indexed (deleted while unwatched): "
                             "no pass sees it any more", kind, namespace, name)
                    self._ghosts.add((kind, namespace, name))
                    self.queue.add(key)
                    found += 1
        # Ghosts whose index entry has gone (their name indexed again as a new object clears
        # them in _seen) are forgotten.
        indexed = {(kind, ns, name) for kind, index, *_ in kinds
                   for (ns, name) in self._indexed(kind, index)}
        self._ghosts &= indexed
        return found

    def _start_audit(self) -> None:
        self._audit_due = None
        self._tasks.append(asyncio.create_task(self._audit_once(), name="index audit"))

    async def _audit_once(self) -> None:
        try:
            await self.audit()
        except Exception as error:  # the next audit tries again
            log.warning("index audit failed: %r", error)
        finally:
            self._tasks = [t for t in self._tasks if not t.done()]

    async def _every(self, seconds: float, work: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(seconds)
            result = work()
            if asyncio.iscoroutine(result):
                await result

    def _objects_held(self) -> int:
        """The jobs and the children kopf's indexes hold for them."""
        children = sum(len(index.get(key) or ()) for index in list(self.indexes.values())
                       for key in list(index))
        return len(self.states) + children

    def _trim(self) -> None:
        """Fewer jobs and children than at the last look (jobs finished or deleted): hand the
        memory of those gone back to the system (heap.py), and again at each look of the
        minute after they stopped falling. A deletion frees memory after its last object is
        gone, for a while: kopf's watch events and workers for it, the pods' deletions after
        their job's, the connections the burst opened (closed when idle). With a trim only
        while the count fell, what those freed stayed resident: 6-8 MiB after a burst of 500
        jobs (docs/benchmarks.md, finding 15)."""
        for namespace in list(self._terminating):  # marks no pass looked up since they ended
            self._terminating_wait(namespace)
        held = self._objects_held()
        falling = held < self._held_at_last_look
        if falling or self._trims_after_settling:
            release_freed_memory()
        self._trims_after_settling = (TRIMS_AFTER_SETTLING if falling
                                      else max(0, self._trims_after_settling - 1))
        self._held_at_last_look = held

    # ---- the whole run ----------------------------------------------------------------------
    def start(self, indexes: Mapping[str, Index]) -> None:
        """kopf's indexes (as its start-up handler receives them), then the workers."""
        self.indexes = dict(indexes)
        self.queue.start()
        self._tasks = [asyncio.create_task(self._every(AUDIT_SECONDS, self._audit_once),
                                           name="index audit every 5 minutes"),
                       asyncio.create_task(self._every(TRIM_LOOK_SECONDS, self._trim),
                                           name="heap trim")]

    async def stop(self) -> None:
        if self._audit_due is not None:
            self._audit_due.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.queue.stop()
        await self.kube.close()
