"""Decide: the one function that decides a pass, `decide(Snapshot) -> Decision`. Pure: no clock
(the snapshot holds it), no API calls; the reconciler's Applier carries the Decision out.

It renders the accelerate config (resolving the topology the spec leaves to the YAML), names why
the job cannot run if it cannot (`job_error`: a read, the render, a child the API server refused,
Kueue's admission, in that order), runs the job's lifecycle (lifecycle.py: the new status, the
pods to create and delete, the events), and builds what that takes: every missing child (the
rendered ConfigMap, the headless Service, the PodDisruptionBudget when the job asks for one, the
pods, placed as Kueue admitted them, and the Workload of a queued job), the status write with pod
0's progress and versions, the CA bundle for the job's ConfigMap, the writes Kueue is owed, the
logs to archive before a restart deletes a group, and when time alone will change the job."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from accelerate_trainer.config import ConfigError
from accelerate_trainer.contract import REPORT_CA_KEY

from .api import JobSpec, SpecError
from .constants import FINISHED_PHASES
from .elastic import group_size
from .goodput import Moment, update_goodput
from .kueue import (
    FLAVOR_WAIT_SECONDS,
    KueueView,
    Placement,
    WorkloadWrite,
    admitted_placement,
    build_workload,
    with_placement,
    workload_writes,
)
from .lifecycle import JobError, run_lifecycle
from .naming import configmap_name, pdb_name, service_name, trainer_container_name, workload_name
from .outcome import Activity, Outcome
from .progress import build_progress_status, build_trainer_status, progress_changed
from .resources.configmap import ca_digest, prepare_config, with_report_ca
from .resources.pdb import build_pdb
from .resources.placeholder import build_placeholder_pod
from .resources.pods import build_pod
from .resources.service import build_service
from .snapshot import Snapshot
from .status import attempt_of

# An unfinished job is looked at again at least this often: a pass that changed nothing is
# cheap, and this bounds how long anything missed (a lost event, a failed read) can last.
RESYNC_SECONDS = 30.0


# Status keys from what pod 0 reported, and the goodput they move: written only when
# this pass writes, never put back from an older copy, and not compared with the lifecycle's status.
READER_KEYS = ("progress", "trainer", "goodput")


@dataclass(frozen=True)
class Readings:
    """What pod 0 reported that this pass writes (status.progress, status.trainer, both as
    merge patches; None: not written), and for goodput the step it brings (None: no new
    progress) with when pod 0 saw it, and, restarted in place, the last step of the attempt
    before and when it came."""

    progress: Mapping[str, Any] | None = None
    trainer: Mapping[str, Any] | None = None
    step: int | None = None
    step_time: datetime | None = None
    previous_step: int | None = None
    previous_time: datetime | None = None


@dataclass(frozen=True)
class Archive:
    """Keep the last log lines of these pods of `attempt` before they are deleted."""

    attempt: int
    pods: tuple[str, ...]
    container: str | None


@dataclass(frozen=True)
class Decision:
    """Everything one pass does, in the order the Applier does it: the lifecycle's `outcome` (the
    pods to delete, force-delete and tell the attempt, the events, the job's own deletion) and
    what it takes built: the logs to archive, the Workload writes, the children, pods and
    placeholder pods to create, the CA bundle for the job's ConfigMap, the one status write
    (None: unchanged), and when time alone will next change the job (seconds; None: never)."""

    outcome: Outcome = field(default_factory=Outcome)
    archive: Archive | None = None
    workload_writes: tuple[WorkloadWrite, ...] = ()
    children: tuple[dict[str, Any], ...] = ()  # ConfigMap, Service, PDB, Workload manifests
    pods: tuple[dict[str, Any], ...] = ()  # Pod manifests
    # An elastic job's placeholder pods to create (refused, they fail nothing: reconciler.py).
    placeholders: tuple[dict[str, Any], ...] = ()
    ca_patch: tuple[str, dict[str, str]] | None = None  # (ConfigMap, data to merge)
    status: dict[str, Any] | None = None
    # The status write carries a new status.progress: the next waits the progress write interval
    # (report_settings.PROGRESS_WRITE_SECONDS, an operator setting).
    progress_written: bool = False
    requeue_after: float | None = None


def decide(seen: Snapshot) -> Decision:
    """The whole decision of one pass."""
    job, children, render_error = render(seen)
    job = group_size(job, seen.status)
    kueue = seen.kueue if seen.kueue is not None and seen.kueue.queue else None
    placement = _placement(seen, kueue, job)
    outcome = run_lifecycle(job, seen.status, seen.pods, seen.now,
                            error=job_error(seen, render_error, placement), kueue=kueue,
                            activity=activity(seen), lost_nodes=seen.lost_nodes,
                            placeholders=seen.placeholders)
    pods = build_pods(seen, job, outcome, placement)
    readings, progress_due = read_progress(seen)
    status = build_status_write(seen.status, outcome.status, readings, seen.created, seen.now)
    finishing = not seen.finished and outcome.status.get("phase") in FINISHED_PHASES
    new = (() if finishing else tuple(children)) + _workload(seen, kueue, job, outcome)
    waits = [outcome.requeue_after, progress_due, grace_ends(seen),
             FLAVOR_WAIT_SECONDS if outcome.create and pods is None else None]
    return Decision(
        outcome=outcome, archive=archive(seen, outcome),
        workload_writes=_workload_writes(kueue, job, outcome, seen), children=new,
        pods=pods or (), ca_patch=ca_patch(seen), status=status,
        placeholders=tuple(build_placeholder_pod(job, i) for i in outcome.placeholders),
        progress_written=readings.progress is not None,
        requeue_after=requeue_after(seen, status, waits))


def render(seen: Snapshot) -> tuple[JobSpec, list[dict[str, Any]], str | None]:
    """The job with its topology resolved against its accelerate YAML, the ConfigMap, Service
    and PDB to (re)create, or why the config cannot run. A finished job gets none back, nor a
    job a read already found cannot run; a child deleted by hand is recreated by the next pass
    that sees it missing."""
    job = seen.job
    if seen.finished or seen.config_error:
        return job, [], None
    children = []
    rendered = seen.has("ConfigMap", configmap_name(job.name))
    if not rendered or not job.topology_resolved:
        try:
            job, configmap = prepare_config(job, seen.config_source)
        except (ConfigError, SpecError) as error:
            return seen.job, [], str(error)
        if not rendered:
            children.append(with_report_ca(configmap, seen.report_ca))
    if not seen.has("Service", service_name(job.name)):
        children.append(build_service(job))
    if job.run_policy.pod_disruption_budget and not seen.has("PodDisruptionBudget",
                                                             pdb_name(job.name)):
        children.append(build_pdb(job))
    return job, children, None


def job_error(seen: Snapshot, render_error: str | None,
              placement: Placement | str | None) -> JobError | None:
    """Why the job cannot run, the first that holds: a read found it (its ConfigMap or priority
    class is missing), its config does not render, the API server refused one of its children,
    Kueue's admission cannot be applied."""
    if seen.finished:
        return None
    if seen.config_error or render_error:
        return JobError(seen.config_error or render_error or "")
    if seen.refused is not None:
        return JobError(seen.refused.message, seen.refused.reason)
    if isinstance(placement, str):
        return JobError(placement, "AdmissionNotApplicable")
    return None


def _placement(seen: Snapshot, kueue: KueueView | None, job: JobSpec
               ) -> Placement | str | None:
    if kueue is None or kueue.workload is None or seen.finished:
        return None
    return admitted_placement(kueue.workload, kueue.flavors, job, seen.pods)


def build_pods(seen: Snapshot, job: JobSpec, outcome: Outcome,
               placement: Placement | str | None) -> tuple[dict[str, Any], ...] | None:
    """The pods the lifecycle creates, for the group of its attempt, placed as Kueue admitted
    them; None for a queued job whose placement is not known yet (a flavor the pass could not
    read yet): none is created, and the pass looks again soon."""
    pods = tuple(build_pod(job, index, outcome.group, outcome.attempt, seen.report_endpoint)
                 for index in outcome.create)
    if not pods or seen.kueue is None or not seen.kueue.queue:
        return pods
    if not isinstance(placement, Placement):
        return None
    return tuple(with_placement(pod, placement, index)
                 for pod, index in zip(pods, outcome.create, strict=True))


def _workload(seen: Snapshot, kueue: KueueView | None, job: JobSpec,
              outcome: Outcome) -> tuple[dict[str, Any], ...]:
    """The Workload of a queued job, until it exists."""
    if kueue is None or kueue.workload is not None \
            or outcome.status.get("phase") in FINISHED_PHASES \
            or seen.has("Workload", workload_name(job.name, job.uid)):
        return ()
    return (build_workload(job, kueue.queue or "", kueue.priority_class, kueue.priority,
                           kueue.version),)


def _workload_writes(kueue: KueueView | None, job: JobSpec, outcome: Outcome,
                     seen: Snapshot) -> tuple[WorkloadWrite, ...]:
    """What the Workload of a queued job is owed after this pass's outcome."""
    if kueue is None or kueue.workload is None:
        return ()
    return workload_writes(kueue.workload, job, outcome.status, outcome.release, seen.now)


def activity(seen: Snapshot) -> Activity:
    """What pod 0 of the current group last reported, for stall detection; a report of an
    attempt restarted in place since is history: only its sign of life counts."""
    report = seen.report
    if report is None:
        return Activity()
    if report.attempt is not None and report.attempt < attempt_of(seen.status):
        return Activity(report.last_output)
    return Activity(report.last_output, report.step, report.last_step_done)


def read_progress(seen: Snapshot) -> tuple[Readings, float | None]:
    """What of pod 0's report this pass writes (its progress when it changed and a write is
    due, its versions once per group), and, when a progress write waits, in how long."""
    report = seen.report
    if report is None:
        return Readings(), None
    trainer = _trainer(seen)
    if report.attempt is not None and report.attempt < attempt_of(seen.status):
        return Readings(trainer=trainer), None  # the progress of an attempt since restarted
    current = seen.status.get("progress") or {}
    new = build_progress_status(report.progress, report.received or seen.now) \
        if report.progress else None
    # The step goes to goodput with any write, held back or not: a progress write carries no
    # ledger (build_status_write), so a write that happens anyway must bring it up to date.
    base = Readings(trainer=trainer, step=report.step, step_time=report.progress_time,
                    previous_step=report.previous_step, previous_time=report.previous_time)
    if new is None or not progress_changed(current, new):
        return base, None
    if seen.clock < seen.next_progress_write and not seen.rank0.finished:
        return base, seen.next_progress_write - seen.clock
    # A merge patch keeps keys it does not name: null out those the new report lacks.
    return replace(base, progress={**{key: None for key in current if key not in new},
                                   **new}), None


def _trainer(seen: Snapshot) -> dict[str, Any] | None:
    """status.trainer from the versions pod 0 reported, once per group."""
    versions = seen.report.versions if seen.report else None
    current = seen.status.get("trainer") or {}
    if not versions or current.get("attempt") == seen.group:
        return None
    containers = (seen.job.template.get("spec") or {}).get("containers") or [{}]
    return build_trainer_status(versions, seen.group, containers[0].get("image"), current)


def ca_patch(seen: Snapshot) -> tuple[str, dict[str, str]] | None:
    """The CA bundle the pods must trust, into the job's ConfigMap when it holds another (the
    operator's certificate was renewed): the kubelet copies it into the pods' report volume."""
    if seen.finished or not seen.report_ca or seen.configmap_ca is None \
            or seen.configmap_ca == ca_digest(seen.report_ca):
        return None
    return configmap_name(seen.job.name), {REPORT_CA_KEY: seen.report_ca}


def archive(seen: Snapshot, outcome: Outcome) -> Archive | None:
    """A restart deletes the group of the previous attempt: keep what its pods printed (the
    attempts they ran in place too)."""
    previous = attempt_of(seen.status)
    gone = outcome.delete + outcome.force_delete
    if outcome.attempt <= previous or not gone:
        return None
    names = sorted({p.name for p in seen.pods if p.attempt == seen.group} & set(gone))
    if not names:
        return None
    return Archive(previous, tuple(names), trainer_container_name(seen.job.template))


def grace_ends(seen: Snapshot) -> float | None:
    """A pass when the grace period of a pod being deleted ends: nothing else may come (a lost
    node sends no event), and a pod still there then waits on its node (reads.py)."""
    ends = [(p.gone_by - seen.now).total_seconds() + 1.0 for p in seen.pods
            if p.node and p.gone_by is not None and p.gone_by > seen.now and not p.finished]
    return min(ends) if ends else None


def build_status_write(old: Mapping[str, Any], planned: Mapping[str, Any],
                       readings: Readings, created: datetime, now: datetime
                       ) -> dict[str, Any] | None:
    """The one status write of a pass: the planned status when it changed, plus pod 0's
    progress and versions when this pass has new ones; None when there is nothing new. The
    goodput goes with a write that happens anyway, so it costs no request of its own; a write
    of progress alone carries its totals but not its ledger, unless the ledger moved beyond the
    step it last saw (ledger_moved)."""
    status = _changed(old, planned)
    extra = {key: value for key, value in (("progress", readings.progress),
                                           ("trainer", readings.trainer)) if value is not None}
    if status is None and not extra:
        return None
    moment = Moment(now, created, old.get("phase"), planned.get("phase"), attempt_of(old),
                    attempt_of(planned), readings.step, readings.step_time,
                    readings.previous_step, readings.previous_time, reduced(old))
    goodput = update_goodput(old.get("goodput"), moment)
    if status is None and not ledger_moved(old.get("goodput"), goodput):
        goodput = {key: value for key, value in goodput.items() if key != "ledger"}
    return {**(status or {}), **extra, "goodput": goodput}


# What a running job's ledger changes at every report: the next write that carries the ledger
# brings these up to date from pod 0's report (read_progress gives every write the step).
LEDGER_STEP_KEYS = ("highestStep", "lastStep", "lastStepTime")


def ledger_moved(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether the goodput ledger changed more than its step: a segment closed or opened, time
    lost counted, an interruption. Only then does a progress write store it."""
    def without_step(goodput: Mapping[str, Any] | None) -> dict[str, Any] | None:
        ledger = (goodput or {}).get("ledger")
        return None if ledger is None else {key: value for key, value in ledger.items()
                                            if key not in LEDGER_STEP_KEYS}
    return without_step(old) is None or without_step(old) != without_step(new)


def reduced(status: Mapping[str, Any]) -> bool:
    """The group of an elastic job runs at a smaller size than the job wants (status.elastic)."""
    elastic = status.get("elastic") or {}
    return int(elastic.get("nodes") or 0) < int(elastic.get("wantedNodes") or 0)


def _changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any] | None:
    """The status to write, or None when it says nothing new. status.progress and
    status.trainer are not the lifecycle's (only what pod 0 reports writes them), so they are
    neither written nor compared."""
    public = {k: v for k, v in new.items() if k not in READER_KEYS}
    previous = {k: v for k, v in old.items() if k not in READER_KEYS}
    return public if public != previous else None


def requeue_after(seen: Snapshot, status: Mapping[str, Any] | None,
                  waits: list[float | None]) -> float | None:
    """When time alone will next change the job: the earliest of `waits` (a deadline, a TTL, a
    stall, a progress write held back, a grace period's end), and the resync of an unfinished
    job; None for a finished job with none of these. A running job's progress needs no timer:
    pod 0's reports come as events."""
    phase = (status or {}).get("phase") or seen.status.get("phase")
    known = [w for w in (*waits, RESYNC_SECONDS if phase not in FINISHED_PHASES else None)
             if w is not None]
    return min(known) if known else None
