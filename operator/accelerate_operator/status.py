"""Decide, from the job and its pods alone, what the job's status is and what must change.

Pure: `plan_reconcile(job, status, pods, now)` takes everything as arguments (the clock too) and
returns a Plan; kube.py carries it out. Running it twice on the same input gives the same plan,
so a restarted operator, or two events arriving together, never double-count a restart.

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
their creation, is Stalled and restarted (counted).

A job queued with Kueue (`QueueState`) runs only while its Workload is admitted: before that, and
after an eviction, it has no pod. Stopping a group for Kueue starts a new attempt without
counting a restart: an eviction is not a failure."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from accelerate_trainer.contract import (
    ATTEMPT_LABEL,
    CONFIG_ERROR_EXIT_CODE,
    NODE_INDEX_LABEL,
    REPORT_ANNOTATION,
    RUN_ATTEMPT_ANNOTATION,
)

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
    STALLED,
    SUCCEEDED,
    SUSPENDED,
)
from .kueue import WorkloadView, pods_ready_reason

# True while the job's accelerate config holds values accelerate would drop harmlessly (the
# render's JobSpec.config_warnings); listed after the phase conditions. Set on the pass that
# renders the config and kept from the status afterwards, since later passes do not render it.
CONFIG_WARNINGS = "ConfigWarnings"
CONFIG_WARNINGS_REASON = "IgnoredConfigValues"


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
    # Why Kubernetes ends the pod when it is not the pod's own doing: the DisruptionTarget
    # condition's reason (EvictionByEvictionAPI, PreemptionByScheduler, DeletionByTaintManager,
    # TerminationByKubelet, DeletionByPodGC...), or the pod's own status.reason for a node that
    # went away (NodeLost, Shutdown, Terminated) or a kubelet eviction (Evicted). None otherwise.
    disruption: str | None = None
    # Pod 0's pushed report (contract.REPORT_ANNOTATION), as written: parsed by observe.py.
    report: str | None = None
    # The node it is bound to (spec.nodeName), and, once deleted, when its grace period ends
    # (metadata.deletionTimestamp): a pod still there after that waits on its node's kubelet.
    node: str | None = None
    gone_by: datetime | None = None
    # In-place restarts: the attempt the operator last asked this pod to run
    # (contract.RUN_ATTEMPT_ANNOTATION; None: a pod that cannot restart in place), and the
    # failed launch it reported.
    run_attempt: int | None = None
    exit: ProcessExit | None = None

    @property
    def finished(self) -> bool:
        return self.phase in (SUCCEEDED, FAILED)

    def waits_on_node(self, now: datetime) -> bool:
        """Whether this pod's state says its node may be lost, so the pass reads the Node: it
        runs but is not Ready (the node controller marks every pod of a node it stops hearing
        from), or it outlived its deletion's grace period (only a kubelet confirms a deletion).
        """
        if not self.node or self.finished:
            return False
        overdue = self.gone_by is not None and now >= self.gone_by
        return (self.phase == RUNNING and not self.ready) or overdue


@dataclass(frozen=True)
class NodeState:
    """A node holding one of the job's pods that is not Ready, as the pass read it: since when
    (its Ready condition's last transition; None: the Node object is gone), and whether its
    kubelet still reports (Ready False: the kubelet runs and ends its pods itself) or not
    (Unknown, or the Node gone: nothing on it confirms a deletion)."""

    name: str
    since: datetime | None
    reporting: bool

    def describe(self, now: datetime) -> str:
        if self.since is None:
            return f"node {self.name} is gone"
        seconds = int((now - self.since).total_seconds())
        state = "NotReady" if self.reporting else "unreachable (its kubelet stopped reporting)"
        return f"node {self.name} has been {state} for {seconds}s"


# status.reason values the kubelet or the node controller set on a pod it ends for reasons of the
# node's, not the training's: node pressure eviction, node shutdown, a node that is gone.
NODE_DISRUPTION_REASONS = frozenset({"Evicted", "NodeLost", "Shutdown", "NodeShutdown",
                                     "Terminated", "UnexpectedAdmissionError"})

# The Restarting condition's reasons: why the group restarts.
RESTART_FAILED, RESTART_DISRUPTED, RESTART_STALLED = "PodFailed", "Disrupted", "Stalled"
RESTART_PROCESS_FAILED = "ProcessFailed"  # a launch failed in a running pod: restarted in place

# Kueue admitted the job with a ResourceFlavor that is gone: no pod is placed; looked at again
# this often (nothing watches ResourceFlavors).
FLAVOR_NOT_FOUND = "FlavorNotFound"
FLAVOR_WAIT_SECONDS = 2.0


@dataclass(frozen=True)
class ProcessExit:
    """A failed launch a pod reported (contract.REPORT_ANNOTATION's `exit`): the pod runs on and
    waits for the operator's next attempt."""

    attempt: int
    exit_code: int
    message: str | None = None
    # What the pod found of the launch's root cause (contract.EXIT_ROOT_CAUSE_FIELDS), each
    # None when not reported or malformed.
    root_cause: str | None = None
    rank: int | None = None
    signal: str | None = None
    reason: str | None = None
    oom_kills: int | None = None
    memory_limit_bytes: int | None = None


def _root_cause_fields(ended: Mapping[str, Any]) -> dict[str, Any]:
    """The root-cause fields of a report's `exit`, by type: a wrong type is left out."""
    def text(key: str) -> str | None:
        value = ended.get(key)
        return value if isinstance(value, str) else None

    def number(key: str) -> int | None:
        value = ended.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return {"root_cause": text("rootCause"), "rank": number("rank"), "signal": text("signal"),
            "reason": text("reason"), "oom_kills": number("oomKills"),
            "memory_limit_bytes": number("memoryLimitBytes")}


def read_process_exit(report: str | None) -> ProcessExit | None:
    """The `exit` of a pod's report, or None. The report is the pod's own writing (bounded by
    the chart's admission policy): anything malformed is no exit."""
    if not report or '"exit"' not in report:
        return None
    try:
        ended = json.loads(report).get("exit")
        attempt, code = ended["attempt"], ended["exitCode"]
        message = ended.get("message")
    except (ValueError, AttributeError, KeyError, TypeError):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (attempt, code)) \
            or code == 0:
        return None
    return ProcessExit(attempt, code, message if isinstance(message, str) else None,
                       **_root_cause_fields(ended))


@dataclass(frozen=True)
class Failure:
    pod: str
    reason: str
    exit_code: int | None = None
    message: str | None = None
    # A disruption (see PodState.disruption): restarts without using up backoffLimit.
    disrupted: bool = False

    def describe(self) -> str:
        text = f"pod {self.pod} {self.reason}"
        if self.exit_code is not None:
            text += f" with exit code {self.exit_code}"
        if self.message:
            text += f": {self.message.strip()}"
        return text


@dataclass(frozen=True)
class Activity:
    """What the runtime last saw of rank 0, for stall detection: `last_activity` the timestamp of
    the newest line of pod <job>-0's trainer log (read with timestamps=true), or of the newest
    progress report, whichever is later; `last_step` the newest step rank 0 reported. Both None
    until the runtime has read anything of the current attempt."""

    last_activity: datetime | None = None
    last_step: int | None = None


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
    missing_flavors: tuple[str, ...] = ()  # admitted with, and not on the API server


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
    # Pods on a lost node, deleted with no grace period: no kubelet would ever confirm it.
    force_delete: tuple[str, ...] = ()
    # The attempt the group's pods are created for (status.groupAttempt), and its running pods
    # to tell `attempt`, the one they must run (an in-place restart).
    group: int = 0
    tell: tuple[str, ...] = ()


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


def _terminated(status: Mapping[str, Any]) -> tuple[dict[str, int | None], int | None,
                                                    str | None, str | None]:
    """Each ended container's exit code by name, and the exit code, reason and message that
    speak for the pod: a failed container's before a succeeded one's."""
    ended: dict[str, int | None] = {}
    exit_code = reason = message = None
    for container in status.get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated is not None:
            ended[container.get("name")] = terminated.get("exitCode")
        if terminated and (exit_code is None or terminated.get("exitCode", 0) != 0):
            exit_code = terminated.get("exitCode")
            reason, message = terminated.get("reason"), terminated.get("message")
    return ended, exit_code, reason, message


def _disruption(status: Mapping[str, Any], reason: str | None, message: str | None
                ) -> tuple[str | None, str | None, str | None]:
    """(disruption, reason, message): a DisruptionTarget condition, why a pod cannot be
    scheduled (what a Stalled group that never started names), or the reason set on the pod
    itself (Evicted, DeadlineExceeded, NodeLost...)."""
    disruption = None
    for condition in status.get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            disruption = condition.get("reason") or "DisruptionTarget"
            message = condition.get("message") or message
        elif (condition.get("type") == "PodScheduled" and condition.get("status") == "False"
              and reason is None):
            reason, message = condition.get("reason"), condition.get("message")
    if status.get("reason"):
        reason, message = status["reason"], status.get("message") or message
        if disruption is None and reason in NODE_DISRUPTION_REASONS:
            disruption = reason
    return disruption, reason, message


def read_pod_state(pod: Mapping[str, Any]) -> PodState:
    """Summarise a Pod manifest: phase, readiness, and the trainer's exit code and message."""
    metadata = pod.get("metadata", {})
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    ended, exit_code, reason, message = _terminated(status)
    disruption, reason, message = _disruption(status, reason, message)
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
        disruption=disruption,
        report=annotations.get(REPORT_ANNOTATION),
        node=(pod.get("spec") or {}).get("nodeName"),
        gone_by=parse_time(metadata.get("deletionTimestamp")),
        run_attempt=_integer(annotations.get(RUN_ATTEMPT_ANNOTATION)),
        exit=read_process_exit(annotations.get(REPORT_ANNOTATION)),
    )


def group_attempt(status: Mapping[str, Any]) -> int:
    """The attempt the group's pods were created for (their label): status.groupAttempt, left
    out while it is status.attempt."""
    return int(status.get("groupAttempt", status.get("attempt")) or 0)


def _integer(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


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
    """An RFC 3339 time (the API server's and ours end in Z), as UTC without tzinfo."""
    if not text:
        return None
    return _naive(datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text))


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
            self.conditions[t] for t in (*CONDITION_TYPES, CONFIG_WARNINGS)
            if t in self.conditions
        ]
        self.status.setdefault("restarts", 0)
        self.status.setdefault("restartsCounted", self.status["restarts"])
        return self.status


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
            failures.append(Failure(p.name, f"was lost with its node: {lost[p.name]}",
                                    disrupted=True))
        elif p.disruption:
            failures.append(Failure(p.name, f"was disrupted ({p.disruption})", p.exit_code,
                                    p.message, disrupted=True))
        elif p.deleting and p.phase != SUCCEEDED and (was_running or p.phase == RUNNING):
            # Its ranks are going away: every other rank would wait in its collectives forever.
            failures.append(Failure(p.name, "is being deleted", disrupted=True))
        elif p.phase == FAILED:
            failures.append(Failure(
                p.name, "failed" if not p.reason or p.reason == "Error" else f"failed ({p.reason})",
                p.exit_code, p.message))
    if was_running:
        # Once the group runs, a pod that disappears (deleted, its node gone) takes its ranks
        # with it.
        present = {p.index for p in current}
        for index in range(job.num_nodes):
            if index not in present:
                failures.append(Failure(f"{job.name}-{index}", "was deleted", disrupted=True))
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
                 now: datetime, queue: QueueState | None = None,
                 activity: Activity | None = None,
                 lost_nodes: Mapping[str, NodeState] | None = None):
        self.job, self.pods, self.now, self.queue = job, list(pods), now, queue
        self.activity = activity or Activity()
        self.lost_nodes = lost_nodes or {}
        self.stall_due: datetime | None = None  # when the group would be Stalled
        self.node_due: datetime | None = None  # when a NotReady node would count as lost
        self.node_lost = False  # the group restarts for a lost node: no grace period for any
        self.out = _StatusBuilder(job, status, now)
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
            due = [self._deadline(), self.stall_due, self.node_due]
            known = [max((d - self.now).total_seconds(), 0.0) for d in due if d is not None]
            requeue_after = min(known) if known else None
        return Plan(status, self.attempt, tuple(create),
                    tuple(name for name in delete if name not in force),
                    tuple(self.out.events), delete_job, requeue_after,
                    self._queue_writes(status), force, self.group_attempt,
                    self._behind(status, delete))

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
        return self.done(delete=_cleanup(self.job, self.pods))

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
        return self.done(delete=_cleanup(self.job, self.pods), delete_job=delete_job,
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

    def queue_gate(self) -> Plan | None:
        """A queued job's group runs only while Kueue admits its Workload. Returns the Plan when
        the queue decides the pass (the group must not run), None when it may run."""
        workload = self.queue.workload
        recorded = dict(self.status.get("queue") or {})
        self.out.status["queue"] = self._queue_status(workload, recorded)
        admitted = workload is not None and workload.admitted and workload.evicted is None
        if admitted and not self.job.run_policy.suspend:
            if self.queue.missing_flavors:
                return self._flavors_missing(workload)
            self._admitted(workload)
            return None
        self._stop_group(workload, recorded)
        if self.job.run_policy.suspend:
            return self.suspend()
        self.out.counts([p for p in self.pods if p.attempt == self.group_attempt])
        self._queued_phase(workload)
        return self.done(delete=[p.name for p in self.pods if not p.deleting])

    def _flavors_missing(self, workload: WorkloadView) -> Plan:
        """Admitted with a ResourceFlavor that no longer exists: where the pods belong is not
        known, so none is made, and the job says why (one Warning); the pass looks again soon,
        for nothing watches ResourceFlavors."""
        out = self.out
        message = (f"Kueue admitted workload {workload.name} with ResourceFlavor "
                   f"{', '.join(self.queue.missing_flavors)}, which does not exist: no pod "
                   "is placed until it does (recreate it, or set the Workload's spec.active "
                   "to false and back to true for Kueue to admit it again)")
        known = (out.conditions.get(QUEUED) or {}).get("reason") == FLAVOR_NOT_FOUND
        events = len(out.events)
        out.counts([p for p in self.pods if p.attempt == self.group_attempt])
        out.phase(QUEUED, FLAVOR_NOT_FOUND, message)
        del out.events[events:]
        if not known:
            out.events.append(Event("Warning", FLAVOR_NOT_FOUND, message))
        return self.done(requeue_after=FLAVOR_WAIT_SECONDS)

    def _queue_status(self, workload: WorkloadView | None, recorded: Mapping[str, Any]
                      ) -> dict[str, Any]:
        return {
            "name": self.queue.name,
            **({"workload": workload.name} if workload else {}),
            **({"clusterQueue": workload.cluster_queue} if workload and workload.cluster_queue
               else {}),
            **({"flavors": list(workload.flavors)} if workload and workload.flavors else {}),
            **({"evictions": recorded["evictions"]} if "evictions" in recorded else {}),
        }

    def _admitted(self, workload: WorkloadView) -> None:
        out = self.out
        if out.previous_phase != QUEUED:
            return
        flavors = ", ".join(workload.flavors) or "no flavor"
        message = (f"Kueue admitted workload {workload.name} in ClusterQueue "
                   f"{workload.cluster_queue} ({flavors}): starting all "
                   f"{self.job.num_nodes} node(s)")
        out.condition(QUEUED, False, "Admitted", message)
        out.events.append(Event("Normal", "Admitted", message))
        out.status["phase"] = out.previous_phase = PENDING

    def _stop_group(self, workload: WorkloadView | None, recorded: Mapping[str, Any]) -> None:
        """The group must not run: stop every pod. Pods of the current attempt still running
        make this a new attempt (the next group restarts from the last checkpoint), and no
        restart is counted. The quota goes back once no pod holds its node's resources: a pod
        still terminating (saving a checkpoint in its grace period) does, and the next admitted
        group must not share the nodes with it."""
        current = [p for p in self.pods if p.attempt == self.group_attempt]
        if any(not p.deleting and not p.finished for p in current):
            self._new_group()
            if workload is not None and workload.evicted is not None:
                self.out.status["queue"]["evictions"] = int(recorded.get("evictions") or 0) + 1
        holding = [p for p in self.pods if not p.finished]
        self.release = bool(workload and workload.evicted and workload.reserved and not holding)

    def _queued_phase(self, workload: WorkloadView | None) -> None:
        out, queue = self.out, self.queue
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
        ended = [Failure(p.name, "ended its training processes", p.exit.exit_code,
                         p.exit.message) for p in sorted(current, key=lambda p: p.index)
                 if p.exit is not None and p.exit.attempt == self.attempt]
        if ended:
            return self.restart_or_fail(ended, in_place=self._in_place(current))
        if stale:
            # Wait until the previous attempt's pods are gone: the new ones reuse their names.
            # They were deleted gracefully: each rank may be saving its share of a checkpoint.
            self.out.counts(current)
            return self.done(delete=[p.name for p in stale if not p.deleting])
        return self.stalled(current) or self.progress(current)

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
        first = (disrupted or list(failures))[0]
        self.out.status["lastFailure"] = first.describe()
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
            return max(since, _naive(seen)), "running"
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
            return self.done(delete=_cleanup(job, current))
        if running == job.num_nodes and not create:
            message = f"all {job.num_nodes} node(s) running, {job.world_size} process(es) in total"
            out.phase(RUNNING, "AllNodesRunning", message)
            if STALLED in out.conditions:
                out.condition(STALLED, False, "AllNodesRunning", message)
            return self.done()
        if out.previous_phase not in (RESTARTING,):
            out.status["phase"] = PENDING
        return self.done(create=create)


def _naive(moment: datetime) -> datetime:
    """UTC without tzinfo, as parse_time and the planner's clock give it."""
    if moment.tzinfo is None:
        return moment
    return (moment - moment.utcoffset()).replace(tzinfo=None)


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
