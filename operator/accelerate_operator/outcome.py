"""What the lifecycle's policies (lifecycle.py, group.py, startup.py, kueue/gate.py) decide from
and what they decide: `Facts` (read-only: the job, its status and pods, the clock, rank 0's
activity, the nodes that are not Ready), `Counters` (the attempt and restart numbers a policy
moves, a new value each time), the status being built (status.StatusBuilder, passed as `out`),
and the `Outcome` a policy ends the lifecycle with (`conclude`). Pure, and every function here
takes what it reads as arguments: each is tested alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from .api import JobSpec
from .constants import FAILED, FINISHED_PHASES, PENDING
from .pod_state import NodeState, PodState
from .status import COMPLETED_INDEXES, Event, StatusBuilder, attempt_of, group_attempt
from .timefmt import format_time, parse_time


@dataclass(frozen=True)
class Activity:
    """What pod 0 of the current group last reported, for stall detection: `last_activity` when
    rank 0's container last wrote anything, `last_step` the newest step it reported (both None
    before its first report), `last_step_done` whether that step was the run's last."""

    last_activity: datetime | None = None
    last_step: int | None = None
    last_step_done: bool = False


@dataclass(frozen=True)
class Facts:
    """What the policies decide from, read-only."""

    job: JobSpec
    status: Mapping[str, Any]
    pods: tuple[PodState, ...]
    now: datetime
    activity: Activity = field(default_factory=Activity)
    # The nodes of the job's pods that are not Ready, by name (reads.py reads them).
    lost_nodes: Mapping[str, NodeState] = field(default_factory=dict)
    # An elastic job's placeholder pods (resize.py), apart from its own.
    placeholders: tuple[PodState, ...] = ()


@dataclass(frozen=True)
class Counters:
    """The attempt the processes run (status.attempt), the one the group's pods were created for
    (status.groupAttempt: in-place restarts move only `attempt`), and the restarts (all, and
    those counted against backoffLimit)."""

    attempt: int
    group: int
    restarts: int
    counted: int

    @classmethod
    def of(cls, status: Mapping[str, Any]) -> Counters:
        restarts = int(status.get("restarts") or 0)
        # Before restartsCounted existed every restart was counted.
        return cls(attempt_of(status), group_attempt(status), restarts,
                   int(status.get("restartsCounted", restarts) or 0))

    def new_group(self) -> Counters:
        """The next attempt runs in new pods."""
        return replace(self, attempt=self.attempt + 1, group=self.attempt + 1)


@dataclass(frozen=True)
class Outcome:
    """What the lifecycle decided: the new status, the attempt, the pods to create (indexes)
    and delete (names: gracefully, or with no grace period), the running pods to tell the new
    attempt (an in-place restart), the events, the job's own deletion (its TTL passed), when time
    alone changes the decision, whether an evicted Workload's quota goes back, and the
    placeholders to create (the node indices they hold capacity for; resize.hold_capacity)."""

    status: dict[str, Any] = field(default_factory=dict)
    attempt: int = 0
    group: int = 0
    create: tuple[int, ...] = ()
    delete: tuple[str, ...] = ()
    force_delete: tuple[str, ...] = ()
    tell: tuple[str, ...] = ()
    events: tuple[Event, ...] = ()
    delete_job: bool = False
    requeue_after: float | None = None
    release: bool = False
    placeholders: tuple[int, ...] = ()


@dataclass(frozen=True)
class Ending:
    """How a policy ends the lifecycle: the pods to create and delete, the job's own deletion,
    when to look again (None: the earliest of `due`), the quota release, and the times that
    would change the decision (a stall, a node counted lost, a waiting timeout) and whether the
    group's pods hold nothing a grace period could save (they then go with none)."""

    create: Sequence[int] = ()
    delete: Sequence[str] = ()
    delete_job: bool = False
    requeue_after: float | None = None
    release: bool = False
    due: Sequence[datetime | None] = ()
    no_grace: bool = False


def conclude(facts: Facts, out: StatusBuilder, counters: Counters,
             ending: Ending = Ending()) -> Outcome:
    """The Outcome of a policy that ends the lifecycle with `ending`."""
    out.status["attempt"] = counters.attempt
    if counters.group != group_attempt(facts.status):
        out.status.pop(COMPLETED_INDEXES, None)  # the nodes of a group that is gone
    out.status.pop("groupAttempt", None)
    if counters.group != counters.attempt:
        out.status["groupAttempt"] = counters.group
    status = out.finish()
    going = [p for p in facts.pods if p.deleting or p.name in ending.delete]
    force = tuple(p.name for p in going
                  if unreachable(facts, p) or (ending.no_grace and not p.deleting))
    requeue = ending.requeue_after
    if requeue is None and status.get("phase") not in FINISHED_PHASES:
        # A pod going from a node that stopped reporting goes with no grace period once the
        # node counts as lost: then the next pass is due.
        due = [deadline(facts), *ending.due, *(node_lost(facts, p)[1] for p in going
                                               if _silent(node_of(facts, p)))]
        known = [max((d - facts.now).total_seconds(), 0.0) for d in due if d is not None]
        requeue = min(known) if known else None
    return Outcome(status=status, attempt=counters.attempt, group=counters.group,
                   create=tuple(ending.create),
                   delete=tuple(name for name in ending.delete if name not in force),
                   force_delete=force, tell=behind(facts.pods, counters, status, ending.delete),
                   events=tuple(out.events), delete_job=ending.delete_job,
                   requeue_after=requeue, release=ending.release)


def behind(pods: Sequence[PodState], counters: Counters, status: Mapping[str, Any],
           delete: Sequence[str]) -> tuple[str, ...]:
    """The group's running pods not yet told the attempt they must run (an in-place restart:
    this pass's, or one whose write the pod watch does not show yet)."""
    if status.get("phase") in FINISHED_PHASES:
        return ()
    return tuple(p.name for p in pods
                 if p.attempt == counters.group and p.run_attempt is not None
                 and p.run_attempt < counters.attempt and p.name not in delete and p.live)


def fail(facts: Facts, out: StatusBuilder, counters: Counters, reason: str,
         message: str) -> Outcome:
    """The job fails: its phase, its completion time, and its pods cleaned up."""
    out.phase(FAILED, reason, message, warning=True)
    out.status["completionTime"] = format_time(facts.now)
    out.counts(facts.pods)
    return conclude(facts, out, counters, Ending(delete=pods_to_clean(facts.job, facts.pods)))


def pods_to_clean(job: JobSpec, pods: Sequence[PodState]) -> tuple[str, ...]:
    """The pods spec.runPolicy.cleanPodPolicy deletes once the job has finished."""
    policy = job.run_policy.clean_pod_policy
    if policy == "None":
        return ()
    return tuple(p.name for p in pods if not p.deleting and (policy == "All" or not p.finished))


def deadline(facts: Facts) -> datetime | None:
    """When spec.runPolicy.activeDeadlineSeconds runs out, counted from status.startTime."""
    seconds = facts.job.run_policy.active_deadline_seconds
    started = parse_time(facts.status.get("startTime"))
    return started + timedelta(seconds=seconds) if seconds and started else None


# ---- nodes that stopped being Ready ------------------------------------------------------------
def node_of(facts: Facts, pod: PodState) -> NodeState | None:
    """The pod's node when it is not Ready (reads.py read it), else None."""
    return facts.lost_nodes.get(pod.node) if pod.node else None


def node_lost(facts: Facts, pod: PodState) -> tuple[str | None, datetime | None]:
    """(why the pod is lost with its node, None) once the node has not been Ready for
    spec.runPolicy.nodeLostTimeoutSeconds; before that (None, when it will be); (None, None)
    for a pod whose node is Ready."""
    node = node_of(facts, pod)
    if node is None:
        return None, None
    timeout = facts.job.run_policy.node_lost_timeout_seconds
    if node.since is not None and facts.now < node.since + timedelta(seconds=timeout):
        return None, node.since + timedelta(seconds=timeout)
    return (f"{node.describe(facts.now)} (spec.runPolicy.nodeLostTimeoutSeconds={timeout})",
            None)


def unreachable(facts: Facts, pod: PodState) -> bool:
    """A pod lost with a node whose kubelet no longer reports: deleted with no grace period,
    or it would stay Terminating (and hold its name) until the node came back."""
    return _silent(node_of(facts, pod)) and node_lost(facts, pod)[0] is not None


def never_formed(group: Sequence[PodState]) -> bool:
    """A group with a pod that never ran (unplaced, or its containers not started): its
    rendezvous never completed, so no rank trained a step to save. Its pods go with no grace
    period: the others only wait for their peers, and one that does not answer SIGTERM there
    (a user's init container, say) would keep its name from the next group for the whole grace
    period, 120 s by default."""
    return any(p.phase == PENDING for p in group)


def _silent(node: NodeState | None) -> bool:
    return node is not None and not node.reporting
