"""The Kueue steps of a pass: a queued job's group runs only while Kueue admits its Workload.
Stopping a group for Kueue starts a new attempt without counting a restart: an eviction is not a
failure. What Kueue must be told comes out as QueueWrites (plan.py builds the writes)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .constants import FINISHED_PHASES, PENDING, QUEUED, RUNNING
from .kueue import WorkloadView, pods_ready_reason
from .status import Event

if TYPE_CHECKING:
    from .decision import Plan

# Kueue admitted the job with a ResourceFlavor that is gone: no pod is placed; looked at again
# this often (nothing watches ResourceFlavors).
FLAVOR_NOT_FOUND = "FlavorNotFound"
FLAVOR_WAIT_SECONDS = 2.0


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


class QueueSteps:
    """The Kueue steps of the pass (decision._Pass): they read its queue (QueueState) and
    move its state (out, the attempt, release) and end it with its done() or suspend()."""

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
