"""The group steps of a pass: the pods of the current attempt fail, are disrupted, stall, or run.

The group is the unit: every restart moves all ranks to a new attempt number, so they meet in a
fresh rendezvous (a lone restarted rank never rejoins a torchrun rendezvous). A launch that
failed in a running pod (the pod's report, `ProcessExit`) restarts in place when every pod of the
group runs on a node that answers (spec.runPolicy.restartInPlace): the same pods are told the new
attempt (`Plan.tell`, after the status write that counts it) and launch it themselves
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
been Ready for spec.runPolicy.nodeLostTimeoutSeconds (`NodeState`, read by observe.py), the group
restarts (a disruption, not counted) and its pods are deleted with no grace period: those on a
node that no longer reports would otherwise stay Terminating, and the others' ranks wait in
collectives on the lost ones, so they could not checkpoint in a grace period anyway (stale pods
stuck Terminating on such a node are deleted so too). That is safe because nothing on such a node
can train on: the group's other ranks have been stopped, so a rank left running there (a
partition, not a crash) fails its next collective, a checkpoint counts only once every rank of
the group has written it, and a replaced group may not save over a newer attempt's checkpoint
(accelerate_trainer.checkpoints).

Stall detection (spec.runPolicy.stallTimeoutSeconds) decides from `Activity`, what pod 0 last
pushed (when rank 0's container last wrote anything, and its last step): a Running group with no
output for longer than the timeout, or a group whose pods have not all run within the timeout of
their creation, is Stalled and restarted (counted)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from accelerate_trainer.contract import CONFIG_ERROR_EXIT_CODE

from .api import JobSpec
from .causes import OOM_KILLED
from .constants import CREATED, FAILED, PENDING, RESTARTING, RUNNING, STALLED, SUCCEEDED
from .observed import NodeState, PodState
from .status import Event
from .timefmt import format_time, naive_utc, parse_time

if TYPE_CHECKING:
    from .decision import Plan

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


def _failures(job: JobSpec, current: Sequence[PodState], was_running: bool,
              lost: Mapping[str, str]) -> list[Failure]:
    """Why the current group cannot go on: its failed pods (counted), and its disrupted ones
    (not counted): a node lost (`lost`: pod name -> why), a DisruptionTarget or a node gone,
    and, once the group runs, a pod being deleted or gone. The operator deletes a group's pods
    only after it has moved to a new attempt, so a pod of the current attempt being deleted was
    deleted by someone else."""
    failures = []
    for p in sorted(current, key=lambda p: p.index):
        if p.name in lost:
            failures.append(Failure(p.name, NODE_LOST, f"was lost with its node: {lost[p.name]}",
                                    disrupted=True))
        elif p.disruption:
            failures.append(Failure(p.name, p.disruption, f"was disrupted ({p.disruption})",
                                    p.exit_code, p.message, disrupted=True))
        elif p.deleting and p.phase != SUCCEEDED and (was_running or p.phase == RUNNING):
            # Its ranks are going away: every other rank would wait in its collectives forever.
            failures.append(Failure(p.name, POD_DELETED, "is being deleted", disrupted=True))
        elif p.phase == FAILED:
            plain = not p.reason or p.reason == FAILED_EXIT
            failures.append(Failure(p.name, FAILED_EXIT if plain else p.reason,
                                    "failed" if plain else f"failed ({p.reason})",
                                    p.exit_code, p.message, cause=p.cause,
                                    oom=p.cause is not None))
    if was_running:
        # Once the group runs, a pod that disappears (deleted, its node gone) takes its ranks
        # with it.
        present = {p.index for p in current}
        for index in range(job.num_nodes):
            if index not in present:
                failures.append(Failure(f"{job.name}-{index}", POD_DELETED, "was deleted",
                                        disrupted=True))
    return failures


def pods_to_clean(job: JobSpec, pods: Sequence[PodState]) -> tuple[str, ...]:
    policy = job.run_policy.clean_pod_policy
    if policy == "None":
        return ()
    return tuple(
        p.name for p in pods
        if not p.deleting and (policy == "All" or not p.finished)
    )


class GroupSteps:
    """The group steps of the pass (decision._Pass): they read and move the pass's state (job,
    pods, now, out, attempt, group_attempt, restarts, counted, the due times) and end it with
    its done() or fail()."""

    def _node_lost(self, pod: PodState) -> str | None:
        """Why the pod is lost with its node, once the node has not been Ready for
        spec.runPolicy.nodeLostTimeoutSeconds, else None; until then, the time it would be is
        kept for the clock's requeue."""
        node = self._node_of(pod)
        if node is None:
            return None
        timeout = self.job.run_policy.node_lost_timeout_seconds
        if node.since is not None and self.now < node.since + timedelta(seconds=timeout):
            due = node.since + timedelta(seconds=timeout)
            self.node_due = due if self.node_due is None else min(self.node_due, due)
            return None
        return f"{node.describe(self.now)} (spec.runPolicy.nodeLostTimeoutSeconds={timeout})"

    def _unreachable(self, pod: PodState) -> bool:
        """A pod lost with a node whose kubelet no longer reports: deleted with no grace period,
        or it would stay Terminating (and hold its name) until the node came back."""
        node = self._node_of(pod)
        return node is not None and not node.reporting and self._node_lost(pod) is not None

    def _node_of(self, pod: PodState) -> NodeState | None:
        """The pod's node when it is not Ready (observe.py read it), else None."""
        return self.lost_nodes.get(pod.node) if pod.node else None

    def group(self) -> Plan:
        """The pods of the current attempt: restart on a failure, a disruption or a stall, else
        wait, create, or report how far the group is."""
        current = [p for p in self.pods if p.attempt == self.group_attempt]
        stale = [p for p in self.pods if p.attempt != self.group_attempt]
        lost = {p.name: why for p in current if not p.finished
                and (why := self._node_lost(p)) is not None}
        # The ranks left on healthy nodes wait in collectives on the lost ones: they can
        # neither stop cleanly nor checkpoint (that takes every rank), and a grace period would
        # only keep their names from the next group.
        self.node_lost = bool(lost)
        failures = _failures(self.job, current, self.out.previous_phase == RUNNING, lost)
        if failures:
            return self.restart_or_fail(failures)
        ended = [Failure(p.name, OOM_KILLED if p.exit.oom else FAILED_EXIT,
                         "ended its training processes", p.exit.exit_code, p.exit.message,
                         cause=p.exit.cause, oom=p.exit.oom)
                 for p in sorted(current, key=lambda p: p.index)
                 if p.exit is not None and p.exit.attempt == self.attempt]
        if ended:
            return self.restart_or_fail(ended, in_place=self._in_place(current))
        if stale:
            # Wait until the previous attempt's pods are gone: the new ones reuse their names.
            # They were deleted gracefully: each rank may be saving its share of a checkpoint.
            self.out.counts(current)
            return self.done(delete=[p.name for p in stale if not p.deleting])
        return (self.waiting_timeout(current) or self.stalled(current)
                or self.progress(current))

    def _in_place(self, current: Sequence[PodState]) -> bool:
        """Whether the group can restart in place: asked for, and every pod of it runs, able
        to (an attempt file), on a node that answers."""
        return self.job.run_policy.restart_in_place and len(current) == self.job.num_nodes \
            and all(p.phase == RUNNING and not p.deleting and p.run_attempt is not None
                    and not p.waits_on_node(self.now) for p in current)

    def restart_or_fail(self, failures: Sequence[Failure], in_place: bool = False) -> Plan:
        """Restart the group for the first disruption (not counted) or else the first failure
        (counted, unless the job can never run: a config error or a permanent exit code);
        `in_place`: the failures are launches that ended in running pods, restarted there."""
        policy = self.job.run_policy
        disrupted = [f for f in failures if f.disrupted]
        first = (disrupted or sorted(failures, key=lambda f: not f.oom))[0]
        self.out.status["lastFailure"] = first.describe()
        self.out.status["lastFailureReason"] = first.reason
        if disrupted:
            return self.restart(first.describe(), RESTART_DISRUPTED, counted=False)
        if first.exit_code == CONFIG_ERROR_EXIT_CODE:
            return self.fail("InvalidConfig", first.describe())
        if first.exit_code is not None and first.exit_code in policy.permanent_exit_codes:
            return self.fail("PermanentFailure",
                             f"{first.describe()} (listed in spec.runPolicy.permanentExitCodes)")
        if in_place:
            return self.restart(first.describe(), RESTART_PROCESS_FAILED, counted=True,
                                in_place=True)
        return self.restart(first.describe(), RESTART_FAILED, counted=True)

    def restart(self, cause: str, reason: str, *, counted: bool, in_place: bool = False
                ) -> Plan:
        """A new attempt: every pod of this one is deleted (gracefully: each rank gets SIGTERM
        and its grace period to checkpoint), or, `in_place`, told to launch the new attempt.
        A counted restart past backoffLimit fails the job."""
        policy = self.job.run_policy
        if counted and self.counted >= policy.backoff_limit:
            return self.fail("BackoffLimitExceeded",
                             f"{cause}; no restarts left "
                             f"(spec.runPolicy.backoffLimit={policy.backoff_limit})")
        self.restarts += 1
        self.counted += counted
        if in_place:
            self.attempt += 1
        else:
            self._new_group()
        self.out.status["restarts"] = self.restarts
        self.out.status["restartsCounted"] = self.counted
        self.out.counts(self.pods)
        if counted:
            budget = f"restart {self.counted} of {policy.backoff_limit}"
        else:
            budget = (f"a disruption, not counted against spec.runPolicy.backoffLimit: "
                      f"{self.counted} of {policy.backoff_limit} used")
        what = "the processes of all" if in_place else "all"
        self.out.phase(RESTARTING, reason,
                       f"{cause}; restarting {what} {self.job.num_nodes} node(s)"
                       f"{' in place' if in_place else ''} ({budget})", warning=True)
        if in_place:
            return self.done()
        return self.done(delete=[p.name for p in self.pods if not p.deleting])

    def _stall_reference(self, current: Sequence[PodState]) -> tuple[datetime, str] | None:
        """Since when the group has shown no sign of life, and what that sign was: rank 0's
        newest log line or report once the group runs (never older than the group's start of
        running), else the creation of this attempt's pods. None when there is nothing to time."""
        if self.out.previous_phase == RUNNING:
            condition = self.out.conditions.get(RUNNING) or {}
            since = parse_time(condition.get("lastTransitionTime"))
            seen = self.activity.last_activity
            if since is None or seen is None:
                return None  # the runtime has not read rank 0 yet: nothing to decide from
            return max(since, naive_utc(seen)), "running"
        started = parse_time(self.status.get("attemptStartTime"))
        if started is None or not current:
            return None
        return started, "starting"

    def stalled(self, current: list[PodState]) -> Plan | None:
        """A Stalled group restarts (counted) from its checkpoint; before that, the time it will
        be stalled at is the clock's requeue."""
        timeout = self.job.run_policy.stall_timeout_seconds
        if not timeout or self.out.previous_phase not in (RUNNING, PENDING, RESTARTING):
            return None
        reference = self._stall_reference(current)
        if reference is None:
            return None
        since, state = reference
        due = since + timedelta(seconds=timeout)
        if self.now < due:
            self.stall_due = due
            return None
        job, step = self.job, self.activity.last_step
        if step is None:
            step = (self.status.get("progress") or {}).get("step")
        seen = f"the last step seen is {step}" if step is not None else "no step was reported"
        if state == "running":
            message = (f"no log line or progress report from rank 0 (pod {job.name}-0) for "
                       f"{timeout}s (spec.runPolicy.stallTimeoutSeconds); {seen}")
        else:
            missing = [p for p in sorted(current, key=lambda p: p.index)
                       if not (p.phase == SUCCEEDED or (p.phase == RUNNING and p.ready))]
            present = {p.index for p in current}
            names = [f"node {p.index} (pod {p.name}: {p.phase}"
                     + (f", {p.reason}" if p.reason else "") + ")" for p in missing]
            names += [f"node {i} (no pod)" for i in range(job.num_nodes) if i not in present]
            if not names:
                return None  # every pod runs: the group is about to be Running
            message = (f"{', '.join(names)} not running {timeout}s after the group was created "
                       f"(spec.runPolicy.stallTimeoutSeconds): the other nodes wait for it in the "
                       f"rendezvous; {seen}")
        self.out.condition(STALLED, True, RESTART_STALLED, message)
        self.out.status["lastFailure"] = message
        self.out.status["lastFailureReason"] = RESTART_STALLED
        # restart() posts the Warning event (reason Stalled) with this message.
        return self.restart(message, RESTART_STALLED, counted=True)

    def progress(self, current: list[PodState]) -> Plan:
        job, out = self.job, self.out
        present = {p.index for p in current}
        create = [i for i in range(job.num_nodes) if i not in present]
        # Count the pods this pass creates as Pending: the next pass, which sees them, then finds
        # nothing to change and writes nothing.
        out.counts(current + [PodState(f"{job.name}-{i}", i, self.group_attempt, PENDING)
                              for i in create])
        if create and not present:
            out.status.setdefault("startTime", format_time(self.now))
            out.status["attemptStartTime"] = format_time(self.now)
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
            return self.done(delete=pods_to_clean(job, current))
        if running == job.num_nodes and not create:
            message = f"all {job.num_nodes} node(s) running, {job.world_size} process(es) in total"
            out.phase(RUNNING, "AllNodesRunning", message)
            if STALLED in out.conditions:
                out.condition(STALLED, False, "AllNodesRunning", message)
            return self.done()
        if out.previous_phase not in (RESTARTING,):
            out.status["phase"] = PENDING
        self.waiting(current)
        return self.done(create=create)
