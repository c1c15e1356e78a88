"""A pass's one input, made for a test: the Snapshot of a job body (decide.py decides from it);
and whole passes against the fake API (fake_kube.py), as the work queue runs them."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

from accelerate_operator.api import parse_job
from accelerate_operator.naming import configmap_name
from accelerate_operator.reconciler import Reconciler
from accelerate_operator.resources.configmap import read_ca_digest
from accelerate_operator.snapshot import Snapshot
from accelerate_operator.state import JobState

from tests.helpers.fake_kube import FakeKube

NOW = datetime(2026, 1, 1, 12, 0, 0)


def snapshot(body: dict, now: datetime = NOW, **changes: Any) -> Snapshot:
    """The job with no status, pod or child yet, unless `changes` say otherwise."""
    values: dict[str, Any] = {"body": body, "job": parse_job(body), "status": {}, "pods": (),
                              "children": frozenset(), "now": now, "created": now}
    return Snapshot(**{**values, **changes})


class Cluster:
    """The fake API plus a job whose status follows the operator's writes, as the watch would
    deliver them."""

    def __init__(self, body: dict, kube: FakeKube | None = None):
        self.kube = kube or FakeKube()
        self.body = body
        self.reconciler = Reconciler(self.kube, clock=lambda: 0.0)
        self.state = JobState(body["metadata"]["uid"])
        self.report_ca: str | None = None  # the bundle the operator's certificate is signed by

    def reconcile(self, *, indexed: bool = True) -> float | None:
        """One pass, and another at once when it asks for one (a child the API server refused
        ends a pass: the next fails the job), as the work queue runs them."""
        for _ in range(5):
            pods = self.kube.pods() if indexed else []
            children = self.kube.children() if indexed else set()
            rendered = self.kube.objects.get(("ConfigMap", configmap_name(self.name)))
            requeue = asyncio.run(self.reconciler.reconcile(
                self.state, self.body, pods, children, report_ca=self.report_ca,
                configmap_ca=read_ca_digest(rendered) if rendered and indexed else None,
                placeholders=self.kube.placeholders() if indexed else ()))
            for status in self.kube.statuses:
                self.body.setdefault("status", {}).update(status)
            if requeue != 0:
                return requeue
        raise AssertionError("the pass asked to run again at once, five times in a row")

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    def phase(self) -> str | None:
        return (self.body.get("status") or {}).get("phase")
