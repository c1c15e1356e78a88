"""The group policy: the pods of the current attempt fail, are disrupted, stall, or run.

The group is the unit: every restart moves all ranks to a new attempt number, so they meet in a
fresh rendezvous (a lone restarted rank never rejoins a torchrun rendezvous). A launch that
failed in a running pod (the pod's report, `ProcessExit`) restarts in place when every pod of the
group runs on a node that answers (spec.runPolicy.restartInPlace): the same pods are told the new
attempt (`Outcome.tell`, after the status write that counts it) and launch it themselves
(accelerate_trainer.supervise); `status.groupAttempt` keeps the attempt the pods were created
for. Otherwise one failed, evicted or deleted pod stops and recreates every pod: the others are
deleted gracefully, so every rank gets SIGTERM and its grace period to save one checkpoint
together (accelerate_trainer.checkpoints).

Not every restart is the job's fault. A restart is counted against spec.runPolicy.backoffLimit
(`status.restartsCounted`) when the training failed: a non-zero exit (OOMKilled included: the
pod's memory limit is part of the job), or a stall. A disruption is not counted (only
`status.restarts`, which counts every restart): a pod with the DisruptionTarget condition
(eviction API and `kubectl drain`, preemption, the taint manager, the kubelet's node-pressure
eviction or shutdown), a pod whose node is gone, and a pod of a running group deleted by anyone
but the operator. The Restarting condition's reason names the cause: PodFailed, Disrupted or
Stalled.

A node that stops being Ready takes its pods' ranks with it, but Kubernetes evicts them only after
their toleration (300 s by default), and a pod on a node whose kubelet is gone stays Terminating,
holding its name, until the node returns. So once a node holding one of the group's pods has not
been Ready for spec.runPolicy.nodeLostTimeoutSeconds (`NodeState`, read by reads.py), the group
restarts (a disruption, not counted) and its pods are deleted with no grace period: those on a
node that no longer reports would otherwise stay Terminating, and the others' ranks wait in
collectives on the lost ones, so they could not checkpoint in a grace period anyway (stale pods
stuck Terminating on such a node are deleted so too). That is safe because nothing on such a node
can train on: the group's other ranks have been stopped, so a rank left running there (a
partition, not a crash) fails its next collective, a checkpoint counts only once every rank of
the group has written it, and a replaced group may not save over a newer attempt's checkpoint
(accelerate_trainer.checkpoints).

Stall detection (spec.runPolicy.stallTimeoutSeconds) decides from `Activity`, what pod 0 last
reported (when rank 0's container last wrote anything, and its last step): a Running group with no
output for longer than the timeout, or a group whose pods have not all run within the timeout of
their creation, is Stalled and restarted (counted). Once rank 0 reported the run's last step
(step = total_steps) its silence is the run's end and is not timed (stall_reference)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from accelerate_trainer.contract import CONFIG_ERROR_EXIT_CODE

from .api import JobSpec
from .causes import OOM_KILLED
from .constants import CREATED, FAILED, PENDING, RESTARTING, RUNNING, STALLED, SUCCEEDED
from .outcome import (
    Counters,
    Ending,
    Facts,
    Outcome,
    conclude,
    fail,
    never_formed,
    node_lost,
    pods_to_clean,
)
from .pod_state import PodState
from .startup import WAITING_TIMEOUT_REASON, set_waiting, waiting_message, waiting_timeout
from .status import COMPLETED_INDEXES, Event, StatusBuilder, format_indexes, parse_indexes
from .timefmt import format_time, naive_utc, parse_time

# The Restarting condition's reasons: why the group restarts.
RESTART_FAILED, RESTART_DISRUPTED, RESTART_STALLED = "PodFailed", "Disrupted", "Stalled"
RESTART_PROCESS_FAILED = "ProcessFailed"  # a launch failed in a running pod: restarted in place


# status.lastFailureReason beside the pod's own reasons (OOMKilled, Evicted...) and the
# disruptions' (EvictionByEvictionAPI...): a plain non-zero exit, a pod deleted by someone else, a
# node lost, a group that stalled.
FAILED_EXIT, POD_DELETED, NODE_LOST = "Error", "PodDeleted", "NodeLost"


@dataclass(frozen=True)
class Failure:
    """Why one pod stops the group: `reason` as data (status.lastFailureReason, the metrics'
    label), `what` in words for the message."""

    pod: str
    reason: str
    what: str
    exit_code: int | None = None
    message: str | None = None
    # A disruption (see PodState.disruption): restarts without using up backoffLimit.
    disrupted: bool = False
    # The root cause, said first (causes.py): out of memory, or the first failing rank's error.
    cause: str | None = None
    # Killed for memory: the root cause of the group's other failures (their peers vanished).
    oom: bool = False

    def describe(self) -> str:
        text = f"pod {self.pod} {self.what}"
        if self.exit_code is not None:
            text += f" with exit code {self.exit_code}"
        if self.message:
            text += f": {self.message.strip()}"
        return f"{self.cause}; {text}" if self.cause else text


def find_failures(job: JobSpec, current: Sequence[PodState], was_running: bool,
                  lost: Mapping[str, str], completed: frozenset[int] = frozenset()
                  ) -> list[Failure]:
    """Why the current group cannot go on: its failed pods (counted), and its disrupted ones
    (not counted): a node lost (`lost`: pod name -> why), a DisruptionTarget or a node gone,
    and, once the group runs, a pod being deleted or gone. The operator deletes a group's pods
    only after it has moved to a new attempt, so a pod of the current attempt being deleted was
    deleted by someone else. A node that finished (`completed`) is none of these: its pod
    may go (deleted after it ended, its node scaled away) while rank 0 still saves."""
    failures = [f for p in sorted(current, key=lambda p: p.index)
                if (f := _failure(p, was_running, lost.get(p.name))) is not None]
    if was_running:
        # Once the group runs, a pod that disappears (deleted, its node gone) takes its ranks
        # with it.
        present = {p.index for p in current} | completed
        failures += [Failure(f"{job.name}-{index}", POD_DELETED, "was deleted", disrupted=True)
                     for index in range(job.num_nodes) if index not in present]
    return failures


def _failure(p: PodState, was_running: bool, lost: str | None) -> Failure | None:
    if p.phase == SUCCEEDED:
        return None  # its ranks are done: whatever happens to the pod now loses nothing
    if lost is not None:
        return Failure(p.name, NODE_LOST, f"was lost with its node: {lost}", disrupted=True)
    if p.disruption:
        return Failure(p.name, p.disruption, f"was disrupted ({p.disruption})", p.exit_code,
                       p.message, disrupted=True)
    if p.deleting and (was_running or p.phase == RUNNING):
        # Its ranks are going away: every other rank would wait in its collectives forever.
        return Failure(p.name, POD_DELETED, "is being deleted", disrupted=True)
    if p.phase == FAILED:
        plain = not p.reason or p.reason == FAILED_EXIT
        return Failure(p.name, FAILED_EXIT if plain else p.reason,
                       "failed" if plain else f"failed ({p.reason})", p.exit_code, p.message,
                       cause=p.cause, oom=p.cause is not None)
    return None


def launch_failures(current: Sequence[PodState], attempt: int) -> list[Failure]:
    """The launches of `attempt` that failed in running pods (their reports' `exit`)."""
    return [Failure(p.name, OOM_KILLED if p.exit.oom else FAILED_EXIT,
                    "ended its training processes", p.exit.exit_code, p.exit.message,
                    cause=p.exit.cause, oom=p.exit.oom)
            for p in sorted(current, key=lambda p: p.index)
            if p.exit is not None and p.exit.attempt == attempt]


def completed_nodes(facts: Facts, current: Sequence[PodState]) -> frozenset[int]:
    """The nodes of the current group that finished training: those whose pod succeeded, and
    those status.completedIndexes kept of it whose pods are gone since (as a Job's
    status.completedIndexes). conclude() drops the record when the group changes."""
    return frozenset(parse_indexes(facts.status.get(COMPLETED_INDEXES), facts.job.num_nodes)
                     | {p.index for p in current if p.phase == SUCCEEDED})


def lost_pods(facts: Facts, current: Sequence[PodState]
              ) -> tuple[dict[str, str], datetime | None]:
    """The group's pods lost with their node (name -> why), and when the next one will be."""
    lost, due = {}, None
    for p in current:
        if p.finished:
            continue
        why, when = node_lost(facts, p)
        if why is not None:
            lost[p.name] = why
        elif when is not None:
            due = when if due is None else min(due, when)
    return lost, due


def run_group(facts: Facts, out: StatusBuilder, counters: Counters) -> Outcome:
    """The pods of the current attempt: restart on a failure, a disruption or a stall, else
    wait, create, or report how far the group is."""
    current = [p for p in facts.pods if p.attempt == counters.group]
    stale = [p for p in facts.pods if p.attempt != counters.group]
    lost, node_due = lost_pods(facts, current)
    # The ranks left on healthy nodes wait in collectives on the lost ones: they can neither
    # stop cleanly nor checkpoint (that takes every rank), and a grace period would only keep
    # their names from the next group.
    ending = Ending(due=(node_due,), no_grace=bool(lost))
    completed = completed_nodes(facts, current)
    out.status.pop(COMPLETED_INDEXES, None)
    if completed:
        out.status[COMPLETED_INDEXES] = format_indexes(completed)
    failures = find_failures(facts.job, current, out.previous_phase == RUNNING, lost,
                             completed)
    if failures:
        return restart_or_fail(facts, out, counters, failures, ending)
    ended = launch_failures(current, counters.attempt)
    if ended:
        return restart_or_fail(facts, out, counters, ended, ending,
                               in_place=can_restart_in_place(facts, current))
    if stale:
        # Wait until the previous attempt's pods are gone: the new ones reuse their names.
        # They were deleted gracefully: each rank may be saving its share of a checkpoint. A name
        # a current pod holds too is a ghost's (deleted while unwatched, until the index audit
        # hides it): deleting it by name would delete the current pod.
        out.counts(current)
        held = {p.name for p in current}
        return conclude(facts, out, counters, replace(
            ending, delete=[p.name for p in stale if not p.deleting and p.name not in held]))
    return _start_or_run(facts, out, counters, current, ending, completed)


def _start_or_run(facts: Facts, out: StatusBuilder, counters: Counters,
                  current: list[PodState], ending: Ending, completed: frozenset[int]
                  ) -> Outcome:
    """A group with no failure: fail it for waiting too long, restart it for a stall, or
    create, run or finish it; the times those would come are the clock's requeue."""
    policy = facts.job.run_policy
    timed_out, wait_due = waiting_timeout(policy.waiting_timeout_seconds,
                                          parse_time(facts.status.get("attemptStartTime")),
                                          out.previous_phase, current, facts.now,
                                          waiting_message(out))
    if timed_out is not None:
        return fail(facts, out, counters, WAITING_TIMEOUT_REASON, timed_out)
    stalled, stall_due = stall(facts, out, current, completed)
    ending = replace(ending, due=(*ending.due, wait_due, stall_due))
    if stalled is not None:
        out.condition(STALLED, True, RESTART_STALLED, stalled)
        out.status["lastFailure"] = stalled
        out.status["lastFailureReason"] = RESTART_STALLED
        # restart() posts the Warning event (reason Stalled) with this message.
        return restart(facts, out, counters, stalled, RESTART_STALLED, ending, counted=True)
    return advance(facts, out, counters, current, ending, completed)


def can_restart_in_place(facts: Facts, current: Sequence[PodState]) -> bool:
    """Whether the group can restart in place: asked for, and every pod of it runs, able to (an
    attempt file), on a node that answers."""
    job = facts.job
    return job.run_policy.restart_in_place and len(current) == job.num_nodes \
        and all(p.phase == RUNNING and not p.deleting and p.run_attempt is not None
                and not p.waits_on_node(facts.now) for p in current)


def restart_or_fail(facts: Facts, out: StatusBuilder, counters: Counters,
                    failures: Sequence[Failure], ending: Ending, in_place: bool = False
                    ) -> Outcome:
    """Restart the group for the first disruption (not counted) or else the first failure
    (counted, unless the job can never run: a config error or a permanent exit code);
    `in_place`: the failures are launches that ended in running pods, restarted there."""
    disrupted = [f for f in failures if f.disrupted]
    first = (disrupted or sorted(failures, key=lambda f: not f.oom))[0]
    out.status["lastFailure"] = first.describe()
    out.status["lastFailureReason"] = first.reason
    if disrupted:
        return restart(facts, out, counters, first.describe(), RESTART_DISRUPTED, ending,
                       counted=False)
    if first.exit_code == CONFIG_ERROR_EXIT_CODE:
        return fail(facts, out, counters, "InvalidConfig", first.describe())
    if first.exit_code is not None and first.exit_code in facts.job.run_policy.\
            permanent_exit_codes:
        return fail(facts, out, counters, "PermanentFailure",
                    f"{first.describe()} (listed in spec.runPolicy.permanentExitCodes)")
    reason = RESTART_PROCESS_FAILED if in_place else RESTART_FAILED
    return restart(facts, out, counters, first.describe(), reason, ending, counted=True,
                   in_place=in_place)


def restart(facts: Facts, out: StatusBuilder, counters: Counters, cause: str, reason: str,
            ending: Ending, *, counted: bool, in_place: bool = False) -> Outcome:
    """A new attempt: every pod of this one is deleted (gracefully: each rank gets SIGTERM and
    its grace period to checkpoint, unless the group never formed), or, `in_place`, told to
    launch the new attempt. A counted restart past backoffLimit fails the job."""
    limit = facts.job.run_policy.backoff_limit
    group = [p for p in facts.pods if p.attempt == counters.group]
    if counted and counters.counted >= limit:
        return fail(facts, out, counters, "BackoffLimitExceeded",
                    f"{cause}; no restarts left (spec.runPolicy.backoffLimit={limit})")
    counters = replace(counters, restarts=counters.restarts + 1,
                       counted=counters.counted + counted)
    counters = replace(counters, attempt=counters.attempt + 1) if in_place \
        else counters.new_group()
    out.status["restarts"] = counters.restarts
    out.status["restartsCounted"] = counters.counted
    out.counts(facts.pods)
    budget = (f"restart {counters.counted} of {limit}" if counted else
              f"a disruption, not counted against spec.runPolicy.backoffLimit: "
              f"{counters.counted} of {limit} used")
    what = "the processes of all" if in_place else "all"
    out.phase(RESTARTING, reason,
              f"{cause}; restarting {what} {facts.job.num_nodes} node(s)"
              f"{' in place' if in_place else ''} ({budget})", warning=True)
    if in_place:
        return conclude(facts, out, counters, ending)
    return conclude(facts, out, counters, replace(
        ending, delete=[p.name for p in facts.pods if not p.deleting],
        no_grace=ending.no_grace or never_formed(group)))


def stall_reference(facts: Facts, out: StatusBuilder, current: Sequence[PodState]
                    ) -> tuple[datetime, str] | None:
    """Since when the group has shown no sign of life, and what that sign was: rank 0's newest
    output or report once the group runs (never older than the group's start of running), else
    the creation of this attempt's pods. None when there is nothing to time, or once rank 0 said
    its last step is done: the run's end (a final save, an upload, the processes' exit) is not
    timed, as a restart would only train again from the last checkpoint."""
    if out.previous_phase == RUNNING:
        condition = out.conditions.get(RUNNING) or {}
        since = parse_time(condition.get("lastTransitionTime"))
        seen = facts.activity.last_activity
        if since is None or seen is None or facts.activity.last_step_done:
            return None  # nothing of rank 0 reported yet, or its training is done
        return max(since, naive_utc(seen)), "running"
    started = parse_time(facts.status.get("attemptStartTime"))
    if started is None or not current:
        return None
    return started, "starting"


def stall(facts: Facts, out: StatusBuilder, current: Sequence[PodState],
          completed: frozenset[int] = frozenset()) -> tuple[str | None, datetime | None]:
    """(why the group is Stalled, None) past spec.runPolicy.stallTimeoutSeconds; before that
    (None, when it will be)."""
    timeout = facts.job.run_policy.stall_timeout_seconds
    if not timeout or out.previous_phase not in (RUNNING, PENDING, RESTARTING):
        return None, None
    reference = stall_reference(facts, out, current)
    if reference is None:
        return None, None
    since, state = reference
    due = since + timedelta(seconds=timeout)
    if facts.now < due:
        return None, due
    step = facts.activity.last_step
    if step is None:
        step = (facts.status.get("progress") or {}).get("step")
    seen = f"the last step seen is {step}" if step is not None else "no step was reported"
    if state == "running":
        return (f"no log line or progress report from rank 0 (pod {facts.job.name}-0) for "
                f"{timeout}s (spec.runPolicy.stallTimeoutSeconds); {seen}"), None
    names = _not_running(facts.job, current, completed)
    if not names:
        return None, None  # every pod runs: the group is about to be Running
    return (f"{', '.join(names)} not running {timeout}s after the group was created "
            f"(spec.runPolicy.stallTimeoutSeconds): the other nodes wait for it in the "
            f"rendezvous; {seen}"), None


def _not_running(job: JobSpec, current: Sequence[PodState], completed: frozenset[int]
                 ) -> list[str]:
    """The nodes the group waits for, each with what keeps it: Kubernetes' reason for a pod
    that cannot start (not_started.py), else the pod's phase."""
    missing = [p for p in sorted(current, key=lambda p: p.index)
               if not (p.phase == SUCCEEDED or (p.phase == RUNNING and p.ready))]
    present = {p.index for p in current} | completed
    names = [f"node {p.index} (" + (p.not_started.describe(p.name) if p.not_started else
                                    f"pod {p.name}: {p.phase}"
                                    + (f", {p.reason}" if p.reason else "")) + ")"
             for p in missing]
    return names + [f"node {i} (no pod)" for i in range(job.num_nodes) if i not in present]


def advance(facts: Facts, out: StatusBuilder, counters: Counters, current: list[PodState],
            ending: Ending, completed: frozenset[int] = frozenset()) -> Outcome:
    """Create the group's missing pods (not those of nodes that finished), or say it runs, or
    that it succeeded."""
    job = facts.job
    present = {p.index for p in current} | completed
    create = [i for i in range(job.num_nodes) if i not in present]
    # Count the pods this pass creates as Pending: the next pass, which sees them, then finds
    # nothing to change and writes nothing.
    out.counts(current + [PodState(f"{job.name}-{i}", i, counters.group, PENDING)
                          for i in create])
    if create and not present:
        out.status.setdefault("startTime", format_time(facts.now))
        out.status["attemptStartTime"] = format_time(facts.now)
    if create or current:
        message = f"ConfigMap, headless Service and {job.num_nodes} pod(s) created"
        if out.condition(CREATED, True, "PodsCreated", message):
            out.events.append(Event("Normal", "PodsCreated", message))
    succeeded = len(completed)
    running = succeeded + sum(p.phase == RUNNING for p in current)
    if succeeded == job.num_nodes:
        out.phase(SUCCEEDED, "AllNodesSucceeded",
                  f"all {job.num_nodes} node(s) finished training successfully")
        out.status["completionTime"] = format_time(facts.now)
        return conclude(facts, out, counters,
                        replace(ending, delete=pods_to_clean(job, current)))
    if running == job.num_nodes and not create:
        message = f"all {job.num_nodes} node(s) running, {job.world_size} process(es) in total"
        out.phase(RUNNING, "AllNodesRunning", message)
        if STALLED in out.conditions:
            out.condition(STALLED, False, "AllNodesRunning", message)
        return conclude(facts, out, counters, ending)
    if out.previous_phase != RESTARTING:
        out.status["phase"] = PENDING
    set_waiting(out, current)
    return conclude(facts, out, counters, replace(ending, create=create))
