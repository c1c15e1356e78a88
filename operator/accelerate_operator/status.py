"""Writing status: the conditions, phase, node counts and events a pass builds (StatusBuilder),
and the few facts read back from a status (attempt_of, group_attempt) or merged into one
(merge_patch). The one status write of a pass is decide.py's. Pure."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .api import JobSpec
from .constants import (
    CONDITION_TYPES,
    CREATED,
    FAILED,
    FIELD_MANAGER,
    GROUP,
    KIND,
    PENDING,
    QUEUED,
    RESTARTING,
    RUNNING,
    SUCCEEDED,
    SUSPENDED,
    VERSION,
    WAITING,
)
from .pod_state import PodState
from .timefmt import format_time

# True while the job's accelerate config holds values accelerate would drop harmlessly (the
# render's JobSpec.config_warnings); listed after the phase conditions. Set on the pass that
# renders the config and kept from the status afterwards, since later passes do not render it.
CONFIG_WARNINGS = "ConfigWarnings"
CONFIG_WARNINGS_REASON = "IgnoredConfigValues"


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


# client-go's recorder and events.k8s.io/v1 (its `note`) hold an event's text to 1 KiB.
MAX_EVENT_MESSAGE = 1024


def cut_middle(text: str, limit: int) -> str:
    """`text` in at most `limit` characters: its start (the root cause comes first) and its end
    (a log's last lines, what restarts next), marked `[...]` where cut."""
    if len(text) <= limit:
        return text
    mark = " [...] "
    head = (limit - len(mark)) // 2
    return text[:head] + mark + text[-(limit - len(mark) - head):]


def build_event(metadata: Mapping[str, Any], event: Event, now: datetime) -> dict[str, Any]:
    """A core/v1 Event about the job (what `kubectl describe` lists); the API server names it
    (generateName), as client-go's recorder has it named."""
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{metadata['name']}.", "namespace": metadata["namespace"]},
        "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                           "name": metadata["name"], "namespace": metadata["namespace"],
                           "uid": metadata.get("uid")},
        "type": event.type, "reason": event.reason,
        "message": cut_middle(event.message, MAX_EVENT_MESSAGE),
        "firstTimestamp": format_time(now), "lastTimestamp": format_time(now), "count": 1,
        "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
    }


def build_topology_status(job: JobSpec) -> dict[str, Any]:
    """status.topology: what the job runs, whichever side each number came from; an elastic
    job's at the size it wants (status.elastic has the size its group runs at)."""
    nodes = job.wanted_nodes
    return {
        "numNodes": nodes,
        "numProcPerNode": job.nproc_per_node,
        "worldSize": nodes * job.nproc_per_node,
        "masterPort": job.master_port,
        "summary": f"{nodes}x{job.nproc_per_node}",
    }


class StatusBuilder:
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
        """Enter `phase`: set its condition True, clear the other live ones, emit an event.
        The message is said once, in the phase's condition: a cleared condition only names the
        phase (a failure's text, up to a few KiB, was in every condition)."""
        self.status["phase"] = phase
        if phase != PENDING:
            self.condition(phase, True, reason, message)
        for other in (QUEUED, WAITING, RUNNING, RESTARTING, SUSPENDED):
            if other != phase and other in self.conditions:
                self.condition(other, False, reason, f"the job is {phase} now ({reason})")
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
        self.status.pop("reason", None)
        reason = self.reason()
        if reason:
            self.status["reason"] = reason
        return self.status

    def reason(self) -> str | None:
        """status.reason, the REASON column of `kubectl get`: why a job not yet running waits
        (the Waiting condition's reason, Kubernetes' own), else its phase condition's reason
        (Kueue's for a Queued job), else the Created condition's for a Pending one."""
        phase = self.status.get("phase")
        waiting = self.conditions.get(WAITING) or {}
        if phase in (PENDING, RESTARTING) and waiting.get("status") == "True":
            return waiting.get("reason")
        for type_ in (phase, CREATED if phase == PENDING else None):
            condition = self.conditions.get(type_) if type_ else None
            if condition and condition.get("status") == "True":
                return condition.get("reason")
        return None


def attempt_of(status: Mapping[str, Any]) -> int:
    """status.attempt: the attempt the training processes run."""
    return int(status.get("attempt") or 0)


# The nodes of the current group that finished, as a Job's status.completedIndexes ("0,2-4").
COMPLETED_INDEXES = "completedIndexes"


def format_indexes(indexes: Iterable[int]) -> str:
    """Node indexes as a Job writes its completedIndexes: sorted, runs as `first-last`."""
    runs: list[list[int]] = []
    for index in sorted(set(indexes)):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def parse_indexes(text: Any, limit: int) -> set[int]:
    """format_indexes read back, below `limit`; what does not parse is no index."""
    found: set[int] = set()
    for part in text.split(",") if isinstance(text, str) else ():
        first, _, last = part.partition("-")
        if first.isdigit() and (last.isdigit() or not last):
            found.update(range(int(first), min(int(last or first), limit - 1) + 1))
    return found


def group_attempt(status: Mapping[str, Any]) -> int:
    """The attempt the group's pods were created for (their label): status.groupAttempt, left
    out while it is status.attempt (in-place restarts move only status.attempt)."""
    return int(status.get("groupAttempt", status.get("attempt")) or 0)


def merge_patch(document: Mapping[str, Any] | None, patch: Mapping[str, Any]) -> dict[str, Any]:
    """`document` with a JSON merge patch (RFC 7386, as the operator writes status) applied:
    null removes a key, an object merges into an object, anything else replaces."""
    result = dict(document or {})
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = merge_patch(result[key], value)
        else:
            result[key] = value
    return result
