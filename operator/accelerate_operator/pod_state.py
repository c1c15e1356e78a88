"""Reading pods: what a pass needs to know of each pod of a job (PodState), of a node that is
not Ready (NodeState), and of a launch that failed in a running pod (ProcessExit). Pure: a Pod
or Node manifest in, a frozen record out; the indexes keep the pods so read (indexes.py), and
reads.py reads the Nodes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from accelerate_trainer.contract import (
    ATTEMPT_LABEL,
    MAX_MESSAGE_CHARS,
    NODE_INDEX_LABEL,
    RUN_ATTEMPT_ANNOTATION,
    printable_text,
)

from .causes import OOM_KILLED, read_exit_cause, read_pod_cause
from .constants import DEFAULT_CONTAINER_ANNOTATION, FAILED, PENDING, RUNNING, SUCCEEDED
from .not_started import NotStarted, read_not_started
from .timefmt import parse_time


@dataclass(frozen=True)
class PodState:
    """What a pass needs to know of one pod."""

    name: str
    index: int
    attempt: int
    phase: str
    uid: str = ""
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
    # The pod's latest report to the operator's endpoint (report_server.py), as JSON text,
    # filled in by the controller from its ReportStore (with_report): read by snapshot.py.
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
    # Why a pod has not started, as the scheduler or the kubelet says (not_started.py); and the
    # root cause of its failure when one is known (causes.py: out of memory).
    not_started: NotStarted | None = None
    cause: str | None = None
    # metadata.resourceVersion: whether kopf's index shows the pod as the API server lists it
    # (cache_sync.py).
    resource_version: str = ""

    @property
    def finished(self) -> bool:
        return self.phase in (SUCCEEDED, FAILED)

    @property
    def live(self) -> bool:
        """Neither ended nor on its way out: it holds (or will hold) its node's resources."""
        return not self.deleting and not self.finished

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
# node's, not the training's: node shutdown, a node that is gone. Not `Evicted`: the kubelet's
# eviction for node pressure also sets DisruptionTarget (TerminationByKubelet), and one without it
# is for the pod's own limits (ephemeral-storage, an emptyDir's sizeLimit): the job's, like an
# OOMKilled container's, so counted.
NODE_DISRUPTION_REASONS = frozenset({"NodeLost", "Shutdown", "NodeShutdown", "Terminated",
                                     "UnexpectedAdmissionError"})


@dataclass(frozen=True)
class ProcessExit:
    """A failed launch a pod reported (the `exit` of its report, contract.REPORT_BODY_KEY): the
    pod runs on and waits for the operator's next attempt."""

    attempt: int
    exit_code: int
    message: str | None = None
    # The first failing rank's own error or out of memory, naming the pod (causes.py).
    cause: str | None = None
    oom: bool = False


def read_process_exit(report: str | None, pod: str = "") -> ProcessExit | None:
    """The `exit` of a pod's report, or None. The report is the pod's own writing (the
    endpoint bounds its size): anything malformed is no exit."""
    if not report or '"exit"' not in report:
        return None
    try:
        ended = json.loads(report).get("exit")
        attempt, code = ended["attempt"], ended["exitCode"]
        message = ended.get("message")
        cause = read_exit_cause(ended, pod)
        oom = ended.get("reason") == OOM_KILLED
    except (ValueError, AttributeError, KeyError, TypeError):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (attempt, code)) \
            or code == 0:
        return None
    return ProcessExit(attempt, code, message if isinstance(message, str) else None, cause,
                       oom)


def trainer_name(pod: Mapping[str, Any]) -> str | None:
    """The container that trains: the one the default-container annotation names, else the
    first (the pod builder's order)."""
    named = ((pod.get("metadata") or {}).get("annotations") or {}).get(
        DEFAULT_CONTAINER_ANNOTATION)
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    return named if isinstance(named, str) and named else containers[0].get("name")


def _trainer_status(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The trainer's container status ({} before the kubelet wrote one)."""
    name = trainer_name(pod)
    return next((c for c in (pod.get("status") or {}).get("containerStatuses") or []
                 if c.get("name") == name), {})


def _ended(container: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return (container.get("state") or {}).get("terminated") or None


def _failed_init(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The status of an init container that failed (the pod's containers never ran); a native
    sidecar (restartPolicy Always) ended with the pod is none."""
    sidecars = {c.get("name") for c in (pod.get("spec") or {}).get("initContainers") or []
                if c.get("restartPolicy") == "Always"}
    return next((c for c in (pod.get("status") or {}).get("initContainerStatuses") or []
                 if c.get("name") not in sidecars and (_ended(c) or {}).get("exitCode", 0)),
                None)


def _speaking(pod: Mapping[str, Any], trainer: Mapping[str, Any]
              ) -> tuple[Mapping[str, Any] | None, str]:
    """The ended container that speaks for the pod, and how the message names it: a failed init
    container, else the trainer (its status `trainer`) once it ended (a sidecar's exit follows
    from the pod's end), else a failed container before a succeeded one."""
    failed_init = _failed_init(pod)
    if failed_init is not None:
        return _ended(failed_init), f"init container {failed_init.get('name')}"
    ended = [c for c in (pod.get("status") or {}).get("containerStatuses") or [] if _ended(c)]
    chosen = (trainer if _ended(trainer) else None) or next(
        (c for c in ended if _ended(c).get("exitCode", 0)), ended[0] if ended else None)
    return (_ended(chosen) if chosen else None), ""


def _terminated(pod: Mapping[str, Any], trainer: Mapping[str, Any]
                ) -> tuple[int | None, str | None, str | None]:
    """The exit code, reason and message that speak for the pod (_speaking)."""
    terminated, whose = _speaking(pod, trainer)
    if terminated is None:
        return None, None, None
    message = terminated.get("message")
    if isinstance(message, str):  # the container's own words (its log's tail): printable
        message = printable_text(message, MAX_MESSAGE_CHARS, keep_end=True)
    if whose:
        message = f"{whose}: {message}" if message else whose
    return terminated.get("exitCode"), terminated.get("reason"), message


def _phase(pod: Mapping[str, Any], trainer: Mapping[str, Any]) -> str:
    """The kubelet's phase (it alone knows the pod ended), or Failed once the trainer (its status
    `trainer`) failed while another container keeps the pod Running: with restartPolicy Never
    it never runs again, and a plain sidecar (a mesh's proxy) may never end. A trainer that
    succeeded waits for the pod's other containers (an uploader may still be at work), as
    Kubernetes does. A pod being deleted keeps its phase: its trainer ends because of the
    deletion."""
    status = pod.get("status") or {}
    phase = status.get("phase") or PENDING
    if phase != RUNNING or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return phase
    return FAILED if (_ended(trainer) or {}).get("exitCode", 0) else phase


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
    trainer = _trainer_status(pod)
    exit_code, reason, message = _terminated(pod, trainer)
    disruption, reason, message = _disruption(status, reason, message)
    name = metadata.get("name", "")
    return PodState(
        name=name,
        index=int(labels.get(NODE_INDEX_LABEL, -1)),
        attempt=int(labels.get(ATTEMPT_LABEL, 0)),
        phase=_phase(pod, trainer),
        ready=ready,
        deleting=bool(metadata.get("deletionTimestamp")),
        exit_code=exit_code,
        reason=reason,
        message=message,
        disruption=disruption,
        uid=metadata.get("uid") or "",
        node=(pod.get("spec") or {}).get("nodeName"),
        gone_by=parse_time(metadata.get("deletionTimestamp")),
        run_attempt=_integer(annotations.get(RUN_ATTEMPT_ANNOTATION)),
        not_started=read_not_started(pod),
        cause=read_pod_cause(pod),
        resource_version=metadata.get("resourceVersion") or "",
    )


def with_report(pod: PodState, report: str | None) -> PodState:
    """The pod with what it last reported to the endpoint (the pods' own objects carry no
    report): its report's text and the failed launch it says."""
    if report is None:
        return pod
    return replace(pod, report=report, exit=read_process_exit(report, pod.name))


def read_node_state(name: str, node: Mapping[str, Any] | None) -> NodeState | None:
    """A Node (None: gone) as the pass needs it: None while it is Ready."""
    if node is None:
        return NodeState(name, None, reporting=False)
    ready = next((c for c in (node.get("status") or {}).get("conditions") or []
                  if c.get("type") == "Ready"), {})
    if ready.get("status") == "True":
        return None
    return NodeState(name, parse_time(ready.get("lastTransitionTime")),
                     reporting=ready.get("status") == "False")


def _integer(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
