"""The Kueue Workload of a queued job, and the pods' scheduling from its admission. Pure.

One pod set, `main`, of numNodes pods: Kueue reserves quota for all of them at once, or none.
Its template is the pods' own (containers, init containers, overhead), so every resource the
pods request, GPUs included, is counted. Kueue's documented path for job kinds it does not build
in: the controller creates the Workload, and starts its pods only once Kueue has admitted it."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from ..api import JobSpec
from ..kueue import KUEUE_API_VERSION, POD_SET, WORKLOAD_PRIORITY_SOURCE
from ..labels import job_labels
from ..naming import workload_name
from .pods import build_pod


def build_workload(job: JobSpec, queue: str, priority_class: str | None = None,
                   priority: int | None = None) -> dict[str, Any]:
    """`priority` is the value of WorkloadPriorityClass `priority_class` (Kueue's jobframework
    copies it into the Workload the same way)."""
    pod = build_pod(job, 0, 0)
    template = {"metadata": {"labels": job_labels(job.name)}, "spec": pod["spec"]}
    spec: dict[str, Any] = {
        "queueName": queue,
        "active": not job.run_policy.suspend,
        "podSets": [{"name": POD_SET, "count": job.num_nodes, "template": template}],
    }
    if priority_class:
        spec["priorityClassName"] = priority_class
        spec["priorityClassSource"] = WORKLOAD_PRIORITY_SOURCE
        spec["priority"] = int(priority or 0)
    return {
        "apiVersion": KUEUE_API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job.name, job.uid),
            "namespace": job.namespace,
            "labels": job_labels(job.name),
            "ownerReferences": [job.owner_reference],
        },
        "spec": spec,
    }


def build_flavor_scheduling(flavors: Sequence[Mapping[str, Any]]
                            ) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """The node labels and tolerations of the ResourceFlavors (their specs) Kueue assigned."""
    node_labels: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    for flavor in flavors:
        node_labels.update(flavor.get("nodeLabels") or {})
        for toleration in flavor.get("tolerations") or []:
            if toleration not in tolerations:
                tolerations.append(dict(toleration))
    return node_labels, tolerations


def with_flavors(pod: Mapping[str, Any], node_labels: Mapping[str, str],
                 tolerations: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The pod placed as admitted: the flavors' node labels join its nodeSelector (a flavor's
    value wins over the template's, as the quota was counted against that flavor) and their
    tolerations join its own."""
    if not node_labels and not tolerations:
        return dict(pod)
    placed = copy.deepcopy(dict(pod))
    spec = placed["spec"]
    if node_labels:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **node_labels}
    if tolerations:
        own = list(spec.get("tolerations") or [])
        spec["tolerations"] = own + [dict(t) for t in tolerations if t not in own]
    return placed
