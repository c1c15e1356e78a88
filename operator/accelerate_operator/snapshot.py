"""The one input of a pass: `Snapshot`, everything decide.py decides from, frozen. The controller
fills it from kopf's indexes (the job, its pods with their latest reports, its children, its
Workload) and the job's JobState (our last status write, what we created that the indexes do
not show yet, when a progress write is next allowed, a child the API server refused); reads.py
completes it with the few reads from the API server a pass needs. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

from .api import JobSpec
from .constants import FINISHED_PHASES
from .kueue.workload import KueueView
from .pod_state import NodeState, PodState
from .progress import PushedReport, parse_report
from .resources.configmap import ConfigSource
from .resources.pods import DEFAULT_REPORT_ENDPOINT, ReportEndpoint
from .state import Refusal
from .status import group_attempt


@dataclass(frozen=True)
class Snapshot:
    """One job as a pass sees it."""

    body: Mapping[str, Any]
    job: JobSpec
    # The job's status as of our last write, unless the server already shows a newer one.
    status: Mapping[str, Any]
    # Its pods (each with its latest report) and (kind, name) of its ConfigMaps, Services,
    # PodDisruptionBudget and Workload: what the indexes show, and what this operator created
    # that they do not show yet (pods as Pending).
    pods: tuple[PodState, ...]
    children: frozenset[tuple[str, str]]
    now: datetime  # the wall clock (UTC), for the status
    created: datetime  # the job's creationTimestamp
    # The operator's monotonic clock, and when it next allows a status.progress write.
    clock: float = 0.0
    next_progress_write: float = 0.0
    refused: Refusal | None = None
    # An elastic job's placeholder pods (resources/placeholder.py), as their own index shows them.
    placeholders: tuple[PodState, ...] = ()
    # Where the pods report (the operator's endpoint), the CA bundle its certificate is signed
    # by (None: not known yet), and the digest of the bundle the job's rendered ConfigMap holds
    # ("" none; None: the indexes do not show that ConfigMap).
    report_endpoint: ReportEndpoint = DEFAULT_REPORT_ENDPOINT
    report_ca: str | None = None
    configmap_ca: str | None = None
    # Kueue as the indexes show it; None when the operator runs without the Kueue integration.
    kueue: KueueView | None = None
    # Read from the API server (reads.py): the user's ConfigMap (spec.accelerateConfigFrom),
    # only while the rendered ConfigMap has to be created or the topology depends on it; why
    # the job cannot run as found by a read (that ConfigMap is missing, so is the priority
    # class its label names); the nodes of its pods that are not Ready, by name.
    config_source: ConfigSource | None = None
    config_error: str | None = None
    lost_nodes: Mapping[str, NodeState] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.status.get("phase") in FINISHED_PHASES

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.children

    @property
    def group(self) -> int:
        """The attempt the current group's pods were created for."""
        return group_attempt(self.status)

    @property
    def rank0(self) -> PodState | None:
        """Pod 0 of the current group: the one that reports progress."""
        return next((p for p in self.pods if p.index == 0 and p.attempt == self.group), None)

    @cached_property
    def report(self) -> PushedReport | None:
        """What pod 0 of the current group last reported (progress, signs of life, versions)."""
        rank0 = self.rank0
        return parse_report(rank0.report) if rank0 is not None else None
