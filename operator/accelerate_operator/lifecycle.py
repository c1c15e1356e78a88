"""The job's lifecycle: from the job, its status and its pods to the new status and what must
change, as a chain of policies, each a free function over explicit arguments (outcome.py's
Facts, Counters and the status being built), as JobSet's failure_policy.go does:

1. a finished job only cleans up, and deletes itself once its TTL has passed;
2. a job that cannot run (`error`: its config, a refused child, Kueue's admission) fails;
3. the values accelerate would drop are named (the ConfigWarnings condition);
4. a queued job's group runs only while Kueue admits it (kueue/gate.py);
5. a suspended job stops its pods, and starts a fresh group when resumed;
6. past spec.runPolicy.activeDeadlineSeconds it fails;
7. an elastic job's group restarts at another size when its pods cannot all be placed, or when
   capacity for the missing ones has returned (resize.py);
8. else the group's policy decides (group.py): restart, stall, create, run, succeed;
9. whichever policy ended it, an elastic job running reduced keeps its placeholders, and any
   other gives them up (resize.hold_capacity).

Pure: `run_lifecycle` takes everything as arguments (the clock too) and returns an Outcome;
running it twice on the same input gives the same outcome, so a restarted operator, or two events
arriving together, never double-count a restart. A new policy is one more function in the chain
of `run_lifecycle`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from .api import JobSpec
from .constants import FINISHED_PHASES, PENDING, SUSPENDED
from .group import run_group
from .kueue.gate import gate
from .kueue.workload import KueueView
from .outcome import (
    Activity,
    Counters,
    Ending,
    Facts,
    Outcome,
    conclude,
    deadline,
    fail,
    pods_to_clean,
)
from .pod_state import NodeState, PodState
from .resize import hold_capacity, resize
from .status import CONFIG_WARNINGS, CONFIG_WARNINGS_REASON, Event, StatusBuilder
from .timefmt import parse_time


@dataclass(frozen=True)
class JobError:
    """Why a job cannot run, found before its lifecycle (its config, a child the API server
    refused, an admission that cannot be applied): the job fails with `reason`."""

    message: str
    reason: str = "InvalidConfig"


def run_lifecycle(job: JobSpec, status: Mapping[str, Any], pods: Sequence[PodState],
                  now: datetime, *, error: JobError | None = None,
                  kueue: KueueView | None = None, activity: Activity | None = None,
                  lost_nodes: Mapping[str, NodeState] | None = None,
                  placeholders: Sequence[PodState] = ()) -> Outcome:
    """The whole lifecycle decision for one pass. `job` is at the size its group runs at
    (elastic.group_size); `kueue` is set for a job queued with Kueue (its group runs only while
    admitted); `activity` is what pod 0 last reported, for spec.runPolicy.stallTimeoutSeconds;
    `lost_nodes` the nodes of its pods that are not Ready, by name (reads.py reads them);
    `placeholders` an elastic job's placeholder pods. The Outcome's `requeue_after` says when
    time alone will change the decision (a TTL, a deadline, a stall, a timeout, a shrink)."""
    facts = Facts(job, status, tuple(pods), now, activity or Activity(), lost_nodes or {},
                  tuple(placeholders))
    return hold_capacity(facts, lifecycle(facts, error, kueue))


def lifecycle(facts: Facts, error: JobError | None, kueue: KueueView | None) -> Outcome:
    """The chain of policies, the first that ends the lifecycle deciding."""
    job, status = facts.job, facts.status
    out, counters = StatusBuilder(job, status, facts.now), Counters.of(status)
    if out.previous_phase in FINISHED_PHASES:
        return finished(facts, out, counters)
    if error is not None:
        return fail(facts, out, counters, error.reason, error.message)
    config_warnings(job, out)
    release = False
    if kueue is not None and kueue.queue:
        gated, counters, release = gate(facts, out, counters, kueue)
        if gated is not None:
            return gated
    if job.run_policy.suspend:
        return suspend(facts, out, counters, release)
    if out.previous_phase == SUSPENDED:
        counters = resume(out, counters)
    ended = deadline_exceeded(facts, out, counters)
    if ended is not None:
        return ended
    resized, shrink_due = resize(facts, out, counters)
    return resized or sooner(run_group(facts, out, counters), shrink_due)


def sooner(outcome: Outcome, seconds: float | None) -> Outcome:
    """`outcome`, looked at again in `seconds` at the latest."""
    if seconds is None or (outcome.requeue_after is not None
                           and outcome.requeue_after <= seconds):
        return outcome
    return replace(outcome, requeue_after=seconds)


def finished(facts: Facts, out: StatusBuilder, counters: Counters) -> Outcome:
    """A finished job only cleans up, and deletes itself when its TTL has passed."""
    out.counts(facts.pods)
    ttl = facts.job.run_policy.ttl_seconds_after_finished
    finished_at = parse_time(facts.status.get("completionTime"))
    delete_job, requeue = False, None
    if ttl is not None and finished_at:
        expires = finished_at + timedelta(seconds=ttl)
        delete_job = facts.now >= expires
        requeue = None if delete_job else (expires - facts.now).total_seconds()
    return conclude(facts, out, counters,
                    Ending(delete=pods_to_clean(facts.job, facts.pods), delete_job=delete_job,
                           requeue_after=requeue))


def config_warnings(job: JobSpec, out: StatusBuilder) -> None:
    """Name the values accelerate would drop: one Warning event when the list first shows (or
    changes), and the ConfigWarnings condition, which `kubectl describe` keeps showing."""
    warnings = job.config_warnings
    if not warnings:
        return
    message = (f"{len(warnings)} accelerate config value(s) would be ignored; training goes "
               "on: " + " | ".join(warnings))
    before = out.conditions.get(CONFIG_WARNINGS, {}).get("message")
    out.condition(CONFIG_WARNINGS, True, CONFIG_WARNINGS_REASON, message)
    if before != message:
        out.events.append(Event("Warning", CONFIG_WARNINGS_REASON, message))


def suspend(facts: Facts, out: StatusBuilder, counters: Counters,
            release: bool = False) -> Outcome:
    """spec.runPolicy.suspend: every pod is deleted, the job waits in Suspended (a queued job's
    evicted Workload gives its quota back once no pod holds it: `release`)."""
    out.counts(facts.pods)
    out.phase(SUSPENDED, "Suspended",
              "spec.runPolicy.suspend is true: pods deleted; set it to false to resume")
    return conclude(facts, out, counters, Ending(
        delete=[p.name for p in facts.pods if not p.deleting], release=release))


def resume(out: StatusBuilder, counters: Counters) -> Counters:
    """A fresh group: pods of the suspended attempt may still be terminating."""
    counters = counters.new_group()
    out.condition(SUSPENDED, False, "Resumed",
                  "spec.runPolicy.suspend is false: starting a fresh group")
    out.events.append(
        Event("Normal", "Resumed", f"starting a fresh group (attempt {counters.attempt})"))
    out.status["phase"] = PENDING
    out.previous_phase = PENDING
    return counters


def deadline_exceeded(facts: Facts, out: StatusBuilder, counters: Counters) -> Outcome | None:
    """spec.runPolicy.activeDeadlineSeconds has passed since the job started: it fails."""
    due = deadline(facts)
    if due is None or facts.now < due:
        return None
    return fail(facts, out, counters, "DeadlineExceeded",
                f"the job ran longer than spec.runPolicy.activeDeadlineSeconds "
                f"({facts.job.run_policy.active_deadline_seconds}s)")
