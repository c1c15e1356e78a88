"""Plan: from what a pass observed to what it must do. One pure function, `plan_pass`.

It renders the accelerate config (resolving the topology the spec leaves to the YAML), builds
every missing child (the rendered ConfigMap, the
headless Service, the pods) with the builders in resources/, asks status.plan_reconcile for the
new status and the pods to create and delete, and says which logs to archive, which events to
post and whether the job's TTL has passed. No clock (`now` is an argument), no API calls:
observe.py gathers the Observed, apply.py carries the Actions out. A pod the API server refused
in an earlier pass is one more observation here, not a second planning call."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from accelerate_trainer.config import ConfigError

from .api import JobSpec, SpecError
from .constants import FINISHED_PHASES
from .naming import configmap_name, service_name, trainer_container_name
from .resources.configmap import ConfigSource, prepare_config
from .resources.pods import build_pod
from .resources.service import build_service
from .status import Event, Plan, PodState, plan_reconcile


@dataclass(frozen=True)
class Observed:
    """One job as a pass sees it."""

    body: Mapping[str, Any]
    job: JobSpec
    status: Mapping[str, Any]
    pods: tuple[PodState, ...]
    # (kind, name) of the job's ConfigMaps and Services that exist.
    children: frozenset[tuple[str, str]]
    # The user's ConfigMap (spec.accelerateConfigFrom): the accelerate YAML and the files beside
    # it, read only while the rendered ConfigMap has to be created or the topology depends on it.
    config_source: ConfigSource | None = None
    # Why the job cannot run, as found while observing (its ConfigMap is missing), or the API
    # server's refusal of one of its pods in an earlier pass.
    config_error: str | None = None
    refused: str | None = None

    @property
    def finished(self) -> bool:
        return self.status.get("phase") in FINISHED_PHASES

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.children


@dataclass(frozen=True)
class Archive:
    """Keep the last log lines of these pods of `attempt` before they are deleted."""

    attempt: int
    pods: tuple[str, ...]
    container: str | None


@dataclass(frozen=True)
class Actions:
    """Everything one pass changes, in the order apply.py does it."""

    archive: Archive | None = None
    read_final_progress: bool = False  # the job finishes now: catch rank 0's last report
    delete: tuple[str, ...] = ()  # pod names
    children: tuple[dict[str, Any], ...] = ()  # ConfigMap and Service manifests
    pods: tuple[dict[str, Any], ...] = ()  # Pod manifests
    status: dict[str, Any] | None = None  # what to write (progress aside), None: unchanged
    events: tuple[Event, ...] = ()
    delete_job: bool = False
    # When time alone will change the plan (a TTL, a deadline), for the operator's clock.
    requeue_after: float | None = None


def plan_pass(seen: Observed, now: datetime) -> Actions:
    job, children, config_error = _missing_children(seen)
    reason = "InvalidConfig"
    if seen.refused and not config_error:
        config_error, reason = seen.refused, "PodRejected"
    plan = plan_reconcile(job, seen.status, seen.pods, now, config_error=config_error,
                          config_error_reason=reason)
    finishing = not seen.finished and plan.status.get("phase") in FINISHED_PHASES
    return Actions(
        archive=_archive(seen, plan),
        read_final_progress=finishing,
        delete=plan.delete,
        children=() if finishing else tuple(children),
        pods=tuple(build_pod(job, index, plan.attempt) for index in plan.create),
        status=_changed(seen.status, plan.status),
        events=plan.events,
        delete_job=plan.delete_job,
        requeue_after=plan.requeue_after,
    )


def _missing_children(seen: Observed) -> tuple[JobSpec, list[dict[str, Any]], str | None]:
    """The job with its topology resolved against its accelerate YAML, the ConfigMap and Service
    to (re)create, or why the job cannot run. A finished job gets none back; a child deleted by
    hand is recreated by the next pass that sees it missing."""
    job = seen.job
    if seen.finished:
        return job, [], None
    if seen.config_error:
        return job, [], seen.config_error
    children = []
    rendered = seen.has("ConfigMap", configmap_name(job.name))
    if not rendered or not job.topology_resolved:
        try:
            job, configmap = prepare_config(job, seen.config_source)
        except (ConfigError, SpecError) as error:
            return seen.job, [], str(error)
        if not rendered:
            children.append(configmap)
    if not seen.has("Service", service_name(job.name)):
        children.append(build_service(job))
    return job, children, None


def _archive(seen: Observed, plan: Plan) -> Archive | None:
    """A restart deletes the group of the previous attempt: keep what its pods printed."""
    previous = int(seen.status.get("attempt") or 0)
    if plan.attempt <= previous or not plan.delete:
        return None
    names = sorted({p.name for p in seen.pods if p.attempt == previous} & set(plan.delete))
    if not names:
        return None
    return Archive(previous, tuple(names), trainer_container_name(seen.job.template))


# Status keys only the log reader writes (apply.refresh_progress): never written by a pass, which
# could put back a stale copy, nor compared.
READER_KEYS = ("progress", "trainer")


def _changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any] | None:
    """The status to write, or None when it says nothing new. status.progress and
    status.trainer are not the planner's (only the log reader writes them), so they are neither
    written nor compared."""
    public = {k: v for k, v in new.items() if k not in READER_KEYS}
    previous = {k: v for k, v in old.items() if k not in READER_KEYS}
    return public if public != previous else None
