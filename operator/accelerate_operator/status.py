"""Decide, from the job and its pods alone, what the job's status is and what must change.

Pure: `plan_reconcile(job, status, pods, now)` takes everything as arguments (the clock too) and
returns a Plan; kube.py carries it out. Running it twice on the same input gives the same plan,
so a restarted operator, or two events arriving together, never double-count a restart.

The group is the unit: one failed, evicted or deleted pod stops and recreates every pod under a
new attempt number, so all ranks meet in a fresh rendezvous (a lone restarted rank never rejoins
a torchrun static rendezvous).

A job queued with Kueue (`QueueState`) runs only while its Workload is admitted: before that, and
after an eviction, it has no pod. Stopping a group for Kueue starts a new attempt without
counting a restart: an eviction is not a failure."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from accelerate_trainer.contract import ATTEMPT_LABEL, CONFIG_ERROR_EXIT_CODE, NODE_INDEX_LABEL

from .api import JobSpec, build_topology_status
from .constants import (
    CONDITION_TYPES,
    CREATED,
    FAILED,
    FINISHED_PHASES,
    PENDING,
    QUEUED,
    RESTARTING,
    RUNNING,
    SUCCEEDED,
    SUSPENDED,
)
from .kueue import WorkloadView, pods_ready_reason


@dataclass(frozen=True)
class PodState:
    """What the planner needs to know of one pod."""

    name: str
    index: int
    attempt: int
    phase: str
    ready: bool = False
    deleting: bool = False
    exit_code: int | None = None
    reason: str | None = None
    message: str | None = None

    @property
    def finished(self) -> bool:
        return self.phase in (SUCCEEDED, FAILED)


@dataclass(frozen=True)
class Failure:
    pod: str
    reason: str
    exit_code: int | None = None
    message: str | None = None

    def describe(self) -> str:
        text = f"pod {self.pod} {self.reason}"
        if self.exit_code is not None:
            text += f" with exit code {self.exit_code}"
        if self.message:
            text += f": {self.message.strip()}"
        return text


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class QueueState:
    """A job labelled with a LocalQueue, and its Workload as Kueue's status shows it (None while
    it does not exist)."""

    name: str
    workload: WorkloadView | None = None


@dataclass(frozen=True)
class QueueWrites:
    """What Kueue must be told: create the Workload, set its spec.active (the user's suspend),
    give an evicted Workload's quota back, set PodsReady, mark it Finished (reason, message)."""

    create: bool = False
    active: bool | None = None
    release: bool = False
    pods_ready: bool | None = None
    finished: tuple[str, str] | None = None


@dataclass(frozen=True)
class Plan:
    status: dict[str, Any]
    attempt: int
    create: tuple[int, ...] = ()
    delete: tuple[str, ...] = ()
    events: tuple[Event, ...] = ()
    delete_job: bool = False
    requeue_after: float | None = None
    queue: QueueWrites = field(default_factory=QueueWrites)


def _active_write(workload: WorkloadView, wants_active: bool) -> bool | None:
    """The spec.active to write, or None. Written only when the user's suspend differs from
    what the operator last asked (the Workload's requested-active annotation): a Workload Kueue
    deactivated stays deactivated until the user suspends and resumes the job, or reactivates
    the Workload. A Workload with no record (made by an older operator) is written when it
    differs, unless Kueue's conditions say Kueue deactivated it."""
    if workload.finished:
        return None
    if workload.requested_active is not None:
        return wants_active if workload.requested_active != wants_active else None
    if workload.active == wants_active or workload.deactivated is not None:
        return None
    return wants_active


def read_pod_state(pod: Mapping[str, Any]) -> PodState:
    """Summarise a Pod manifest: phase, readiness, and the trainer's exit code and message."""
    metadata = pod.get("metadata", {})
    labels = metadata.get("labels") or {}
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    exit_code = reason = message = None
    ended: dict[str, int | None] = {}  # container name -> exit code, for each one that ended
    for container in status.get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated is not None:
            ended[container.get("name")] = terminated.get("exitCode")
        if terminated and (exit_code is None or terminated.get("exitCode", 0) != 0):
            exit_code = terminated.get("exitCode")
            reason = terminated.get("reason")
            message = terminated.get("message")
    if status.get("reason"):  # Evicted, DeadlineExceeded, NodeLost... set on the pod itself
        reason = status["reason"]
        message = status.get("message") or message
    return PodState(
        name=metadata.get("name", ""),
        index=int(labels.get(NODE_INDEX_LABEL, -1)),
        attempt=int(labels.get(ATTEMPT_LABEL, 0)),
        phase=settled_phase(pod.get("spec") or {}, status, ended) or status.get("phase") or PENDING,
        ready=ready,
        deleting=bool(metadata.get("deletionTimestamp")),
        exit_code=exit_code,
        reason=reason,
        message=message,
    )


def settled_phase(spec: Mapping[str, Any], status: Mapping[str, Any],
                  ended: Mapping[str, int | None]) -> str | None:
    """Succeeded or Failed as soon as every container of the pod has terminated (ended: name ->
    exit code), else None; None too once the kubelet itself reports a terminal phase.

    Our pods run with restartPolicy Never, so no container runs again once it has ended, and the
    kubelet's own rule for that policy (getPhase: all containers terminated, any non-zero exit
    -> Failed, else Succeeded) gives the phase it will report. It reports the terminated
    containers first and the phase only after the pod's sandbox is torn down, on a later
    relist: about a second in which the job would wait for nothing (issue 15)."""
    if status.get("phase") in (SUCCEEDED, FAILED) or spec.get("restartPolicy") != "Never":
        return None
    names = {c.get("name") for c in spec.get("containers") or []}
    if not names or set(ended) != names:
        return None
    return SUCCEEDED if all(code == 0 for code in ended.values()) else FAILED


def format_time(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=None)


class _StatusBuilder:
    """Accumulates the new status and the events its transitions deserve."""

    def __init__(self, job: JobSpec, status: Mapping[str, Any], now: datetime):
        self.job = job
        self.now = now
        self.status = copy.deepcopy(dict(status))
        self.status["observedGeneration"] = job.generation
        if job.topology_resolved:
            self.status["topology"] = build_topology_status(job)
        self.previous_phase = status.get("phase")
        self.events: list[Event] = []
        self.conditions = {c["type"]: dict(c) for c in status.get("conditions") or []}

    def condition(self, type_: str, value: bool, reason: str, message: str) -> bool:
        """Set a condition; returns whether its status changed."""
        wanted = "True" if value else "False"
        current = self.conditions.get(type_)
        if current is None and not value:
            return False  # a condition that never happened is simply absent
        changed = current is None or current.get("status") != wanted
        if changed:
            transition = format_time(self.now)
        else:
            transition = current.get("lastTransitionTime", format_time(self.now))
        self.conditions[type_] = {
            "type": type_,
            "status": wanted,
            "reason": reason,
            "message": message,
            "lastTransitionTime": transition,
            "observedGeneration": self.job.generation,
        }
        return changed

    def phase(self, phase: str, reason: str, message: str, warning: bool = False) -> None:
        """Enter `phase`: set its condition True, clear the other live ones, emit an event."""
        self.status["phase"] = phase
        if phase != PENDING:
            self.condition(phase, True, reason, message)
        for other in (QUEUED, RUNNING, RESTARTING, SUSPENDED):
            if other != phase and other in self.conditions:
                self.condition(other, False, reason, message)
        if phase != self.previous_phase or (
            warning and self.status.get("lastFailure") != message
        ):
            self.events.append(Event("Warning" if warning else "Normal", reason, message))

    def counts(self, pods: Sequence[PodState]) -> None:
        active = [p for p in pods if not p.finished and not p.deleting]
        ready = [p for p in active if p.phase == RUNNING and p.ready]
        self.status["nodes"] = {
            "active": len(active),
            "ready": len(ready),
            "succeeded": sum(p.phase == SUCCEEDED for p in pods),
            "failed": sum(p.phase == FAILED for p in pods),
        }
        self.status["readyNodes"] = f"{len(ready)}/{self.job.num_nodes}"

    def finish(self) -> dict[str, Any]:
        self.status["conditions"] = [
            self.conditions[t] for t in CONDITION_TYPES if t in self.conditions
        ]
        self.status.setdefault("restarts", 0)
        return self.status


def _failures(job: JobSpec, current: Sequence[PodState], was_running: bool) -> list[Failure]:
    failures = [
        Failure(p.name, "failed" if not p.reason or p.reason == "Error" else f"failed ({p.reason})",
                p.exit_code, p.message)
        for p in sorted(current, key=lambda p: p.index)
        if p.phase == FAILED
    ]
    if was_running:
        # Once the group runs, a pod that disappears (deleted, evicted, its node gone) takes its
        # ranks with it: the others would wait in their collectives forever.
        present = {p.index for p in current if not p.deleting or p.finished}
        for index in range(job.num_nodes):
            if index not in present:
                failures.append(Failure(f"{job.name}-{index}", "was deleted"))
    return failures


def _cleanup(job: JobSpec, pods: Sequence[PodState]) -> tuple[str, ...]:
    policy = job.run_policy.clean_pod_policy
    if policy == "None":
        return ()
    return tuple(
        p.name for p in pods
        if not p.deleting and (policy == "All" or not p.finished)
    )


class _Pass:
    """One planning pass: the status being built, the attempt and restart counters, and the
    steps plan_reconcile goes through. Each step that decides the pass returns its Plan."""

    def __init__(self, job: JobSpec, status: Mapping[str, Any], pods: Sequence[PodState],
                 now: datetime, queue: QueueState | None = None):
        self.job, self.pods, self.now, self.queue = job, list(pods), now, queue
        self.out = _StatusBuilder(job, status, now)
        self.status = status
        self.attempt = int(status.get("attempt") or 0)
        self.restarts = int(status.get("restarts") or 0)
        self.release = False

    def done(self, create=(), delete=(), delete_job=False, requeue_after=None) -> Plan:
        self.out.status["attempt"] = self.attempt
        status = self.out.finish()
        if requeue_after is None and status.get("phase") not in FINISHED_PHASES:
            requeue_after = self._seconds_to_deadline()
        return Plan(status, self.attempt, tuple(create), tuple(delete), tuple(self.out.events),
                    delete_job, requeue_after, self._queue_writes(status))

    def _queue_writes(self, status: Mapping[str, Any]) -> QueueWrites:
        if self.queue is None:
            return QueueWrites()
        workload = self.queue.workload
        phase = status.get("phase")
        if workload is None:
            return QueueWrites(create=phase not in FINISHED_PHASES)
        wants_active = not self.job.run_policy.suspend
        finished = None
        if phase in FINISHED_PHASES and not workload.finished:
            condition = next((c for c in status.get("conditions") or [] if c["type"] == phase),
                             {})
            finished = (phase, condition.get("message") or phase)
        pods_ready = None
        running = phase == RUNNING
        if workload.admitted and not workload.finished and phase not in FINISHED_PHASES and (
                workload.pods_ready is not None or running) and (
                workload.pods_ready != running
                or workload.pods_ready_reason != pods_ready_reason(workload, running)[0]):
            pods_ready = running
        return QueueWrites(active=_active_write(workload, wants_active),
                           release=self.release, pods_ready=pods_ready, finished=finished)

    def fail(self, reason: str, message: str) -> Plan:
        self.out.phase(FAILED, reason, message, warning=True)
        self.out.status["completionTime"] = format_time(self.now)
        self.out.counts(self.pods)
        return self.done(delete=_cleanup(self.job, self.pods))

    def _deadline(self) -> datetime | None:
        seconds = self.job.run_policy.active_deadline_seconds
        started = parse_time(self.status.get("startTime"))
        return started + timedelta(seconds=seconds) if seconds and started else None

    def _seconds_to_deadline(self) -> float | None:
        """When the active deadline will need a pass of its own (the clock's requeue)."""
        deadline = self._deadline()
        return max((deadline - self.now).total_seconds(), 0.0) if deadline else None

    def finished(self) -> Plan:
        """A finished job only cleans up, and deletes itself when its TTL has passed."""
        self.out.counts(self.pods)
        ttl = self.job.run_policy.ttl_seconds_after_finished
        finished_at = parse_time(self.status.get("completionTime"))
        delete_job, requeue = False, None
        if ttl is not None and finished_at:
            expires = finished_at + timedelta(seconds=ttl)
            delete_job = self.now >= expires
            requeue = None if delete_job else (expires - self.now).total_seconds()
        return self.done(delete=_cleanup(self.job, self.pods), delete_job=delete_job,
                         requeue_after=requeue)

    def suspend(self) -> Plan:
        self.out.counts(self.pods)
        self.out.phase(SUSPENDED, "Suspended",
                       "spec.runPolicy.suspend is true: pods deleted; set it to false to resume")
        return self.done(delete=[p.name for p in self.pods if not p.deleting])

    def resume(self) -> None:
        """A fresh group: pods of the suspended attempt may still be terminating."""
        self.attempt += 1
        self.out.condition(SUSPENDED, False, "Resumed",
                           "spec.runPolicy.suspend is false: starting a fresh group")
        self.out.events.append(
            Event("Normal", "Resumed", f"starting a fresh group (attempt {self.attempt})"))
        self.out.status["phase"] = PENDING
        self.out.previous_phase = PENDING

    def queue_gate(self) -> Plan | None:
        """A queued job's group runs only while Kueue admits its Workload. Returns the Plan when
        the queue decides the pass (the group must not run), None when it may run."""
        queue, out = self.queue, self.out
        workload = queue.workload
        recorded = dict(self.status.get("queue") or {})
        out.status["queue"] = {
            "name": queue.name,
            **({"workload": workload.name} if workload else {}),
            **({"clusterQueue": workload.cluster_queue} if workload and workload.cluster_queue
               else {}),
            **({"flavors": list(workload.flavors)} if workload and workload.flavors else {}),
            **({"evictions": recorded["evictions"]} if "evictions" in recorded else {}),
        }
        admitted = workload is not None and workload.admitted and workload.evicted is None
        if admitted and not self.job.run_policy.suspend:
            if out.previous_phase == QUEUED:
                flavors = ", ".join(workload.flavors) or "no flavor"
                message = (f"Kueue admitted workload {workload.name} in ClusterQueue "
                           f"{workload.cluster_queue} ({flavors}): starting all "
                           f"{self.job.num_nodes} node(s)")
                out.condition(QUEUED, False, "Admitted", message)
                out.events.append(Event("Normal", "Admitted", message))
                out.status["phase"] = out.previous_phase = PENDING
            return None
        # The group must not run: stop every pod. Pods of the current attempt still running
        # make this a new attempt (the next group restarts from the last checkpoint), and no
        # restart is counted.
        current = [p for p in self.pods if p.attempt == self.attempt]
        if any(not p.deleting and not p.finished for p in current):
            self.attempt += 1
            if workload is not None and workload.evicted is not None:
                out.status["queue"]["evictions"] = int(recorded.get("evictions") or 0) + 1
        live = [p for p in self.pods if not p.deleting and not p.finished]
        self.release = bool(workload and workload.evicted and workload.reserved and not live)
        if self.job.run_policy.suspend:
            return self.suspend()
        out.counts([p for p in self.pods if p.attempt == self.attempt])
        if workload is not None and workload.deactivated is not None:
            self._held_by_kueue(workload)
        elif workload is not None and workload.evicted is not None:
            evicted, entering = workload.evicted, out.previous_phase != QUEUED
            reason = evicted.reason or "Evicted"
            message = (f"Kueue evicted workload {workload.name} ({reason}): {evicted.message}; "
                       "the pods are stopped and the group restarts from its last checkpoint "
                       "when Kueue admits it again")
            out.phase(QUEUED, reason, message)
            if entering:  # one Warning per eviction, not one per pass
                out.events[-1] = Event("Warning", reason, message)
        elif workload is None:
            out.phase(QUEUED, "WorkloadCreated",
                      f"waiting for Kueue: LocalQueue {queue.name}, workload being created")
        else:
            pending = workload.pending
            out.phase(QUEUED, pending.reason if pending else "Pending",
                      f"waiting for Kueue to admit workload {workload.name} in LocalQueue "
                      f"{queue.name}" + (f": {pending.message}" if pending else ""))
        return self.done(delete=[p.name for p in self.pods if not p.deleting])

    def _held_by_kueue(self, workload: WorkloadView) -> None:
        """Kueue deactivated the Workload (requeuing limit, maximum execution time, a rejected
        admission check...): the job is held, with Kueue's reason, until the Workload is made
        active again; the operator never undoes Kueue's decision (`_active_write`)."""
        out, deactivated = self.out, workload.deactivated
        previous = out.conditions.get(QUEUED) or {}
        entering = out.previous_phase != QUEUED
        message = (f"Kueue deactivated workload {workload.name} ({deactivated.reason})"
                   + (f": {deactivated.message}" if deactivated.message else "")
                   + "; the job is held with no pod. To run it again, reactivate the Workload "
                   f"(kubectl patch workload {workload.name} --type merge "
                   "-p '{\"spec\":{\"active\":true}}'), or delete the job")
        out.phase(QUEUED, deactivated.reason, message)
        if entering:  # one Warning per deactivation, not one per pass
            out.events[-1] = Event("Warning", deactivated.reason, message)
        elif previous.get("reason") != deactivated.reason:
            out.events.append(Event("Warning", deactivated.reason, message))

    def deadline_exceeded(self) -> Plan | None:
        deadline = self._deadline()
        if deadline is None or self.now < deadline:
            return None
        return self.fail("DeadlineExceeded",
                         f"the job ran longer than spec.runPolicy.activeDeadlineSeconds "
                         f"({self.job.run_policy.active_deadline_seconds}s)")

    def group(self) -> Plan:
        """The pods of the current attempt: restart on a failure, else wait, create, or
        report how far the group is."""
        current = [p for p in self.pods if p.attempt == self.attempt]
        stale = [p for p in self.pods if p.attempt != self.attempt]
        failures = _failures(self.job, current, self.out.previous_phase == RUNNING)
        if failures:
            return self.restart_or_fail(failures[0])
        if stale:
            # Wait until the previous attempt's pods are gone: the new ones reuse their names.
            self.out.counts(current)
            return self.done(delete=[p.name for p in stale if not p.deleting])
        return self.progress(current)

    def restart_or_fail(self, first: Failure) -> Plan:
        policy = self.job.run_policy
        self.out.status["lastFailure"] = first.describe()
        if first.exit_code == CONFIG_ERROR_EXIT_CODE:
            return self.fail("InvalidConfig", first.describe())
        if first.exit_code is not None and first.exit_code in policy.permanent_exit_codes:
            return self.fail("PermanentFailure",
                             f"{first.describe()} (listed in spec.runPolicy.permanentExitCodes)")
        if self.restarts >= policy.backoff_limit:
            return self.fail("BackoffLimitExceeded",
                             f"{first.describe()}; no restarts left "
                             f"(spec.runPolicy.backoffLimit={policy.backoff_limit})")
        self.restarts += 1
        self.attempt += 1
        self.out.status["restarts"] = self.restarts
        self.out.counts(self.pods)
        self.out.phase(RESTARTING, "PodFailed",
                       f"{first.describe()}; restarting all {self.job.num_nodes} node(s) "
                       f"(restart {self.restarts} of {policy.backoff_limit})", warning=True)
        return self.done(delete=[p.name for p in self.pods if not p.deleting])

    def progress(self, current: list[PodState]) -> Plan:
        job, out = self.job, self.out
        present = {p.index for p in current}
        create = [i for i in range(job.num_nodes) if i not in present]
        # Count the pods this pass creates as Pending: the next pass, which sees them, then finds
        # nothing to change and writes nothing.
        out.counts(current + [PodState(f"{job.name}-{i}", i, self.attempt, PENDING)
                              for i in create])
        if create and not present:
            out.status.setdefault("startTime", format_time(self.now))
        if create or current:
            message = f"ConfigMap, headless Service and {job.num_nodes} pod(s) created"
            if out.condition(CREATED, True, "PodsCreated", message):
                out.events.append(Event("Normal", "PodsCreated", message))
        succeeded = sum(p.phase == SUCCEEDED for p in current)
        running = sum(p.phase in (RUNNING, SUCCEEDED) for p in current)
        if succeeded == job.num_nodes:
            out.phase(SUCCEEDED, "AllNodesSucceeded",
                      f"all {job.num_nodes} node(s) finished training successfully")
            out.status["completionTime"] = format_time(self.now)
            return self.done(delete=_cleanup(job, current))
        if running == job.num_nodes and not create:
            out.phase(RUNNING, "AllNodesRunning",
                      f"all {job.num_nodes} node(s) running, {job.world_size} process(es) in total")
            return self.done()
        if out.previous_phase not in (RESTARTING,):
            out.status["phase"] = PENDING
        return self.done(create=create)


def plan_reconcile(
    job: JobSpec,
    status: Mapping[str, Any],
    pods: Sequence[PodState],
    now: datetime,
    *,
    config_error: str | None = None,
    config_error_reason: str = "InvalidConfig",
    queue: QueueState | None = None,
) -> Plan:
    """The whole decision for one pass; `config_error` is set when the accelerate config (or
    anything else only the operator can check) means the job cannot run. `requeue_after` says
    when time alone will change the decision (a TTL or a deadline), for the operator's clock.
    `queue` is set for a job queued with Kueue: its group runs only while admitted."""
    run = _Pass(job, status, pods, now, queue)
    if run.out.previous_phase in FINISHED_PHASES:
        return run.finished()
    if config_error:
        return run.fail(config_error_reason, config_error)
    if queue is not None:
        gated = run.queue_gate()
        if gated is not None:
            return gated
    if job.run_policy.suspend:
        return run.suspend()
    if run.out.previous_phase == SUSPENDED:
        run.resume()
    return run.deadline_exceeded() or run.group()
