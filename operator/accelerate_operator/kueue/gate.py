"""The Kueue policy of the lifecycle (lifecycle.py): a queued job's group runs only while Kueue
admits its Workload. Stopping a group for Kueue starts a new attempt without counting a restart:
an eviction is not a failure. Free functions over the lifecycle's Facts and Counters and the
status being built; what Kueue must be told comes out of writes.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..constants import PENDING, QUEUED
from ..outcome import Counters, Ending, Facts, Outcome, conclude
from ..status import Event, StatusBuilder
from .workload import KueueView, WorkloadStatus

# Kueue admitted the job with a ResourceFlavor that is gone: no pod is placed; looked at again
# this often (nothing watches ResourceFlavors).
FLAVOR_NOT_FOUND = "FlavorNotFound"
FLAVOR_WAIT_SECONDS = 2.0


def gate(facts: Facts, out: StatusBuilder, counters: Counters, kueue: KueueView
         ) -> tuple[Outcome | None, Counters, bool]:
    """(the Outcome when the queue decides the pass, the counters, whether the evicted
    Workload's quota goes back). The Outcome is None when the group may run, or when the job is
    suspended (the lifecycle suspends it, releasing the quota as said)."""
    workload = kueue.workload_status
    recorded = dict(facts.status.get("queue") or {})
    out.status["queue"] = queue_status(kueue, recorded)
    admitted = workload is not None and workload.admitted and workload.evicted is None
    suspended = facts.job.run_policy.suspend
    if admitted and not suspended:
        if kueue.missing_flavors:
            return flavors_missing(facts, out, counters, kueue), counters, False
        admit(facts, out, workload)
        return None, counters, False
    counters, release = stop_group(facts, out, counters, workload, recorded)
    if suspended:
        return None, counters, release
    out.counts([p for p in facts.pods if p.attempt == counters.group])
    queued_phase(out, kueue)
    return conclude(facts, out, counters, Ending(
        delete=[p.name for p in facts.pods if not p.deleting], release=release)), counters, \
        release


def queue_status(kueue: KueueView, recorded: Mapping[str, Any]) -> dict[str, Any]:
    """status.queue: the LocalQueue, the Workload, where Kueue admitted it, the evictions."""
    workload = kueue.workload_status
    return {
        "name": kueue.queue,
        **({"workload": workload.name} if workload else {}),
        **({"clusterQueue": workload.cluster_queue} if workload and workload.cluster_queue
           else {}),
        **({"flavors": list(workload.flavors)} if workload and workload.flavors else {}),
        **({"evictions": recorded["evictions"]} if "evictions" in recorded else {}),
    }


def flavors_missing(facts: Facts, out: StatusBuilder, counters: Counters, kueue: KueueView
                    ) -> Outcome:
    """Admitted with a ResourceFlavor that no longer exists: where the pods belong is not known,
    so none is made, and the job says why (one Warning); the pass looks again soon, for nothing
    watches ResourceFlavors."""
    workload = kueue.workload_status
    message = (f"Kueue admitted workload {workload.name} with ResourceFlavor "
               f"{', '.join(kueue.missing_flavors)}, which does not exist: no pod is placed "
               "until it does (recreate it, or set the Workload's spec.active to false and "
               "back to true for Kueue to admit it again)")
    known = (out.conditions.get(QUEUED) or {}).get("reason") == FLAVOR_NOT_FOUND
    events = len(out.events)
    out.counts([p for p in facts.pods if p.attempt == counters.group])
    out.phase(QUEUED, FLAVOR_NOT_FOUND, message)
    del out.events[events:]
    if not known:
        out.events.append(Event("Warning", FLAVOR_NOT_FOUND, message))
    return conclude(facts, out, counters, Ending(requeue_after=FLAVOR_WAIT_SECONDS))


def admit(facts: Facts, out: StatusBuilder, workload: WorkloadStatus) -> None:
    """A Queued job Kueue admitted: Pending again, its group is about to be created."""
    if out.previous_phase != QUEUED:
        return
    flavors = ", ".join(workload.flavors) or "no flavor"
    message = (f"Kueue admitted workload {workload.name} in ClusterQueue "
               f"{workload.cluster_queue} ({flavors}): starting all "
               f"{facts.job.num_nodes} node(s)")
    out.condition(QUEUED, False, "Admitted", message)
    out.events.append(Event("Normal", "Admitted", message))
    out.status["phase"] = out.previous_phase = PENDING


def stop_group(facts: Facts, out: StatusBuilder, counters: Counters,
               workload: WorkloadStatus | None, recorded: Mapping[str, Any]
               ) -> tuple[Counters, bool]:
    """The group must not run: stop every pod. Pods of the current attempt still running make
    this a new attempt (the next group restarts from the last checkpoint), and no restart is
    counted. The quota goes back (the bool) once no pod holds its node's resources: a pod still
    terminating (saving a checkpoint in its grace period) does, and the next admitted group must
    not share the nodes with it."""
    current = [p for p in facts.pods if p.attempt == counters.group]
    if any(p.live for p in current):
        counters = counters.new_group()
        if workload is not None and workload.evicted is not None:
            out.status["queue"]["evictions"] = int(recorded.get("evictions") or 0) + 1
    holding = [p for p in facts.pods if not p.finished]
    return counters, bool(workload and workload.evicted and workload.reserved and not holding)


def queued_phase(out: StatusBuilder, kueue: KueueView) -> None:
    """Queued, saying what Kueue does: deactivated, evicted, creating, or not admitting yet."""
    workload = kueue.workload_status
    if workload is not None and workload.deactivated is not None:
        held_by_kueue(out, workload)
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
                  f"waiting for Kueue: LocalQueue {kueue.queue}, workload being created")
    else:
        pending = workload.pending
        out.phase(QUEUED, pending.reason if pending else "Pending",
                  f"waiting for Kueue to admit workload {workload.name} in LocalQueue "
                  f"{kueue.queue}" + (f": {pending.message}" if pending else ""))


def held_by_kueue(out: StatusBuilder, workload: WorkloadStatus) -> None:
    """Kueue deactivated the Workload (requeuing limit, maximum execution time, a rejected
    admission check...): the job is held, with Kueue's reason, until the Workload is made
    active again; the operator never undoes Kueue's decision (writes.active_write)."""
    deactivated = workload.deactivated
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
