"""The elastic policy (spec.elastic), two links of the lifecycle's chain (lifecycle.py); elastic.py
decides the sizes, this module reads the pods for it and carries its decisions out.

- `resize`, before the group's policy: once pods of the current group have been unschedulable
  for spec.elastic.shrinkAfterSeconds (a lost node whose replacement finds no room, a drained
  node), the group restarts from its last complete checkpoint at the largest allowed size its
  placed pods fill; while it runs reduced and the scheduler has placed placeholders for the
  missing nodes, it restarts at the size they make room for. A grow deletes the pods
  gracefully, so every rank saves a checkpoint (checkpoint_on_stop); a shrink deletes them with
  no grace period, as a group with a pod never placed never formed (outcome.never_formed).
  Either restart is a disruption: counted in status.restarts, not against backoffLimit. The
  pods of the new group get the topology and the accumulation of the new size
  (elastic.group_size, read back from status.elastic by decide.py).
- `hold_capacity`, after whichever policy ended the lifecycle: while the group runs reduced, one
  placeholder pod per missing node (resources/placeholder.py) asks the scheduler for that
  capacity; they go at full size, when the job finishes and when it is suspended.

Pure, as every policy: Facts in, Outcome out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .constants import FINISHED_PHASES, RESIZED, RESTARTING, RUNNING, SUSPENDED
from .elastic import (
    GroupPlacement,
    Resize,
    at_size,
    build_elastic_status,
    decide_grow,
    decide_shrink,
    placeholder_indices,
    wanted_nodes,
)
from .not_started import UNSCHEDULABLE
from .outcome import Counters, Ending, Facts, Outcome, conclude, never_formed
from .pod_state import PodState
from .status import StatusBuilder
from .timefmt import parse_time


def resize(facts: Facts, out: StatusBuilder, counters: Counters
           ) -> tuple[Outcome | None, float | None]:
    """(the group restarted at another size, None), or (None, in how many seconds a shrink
    may be due). Writes status.elastic for every elastic job."""
    job = facts.job
    if job.elastic is None:
        return None, None
    out.status["elastic"] = build_elastic_status(job, facts.status.get("elastic"))
    if any(p.attempt != counters.group for p in facts.pods):
        return None, None  # the group before is still going: the group's policy waits for it
    current = [p for p in facts.pods if p.attempt == counters.group]
    decision = decide_shrink(job, placement(facts, current), facts.now)
    if decision.resize is None and runs(out, current, job.num_nodes):
        decision = decide_grow(job, placed(facts.placeholders))
    if decision.resize is None:
        return None, decision.requeue_after
    return restart_at(facts, out, counters, decision.resize), None


def placement(facts: Facts, current: Sequence[PodState]) -> GroupPlacement:
    """How many of the group's pods are bound to a node that is not lost, and since when (and
    why) the unschedulable ones are."""
    live = [p for p in current if not p.deleting and not p.finished]
    bound = [p for p in live if p.node and p.node not in facts.lost_nodes]
    waiting = sorted((p for p in live if not p.node and p.not_started is not None
                      and p.not_started.reason == UNSCHEDULABLE), key=lambda p: p.index)
    times = [t for p in waiting if (t := parse_time(p.not_started.since)) is not None]
    return GroupPlacement(len(bound), min(times) if times else None,
                          tuple(p.not_started.describe(p.name) for p in waiting))


def runs(out: StatusBuilder, current: Sequence[PodState], size: int) -> bool:
    """The group runs whole: the only state it grows from (a failing group restarts first)."""
    return out.previous_phase == RUNNING and len(current) == size \
        and all(p.phase == RUNNING and p.ready and not p.deleting for p in current)


def placed(placeholders: Sequence[PodState]) -> int:
    """Placeholders running on a node: their capacity is there for the group's pods."""
    return sum(p.phase == RUNNING and p.ready and not p.deleting for p in placeholders)


def restart_at(facts: Facts, out: StatusBuilder, counters: Counters, to: Resize) -> Outcome:
    """A new attempt at `to.size`: every pod of this one deleted (with no grace period when one
    of them was never placed: the group never formed); a Warning event for a shrink (naming
    the pods that could not be placed and why), a Normal one to grow."""
    job, shrunk = facts.job, to.size < facts.job.num_nodes
    counters = replace(counters, restarts=counters.restarts + 1).new_group()
    out.status["restarts"] = counters.restarts
    out.status["restartsCounted"] = counters.counted
    out.status["elastic"] = build_elastic_status(at_size(job, to.size),
                                                 facts.status.get("elastic"), facts.now)
    out.counts(facts.pods)
    out.condition(RESIZED, to.size < wanted_nodes(job), to.reason, to.message)
    out.phase(RESTARTING, to.reason, to.message, warning=shrunk)
    return conclude(facts, out, counters,
                    Ending(delete=[p.name for p in facts.pods if not p.deleting],
                           no_grace=never_formed(facts.pods)))


def hold_capacity(facts: Facts, outcome: Outcome) -> Outcome:
    """The placeholders the job keeps after this pass: one per missing node while its group
    runs reduced (created once it runs, so none takes a node the group's own pods need), none
    at full size, finished or suspended; a placeholder that ended is replaced."""
    phase = outcome.status.get("phase")
    size = (outcome.status.get("elastic") or {}).get("nodes")
    keep: tuple[int, ...] = ()
    if facts.job.elastic is not None and isinstance(size, int) \
            and phase not in (*FINISHED_PHASES, SUSPENDED):
        keep = placeholder_indices(at_size(facts.job, size))
    drop = tuple(p.name for p in facts.placeholders
                 if not p.deleting and (p.finished or p.index not in keep))
    # A name still taken (a placeholder on its way out) is created again by a later pass.
    taken = {p.index for p in facts.placeholders}
    create = tuple(i for i in keep if i not in taken) if phase == RUNNING else ()
    if not drop and not create:
        return outcome
    return replace(outcome, delete=outcome.delete + drop, placeholders=create)
