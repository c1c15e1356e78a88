"""Why a pod has not started: Kubernetes' own reason and message, as the scheduler and the kubelet
wrote them on the pod (the PodScheduled condition, a container's `state.waiting`). Pure: a Pod
manifest in, a frozen record out. The job's Waiting condition and its Warning events repeat them
(startup.py), so `kubectl describe ajob` says what `kubectl describe pod` would."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Reasons of a pod that is on its way: pulling, creating, initialising. Every other reason the
# kubelet writes (ErrImagePull, ImagePullBackOff, ErrImageNeverPull, InvalidImageName,
# CreateContainerConfigError, CreateContainerError, CrashLoopBackOff, RunContainerError...)
# says the pod cannot start until someone acts.
ON_ITS_WAY = frozenset({"ContainerCreating", "PodInitializing"})
# Reasons that alternate while one cause lasts (the kubelet retries a pull, failing each time):
# one Warning event for the whole family.
FAMILIES = {"ErrImagePull": "ImagePull", "ImagePullBackOff": "ImagePull"}
# The wait between two tries of a family: before Kubernetes 1.32 its message is only `Back-off
# pulling image "..."`, so the error it waits after stays what the job says.
BACK_OFFS = frozenset({"ImagePullBackOff"})
UNSCHEDULABLE = "Unschedulable"
# The PodScheduled condition's reasons of a pod no node takes: none fits, or the scheduler failed
# on it (a volume it could not bind or provision, a plugin's error).
NOT_SCHEDULED = frozenset({UNSCHEDULABLE, "SchedulerError"})


@dataclass(frozen=True)
class NotStarted:
    """What keeps a pod from starting: Kubernetes' reason and message, and the container that
    cannot start (None: the pod itself, not yet scheduled); `exit_code` an init container's
    last exit code; `since` when the scheduler first found no node for it, as written (the
    PodScheduled condition's lastTransitionTime: an elastic job shrinks after
    spec.elastic.shrinkAfterSeconds of it), or, for a container that waits, when the pod got
    its node."""

    reason: str
    message: str = ""
    container: str | None = None
    init: bool = False
    exit_code: int | None = None
    since: str | None = None
    # Read from the pod's newest Warning event (reads.pod_warning): a cause Kubernetes writes
    # nowhere on the pod (a volume it cannot mount).
    from_event: bool = False

    @property
    def stuck(self) -> bool:
        """Whether the pod cannot start until someone acts (or the cluster changes)."""
        return self.reason not in ON_ITS_WAY

    @property
    def family(self) -> str:
        return family(self.reason)

    def describe(self, pod: str) -> str:
        """`pod j-0 cannot be scheduled: Unschedulable: 0/2 nodes are available: ...`."""
        if self.from_event:
            head = f"pod {pod} cannot start: {self.reason}"
        elif self.container is None:
            head = f"pod {pod} cannot be scheduled: {self.reason}"
        else:
            kind = "init container" if self.init else "container"
            head = f"pod {pod} cannot start: {kind} {self.container}: {self.reason}"
            if self.exit_code is not None:
                head += f" (its last run exited with code {self.exit_code})"
        return f"{head}: {self.message.strip()}" if self.message.strip() else head


def family(reason: str) -> str:
    """The cause a reason belongs to, for one event per cause."""
    return FAMILIES.get(reason, reason)


def read_not_started(pod: Mapping[str, Any]) -> NotStarted | None:
    """Why a pod that has not started cannot: unschedulable first (nothing else can happen
    before it has a node), then its init containers in order (the kubelet runs them one by
    one), then its containers. None for a pod whose containers all run or ended, or which says
    nothing yet."""
    status = pod.get("status") or {}
    scheduled = None
    for condition in status.get("conditions") or []:
        if condition.get("type") != "PodScheduled":
            continue
        if condition.get("status") == "False" and condition.get("reason") in NOT_SCHEDULED:
            return NotStarted(condition["reason"], condition.get("message") or "",
                              since=condition.get("lastTransitionTime"))
        scheduled = condition.get("lastTransitionTime")
    for key, init in (("initContainerStatuses", True), ("containerStatuses", False)):
        for container in status.get(key) or []:
            waiting = (container.get("state") or {}).get("waiting")
            if waiting and waiting.get("reason"):
                last = (container.get("lastState") or {}).get("terminated") or {}
                return NotStarted(waiting["reason"], waiting.get("message") or "",
                                  container.get("name"), init, last.get("exitCode"),
                                  since=scheduled)
    return None
