"""Decide, from the job and its pods alone, what the job's status is and what must change.

Pure: `plan_reconcile(job, status, pods, now)` takes everything as arguments (the clock too) and
returns a Plan; apply.py carries it out. Running it twice on the same input gives the same plan,
so a restarted operator, or two events arriving together, never double-count a restart.

One pass (`_Pass`) goes: a finished job only cleans up; a job that cannot run fails; a queued
job's group runs only while Kueue admits it (queueing.py); a suspended job stops its pods; past
its deadline it fails; else the group's steps decide (group.py): restart, stall, create, run,
succeed. The status and the events it builds are status.py's StatusBuilder."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from .api import JobSpec
from .constants import FAILED, FINISHED_PHASES, PENDING, SUSPENDED
from .group import GroupSteps, pods_to_clean
from .observed import NodeState, PodState, group_attempt
from .queueing import QueueState, QueueSteps, QueueWrites
from .starting import StartSteps
from .status import CONFIG_WARNINGS, CONFIG_WARNINGS_REASON, Event, StatusBuilder
from .timefmt import format_time, parse_time


@dataclass(frozen=True)
class Activity:
    """What the runtime last saw of rank 0, for stall detection: `last_activity` the timestamp of
    the newest line of pod <job>-0's trainer log (read with timestamps=true), or of the newest
    progress report, whichever is later; `last_step` the newest step rank 0 reported. Both None
    until the runtime has read anything of the current attempt."""

    last_activity: datetime | None = None
    last_step: int | None = None


@dataclass(frozen=True)
class Plan:
    """The planner's decision: the new status, the attempt, the pods to create and delete, the
    events, the Kueue writes and when time alone changes it. plan.py wraps it in the Actions
    (with the manifests) that apply.py carries out."""

    status: dict[str, Any] = field(default_factory=dict)
    attempt: int = 0
    create: tuple[int, ...] = ()
    delete: tuple[str, ...] = ()
    events: tuple[Event, ...] = ()
    delete_job: bool = False
    requeue_after: float | None = None
    queue: QueueWrites = field(default_factory=QueueWrites)
    # Pods on a lost node, deleted with no grace period: no kubelet would ever confirm it.
    force_delete: tuple[str, ...] = ()
    # The attempt the group's pods are created for (status.groupAttempt), and its running pods
    # to tell `attempt`, the one they must run (an in-place restart).
    group: int = 0
    tell: tuple[str, ...] = ()


class _Pass(GroupSteps, QueueSteps, StartSteps):
    """One planning pass: the status being built (`out`), the attempt and restart counters,
    and the steps plan_reconcile goes through, here and in its group (group.py), start-up
    (starting.py) and Kueue (queueing.py) steps. Each step that decides the pass returns its
    Plan (`done`, `fail`)."""

    def __init__(self, job: JobSpec, status: Mapping[str, Any], pods: Sequence[PodState],
                 now: datetime, queue: QueueState | None = None,
                 activity: Activity | None = None,
                 lost_nodes: Mapping[str, NodeState] | None = None):
        self.job, self.pods, self.now, self.queue = job, list(pods), now, queue
        self.activity = activity or Activity()
        self.lost_nodes = lost_nodes or {}
        self.stall_due: datetime | None = None  # when the group would be Stalled
        self.node_due: datetime | None = None  # when a NotReady node would count as lost
        self.wait_due: datetime | None = None  # when pods not started would fail the job
        self.node_lost = False  # the group restarts for a lost node: no grace period for any
        self.out = StatusBuilder(job, status, now)
        self.status = status
        self.attempt = int(status.get("attempt") or 0)
        # The attempt the group's pods were created for: `attempt` moves past it with each
        # in-place restart.
        self.group_attempt = group_attempt(status)
        self.restarts = int(status.get("restarts") or 0)
        # Before restartsCounted existed every restart was counted.
        self.counted = int(status.get("restartsCounted", self.restarts) or 0)
        self.release = False

    def done(self, create=(), delete=(), delete_job=False, requeue_after=None) -> Plan:
        self.out.status["attempt"] = self.attempt
        self.out.status.pop("groupAttempt", None)
        if self.group_attempt != self.attempt:
            self.out.status["groupAttempt"] = self.group_attempt
        status = self.out.finish()
        force = tuple(p.name for p in self.pods if (p.deleting or p.name in delete)
                      and (self._unreachable(p) or (self.node_lost and not p.deleting)))
        if requeue_after is None and status.get("phase") not in FINISHED_PHASES:
            due = [self._deadline(), self.stall_due, self.node_due, self.wait_due]
            known = [max((d - self.now).total_seconds(), 0.0) for d in due if d is not None]
            requeue_after = min(known) if known else None
        return Plan(status=status, attempt=self.attempt, create=tuple(create),
                    delete=tuple(name for name in delete if name not in force),
                    events=tuple(self.out.events), delete_job=delete_job,
                    requeue_after=requeue_after, queue=self._queue_writes(status),
                    force_delete=force, group=self.group_attempt,
                    tell=self._behind(status, delete))

    def _behind(self, status: Mapping[str, Any], delete: Sequence[str]) -> tuple[str, ...]:
        """The group's running pods not yet told the attempt they must run (an in-place
        restart: this pass's, or one whose write the pod watch does not show yet)."""
        if status.get("phase") in FINISHED_PHASES:
            return ()
        return tuple(p.name for p in self.pods
                     if p.attempt == self.group_attempt and p.run_attempt is not None
                     and p.run_attempt < self.attempt and p.name not in delete
                     and not p.deleting and not p.finished)

    def _new_group(self) -> None:
        """The next attempt runs in new pods."""
        self.attempt += 1
        self.group_attempt = self.attempt

    def config_warnings(self) -> None:
        """Name the values accelerate would drop: one Warning event when the list first shows
        (or changes), and the ConfigWarnings condition, which `kubectl describe` keeps showing."""
        warnings = self.job.config_warnings
        if not warnings:
            return
        message = (f"{len(warnings)} accelerate config value(s) would be ignored; training "
                   "goes on: " + " | ".join(warnings))
        before = self.out.conditions.get(CONFIG_WARNINGS, {}).get("message")
        self.out.condition(CONFIG_WARNINGS, True, CONFIG_WARNINGS_REASON, message)
        if before != message:
            self.out.events.append(Event("Warning", CONFIG_WARNINGS_REASON, message))

    def fail(self, reason: str, message: str) -> Plan:
        self.out.phase(FAILED, reason, message, warning=True)
        self.out.status["completionTime"] = format_time(self.now)
        self.out.counts(self.pods)
        return self.done(delete=pods_to_clean(self.job, self.pods))

    def _deadline(self) -> datetime | None:
        seconds = self.job.run_policy.active_deadline_seconds
        started = parse_time(self.status.get("startTime"))
        return started + timedelta(seconds=seconds) if seconds and started else None

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
        return self.done(delete=pods_to_clean(self.job, self.pods), delete_job=delete_job,
                         requeue_after=requeue)

    def suspend(self) -> Plan:
        self.out.counts(self.pods)
        self.out.phase(SUSPENDED, "Suspended",
                       "spec.runPolicy.suspend is true: pods deleted; set it to false to resume")
        return self.done(delete=[p.name for p in self.pods if not p.deleting])

    def resume(self) -> None:
        """A fresh group: pods of the suspended attempt may still be terminating."""
        self._new_group()
        self.out.condition(SUSPENDED, False, "Resumed",
                           "spec.runPolicy.suspend is false: starting a fresh group")
        self.out.events.append(
            Event("Normal", "Resumed", f"starting a fresh group (attempt {self.attempt})"))
        self.out.status["phase"] = PENDING
        self.out.previous_phase = PENDING

    def deadline_exceeded(self) -> Plan | None:
        deadline = self._deadline()
        if deadline is None or self.now < deadline:
            return None
        return self.fail("DeadlineExceeded",
                         f"the job ran longer than spec.runPolicy.activeDeadlineSeconds "
                         f"({self.job.run_policy.active_deadline_seconds}s)")


def plan_reconcile(
    job: JobSpec,
    status: Mapping[str, Any],
    pods: Sequence[PodState],
    now: datetime,
    *,
    config_error: str | None = None,
    config_error_reason: str = "InvalidConfig",
    queue: QueueState | None = None,
    activity: Activity | None = None,
    lost_nodes: Mapping[str, NodeState] | None = None,
) -> Plan:
    """The whole decision for one pass; `config_error` is set when the accelerate config (or
    anything else only the operator can check) means the job cannot run. `requeue_after` says
    when time alone will change the decision (a TTL or a deadline), for the operator's clock.
    `queue` is set for a job queued with Kueue: its group runs only while admitted. `activity`
    is what the runtime last saw of rank 0, for spec.runPolicy.stallTimeoutSeconds;
    `lost_nodes` the nodes of its pods that are not Ready, by name (observe.py reads them)."""
    run = _Pass(job, status, pods, now, queue, activity, lost_nodes)
    if run.out.previous_phase in FINISHED_PHASES:
        return run.finished()
    if config_error:
        return run.fail(config_error_reason, config_error)
    run.config_warnings()
    if queue is not None:
        gated = run.queue_gate()
        if gated is not None:
            return gated
    if job.run_policy.suspend:
        return run.suspend()
    if run.out.previous_phase == SUSPENDED:
        run.resume()
    return run.deadline_exceeded() or run.group()
