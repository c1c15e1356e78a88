"""What kopf's handlers (handlers.py) hand their events to, and the one straight path from an
event to a job's pass, as a controller-runtime reader expects:

    hands_over (does the event matter? decided here, from the event alone; kopf's `when=`)
      -> on_event
      -> the work queue (workqueue.py: a job's events merge, one pass per job at a time,
         "requeue after" for what time alone changes, backoff for a pass that failed)
      -> reconcile (reads kopf's indexes) -> Reconciler.reconcile (reconciler.py)

Every write for a job happens inside its pass. The job's in-memory state is one JobState
(state.py), dropped in one place, `forget`. No kopf import here, so it is tested without an
operator running.

Two of the small pieces kopf lacks live here, each on its public API (the work queue and
following kopf's peering are the others: workqueue.py, peering.py):
- **The deletion grace check.** When a job is deleted, the garbage collector deletes its
  children, and their DELETED events (on other watches than the job's) can come more than a
  second before the job's own: a pass run on them would recreate the children of a job that is
  gone. So a pass that a deletion asked for runs DELETION_GRACE_SECONDS later, and only once
  the API server confirms that the job still exists.
- **The index audit.** After a watch's resourceVersion expired (410), or when a standby resumes,
  kopf lists again, but an object deleted while it was not watching stays in its indexes for
  good (nothing ever reports its deletion). A pass planning from such a ghost pod would wait
  for it forever. So the owned collections are listed AUDIT_DELAY_SECONDS after kopf re-lists
  (its listing events carry type None) and every AUDIT_SECONDS anyway; indexed objects the
  listing lacks are ghosts: the passes no longer see them, and their jobs are reconciled."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import replace
from typing import Any, Protocol

from accelerate_trainer.contract import ATTEMPT_LABEL, JOB_NAME_LABEL

from .apierrors import server_message
from .constants import KIND, PENDING
from .kube import ApiException, Kube, NamespaceTerminating
from .kueue import KUEUE_GROUP, KUEUE_VERSION, QueueContext
from .metrics import observe_pass
from .observed import PodState, group_attempt, read_pod_state, read_process_exit
from .reconciler import Reconciler
from .report_store import ReportStore
from .state import JobState, JobStates
from .status import Event
from .timefmt import utcnow
from .workqueue import WorkQueue

log = logging.getLogger("accelerate_operator")

DELETION_GRACE_SECONDS = 1.0
AUDIT_SECONDS = 300.0
AUDIT_DELAY_SECONDS = 5.0
# A job whose namespace is being deleted runs no pass for this long (nothing can be created
# there: the namespace controller deletes the pods and children before the jobs, and each of
# their deletions would otherwise run a pass that is refused again).
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
# Children whose creation or change the pass does not read: only their deletion (or a listing)
# runs it.
_CREATED_ONLY = ("ConfigMap", "Service", "PodDisruptionBudget")

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
    """The uid of the AccelerateJob that is the object's controller (the operator sets
    `controller: true`; another ownerReference of that kind makes no one the owner)."""
    return next((ref.get("uid") for ref in metadata.get("ownerReferences") or []
                 if ref.get("kind") == KIND and ref.get("controller") is True), None)


def lean_workload(body: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": body.get("apiVersion") or f"{KUEUE_GROUP}/{KUEUE_VERSION}",
            "metadata": lean_metadata(body["metadata"]),
            "spec": {"active": (body.get("spec") or {}).get("active", True)},
            "status": body.get("status") or {}}


def pod_entry(body: Mapping[str, Any]) -> tuple[str | None, PodState]:
    return owner_uid(body["metadata"]), read_pod_state(body)


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


def job_key(kind: str, metadata: Mapping[str, Any]) -> JobKey | None:
    """The job an event is about: the job itself, or the owner of a child (its label)."""
    if kind == KIND:
        return metadata.get("namespace") or "", metadata["name"]
    return owning_job(metadata)


def event_matters(kind: str, event_type: str | None, body: Mapping[str, Any]) -> bool:
    """Whether an event (not a deletion) must run its job's pass, from the event alone.
    - A job: created, listed, or its spec changed since a pass last planned from it (its
      generation is not the status's observedGeneration), as controller-runtime's
      GenerationChangedPredicate: the echo of our own status write runs none.
    - A pod: unless it is ADDED just as it was created (unscheduled, no condition): its creator,
      a pass, knows it already; what happens to it next runs the pass. Listed, it always does.
    - A Workload: always. The queue merges a burst of events, and a pass with nothing to
      change makes no API call.
    - A ConfigMap, Service or PDB: only listed (type None, kopf listed again); created or
      changed, it runs none (the pass that created it knows)."""
    if kind == KIND:
        status = body.get("status") or {}
        return (event_type != "MODIFIED"
                or body["metadata"].get("generation") != status.get("observedGeneration"))
    if kind == "Pod" and event_type == "ADDED":
        return not _as_created(body)
    return kind not in _CREATED_ONLY or event_type is None


def _as_created(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return (not (pod.get("spec") or {}).get("nodeName") and not status.get("conditions")
            and status.get("phase", PENDING) == PENDING)


def hands_over(kind: str, event_type: str | None, body: Mapping[str, Any]) -> bool:
    """Whether an event reaches the controller at all: the one decision, used by kopf as its
    `when=` filter (handlers.py), so kopf invokes no handler for an event that changes nothing.
    A job deleted, a child deleted or being deleted, or an event that matters."""
    metadata = body["metadata"]
    return ((kind == KIND and event_type == "DELETED") or is_deletion(kind, event_type, metadata)
            or event_matters(kind, event_type, body))


def is_deletion(kind: str, event_type: str | None, metadata: Mapping[str, Any]) -> bool:
    """A child deleted or being deleted: it may be going with its job (the grace check)."""
    return kind != KIND and (event_type == "DELETED"
                             or bool(metadata.get("deletionTimestamp")))


class Controller:
    def __init__(self, kube: Kube, kueue: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.kube = kube
        self.kueue = kueue
        self.clock = clock
        self.reconciler = Reconciler(kube, clock)
        self.states = JobStates(clock)
        self.queue = WorkQueue(self.reconcile, clock=clock)
        # The pods' latest reports, taken by the report endpoint (report_server.py).
        self.reports = ReportStore()
        self.indexes: dict[str, Index] = {}
        self._ghosts: set[tuple[str, str, str]] = set()  # (kind, namespace, name)
        self._audit_due: asyncio.TimerHandle | None = None
        self._tasks: list[asyncio.Task] = []

    # ---- events (from handlers.py) ------------------------------------------------------------
    def on_event(self, kind: str, event_type: str | None, body: Mapping[str, Any]) -> None:
        """An event kopf handed over (hands_over). Level-triggered: it only says which job to
        look at; the pass starts from what is there. A deleted job is forgotten; a deleted child
        runs its job's pass after the grace check."""
        metadata = body["metadata"]
        key = job_key(kind, metadata)
        if key is None:
            return
        self._seen(kind, event_type, metadata)
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
        pods = [self._with_report(state) if owner == uid
                else replace(state, attempt=-1, deleting=True)
                for owner, state in self.pod_entries(key)]
        self.reports.keep_only(key, [p.uid for p in pods if p.attempt != -1])
        return pods

    def pod_entries(self, key: JobKey) -> list[tuple[str | None, PodState]]:
        """(owner uid, pod) of every pod indexed under the job's key, ghosts left out."""
        return [(owner, state) for owner, state in self._values("job_pods", key)
                if ("Pod", key[0], state.name) not in self._ghosts]

    def _with_report(self, pod: PodState) -> PodState:
        """The pod with what it last reported to the endpoint (the passes read no report from
        the pod object)."""
        text = self.reports.text(pod.uid)
        if text is None:
            return pod
        return replace(pod, report=text, exit=read_process_exit(text, pod.name))

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

    def job_bodies(self) -> list[Any]:
        """Every job as kopf's index shows it (metadata and status), for the jobs{phase} and
        goodput gauges. Read from the metrics server's thread: list() snapshots each view in one
        step under the GIL."""
        index = self.indexes.get("job_bodies")
        if index is None:
            return []
        return [body for bodies in list(index.values()) for body in list(bodies)]

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
        waiting = state.terminating_until - self.clock()
        if waiting > 0:
            return waiting  # the namespace is being deleted: nothing can be created there
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
        try:
            after = await self.reconciler.reconcile(state, body, self.pods_of(key, uid),
                                                    self.children_of(key),
                                                    self.queue_of(key, uid))
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
        return after

    # ---- the index audit ----------------------------------------------------------------------
    def _seen(self, kind: str, event_type: str | None, metadata: Mapping[str, Any]) -> None:
        """An event proves the object is no ghost; a listing event (type None) means kopf has
        listed again: audit soon."""
        if self._ghosts:
            self._ghosts.discard((kind, metadata.get("namespace") or "", metadata["name"]))
        if event_type is None and self._audit_due is None and self._tasks:
            self._audit_due = asyncio.get_running_loop().call_later(
                AUDIT_DELAY_SECONDS, self._start_audit)

    def _indexed(self, kind: str, index: str) -> dict[tuple[str, str], JobKey]:
        """(namespace, name) -> job key of every object of a kind the indexes show."""
        found: dict[tuple[str, str], JobKey] = {}
        source = self.indexes.get(index)
        for key in list(source or ()):
            for value in source.get(key) or ():
                if kind == "Pod":
                    name = value[1].name
                elif kind == "Workload":
                    name = value[1]["metadata"]["name"]
                else:
                    name = value
                found[(key[0], name)] = key
        return found

    def _audited_kinds(self) -> list[tuple[str, str, str, str]]:
        kinds = [("Pod", "job_pods", "/api/v1/pods", POD_SELECTOR),
                 ("Service", "job_services", "/api/v1/services", SERVICE_SELECTOR),
                 ("ConfigMap", "job_configmaps", "/api/v1/configmaps", CONFIGMAP_SELECTOR),
                 ("PodDisruptionBudget", "job_pdbs", "/apis/policy/v1/poddisruptionbudgets",
                  PDB_SELECTOR)]
        if self.kueue and "job_workloads" in self.indexes:
            kinds.append(("Workload", "job_workloads",
                          f"/apis/{self.kube.kueue_group}/{self.kube.kueue_version}/workloads",
                          WORKLOAD_SELECTOR))
        return kinds

    async def audit(self) -> int:
        """List the owned collections once; every indexed object the lists lack becomes a ghost
        the passes no longer see, and its job is reconciled. Returns the ghosts found."""
        kinds = self._audited_kinds()
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
        self._ghosts &= {(kind, ns, name) for kind, index, *_ in kinds
                         for (ns, name) in self._indexed(kind, index)}
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

    async def _audit_every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            await self._audit_once()

    # ---- the whole run ----------------------------------------------------------------------
    def start(self, indexes: Mapping[str, Index]) -> None:
        """kopf's indexes (as its start-up handler receives them), then the workers."""
        self.indexes = dict(indexes)
        self.queue.start()
        self._tasks = [asyncio.create_task(self._audit_every(AUDIT_SECONDS),
                                           name="index audit every 5 minutes")]

    async def stop(self) -> None:
        if self._audit_due is not None:
            self._audit_due.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.queue.stop()
        await self.kube.close()
