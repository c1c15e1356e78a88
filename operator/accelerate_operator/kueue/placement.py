"""The Kueue Workload of a queued job, and the pods' placement from its admission. Pure.

One pod set, `main`, of numNodes pods: Kueue reserves quota for all of them at once, or none.
Its template is the pods' own (containers, init containers, overhead), so every resource the
pods request, GPUs included, is counted. Kueue's documented path for job kinds it does not build
in: the controller creates the Workload, and starts its pods only once Kueue has admitted it.
Since the pods are created after the admission, everything Kueue decided (the flavors, the
admission checks' pod-set updates, a topology assignment) is written into them at creation:
nothing is gated, nothing is changed on a running pod."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..api import JobSpec
from ..kueue import (
    KUEUE_GROUP,
    KUEUE_VERSION,
    POD_SET,
    REQUESTED_ACTIVE_ANNOTATION,
    V1BETA1,
    WORKLOAD_PRIORITY_SOURCE,
    PodSetUpdate,
    api_version,
    merge_pod_set_updates,
)
from ..labels import job_labels
from ..naming import workload_name
from .pods import build_pod


def build_workload(job: JobSpec, queue: str, priority_class: str | None = None,
                   priority: int | None = None, version: str = KUEUE_VERSION) -> dict[str, Any]:
    """`priority` is the value of WorkloadPriorityClass `priority_class` (Kueue's jobframework
    copies it into the Workload the same way). `version` is the one the server serves: v1beta1
    names the class in spec.priorityClassName + priorityClassSource, v1beta2 in
    spec.priorityClassRef {group, kind, name} (apis/kueue/v1beta2/workload_types.go, v0.15+)."""
    pod = build_pod(job, 0, 0)
    template = {"metadata": {"labels": job_labels(job.name)}, "spec": pod["spec"]}
    active = not job.run_policy.suspend
    spec: dict[str, Any] = {
        "queueName": queue,
        "active": active,
        "podSets": [{"name": POD_SET, "count": job.num_nodes, "template": template}],
    }
    if priority_class:
        if version == V1BETA1:
            spec["priorityClassName"] = priority_class
            spec["priorityClassSource"] = WORKLOAD_PRIORITY_SOURCE
        else:
            spec["priorityClassRef"] = {"group": KUEUE_GROUP, "kind": "WorkloadPriorityClass",
                                        "name": priority_class}
        spec["priority"] = int(priority or 0)
    return {
        "apiVersion": api_version(version),
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job.name, job.uid),
            "namespace": job.namespace,
            "labels": job_labels(job.name),
            "annotations": {REQUESTED_ACTIVE_ANNOTATION: str(active).lower()},
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


@dataclass(frozen=True)
class Placement:
    """Everything Kueue's admission asks of the pods: the flavors' node labels and tolerations,
    the admission checks' pod-set updates (labels, annotations, nodeSelector, tolerations) and,
    under topology-aware scheduling, one node selector per pod index."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    topology: tuple[Mapping[str, str], ...] | None = None


def build_placement(flavors: Sequence[Mapping[str, Any]], updates: Sequence[PodSetUpdate],
                    topology: Sequence[Mapping[str, str]] | None,
                    pod: Mapping[str, Any]) -> Placement:
    """The placement of the admitted pods, or ValueError naming a conflict: an admission
    check's value against a flavor's or another check's (Kueue's podset.Merge refuses those
    too), a check's label/annotation/nodeSelector against the pod's own, a topology domain
    against a flavor's node label. `pod` is one pod as built (its own values)."""
    node_labels, tolerations = build_flavor_scheduling(flavors)
    labels, annotations, selector, extra = merge_pod_set_updates(updates, node_labels)
    metadata, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    for kind, own, wanted in (("label", metadata.get("labels") or {}, labels),
                              ("annotation", metadata.get("annotations") or {}, annotations)):
        for key, value in wanted.items():
            if key in own and own[key] != value:
                raise ValueError(
                    f"an admission check sets {kind} {key}={value!r} on the pods, which the "
                    f"operator sets to {own[key]!r}; fix the AdmissionCheck")
    own_selector = spec.get("nodeSelector") or {}
    for update in updates:
        for key, value in update.node_selector.items():
            if key in own_selector and own_selector[key] != value:
                raise ValueError(
                    f"admission check {update.check!r} sets nodeSelector {key}={value!r}, the "
                    f"job's template sets {own_selector[key]!r}; fix the AdmissionCheck or the "
                    "template")
    for domain in topology or ():
        for key, value in domain.items():
            if key in selector and selector[key] != value:
                raise ValueError(
                    f"Kueue's topology assignment puts a pod on {key}={value!r}, the admission "
                    f"sets {key}={selector[key]!r}")
    for toleration in extra:
        if toleration not in tolerations:
            tolerations.append(toleration)
    return Placement(selector, tuple(tolerations), labels, annotations,
                     tuple(topology) if topology is not None else None)


def with_placement(pod: Mapping[str, Any], placement: Placement, index: int) -> dict[str, Any]:
    """The pod placed as admitted: the admission's node labels join its nodeSelector (a
    flavor's value wins over the template's, as the quota was counted against that flavor),
    then pod `index`'s topology domain; tolerations, labels and annotations join its own."""
    placed = copy.deepcopy(dict(pod))
    spec, metadata = placed["spec"], placed.setdefault("metadata", {})
    selector = {**(spec.get("nodeSelector") or {}), **placement.node_selector}
    if placement.topology is not None:
        selector.update(placement.topology[index])
    if selector:
        spec["nodeSelector"] = selector
    if placement.tolerations:
        own = list(spec.get("tolerations") or [])
        spec["tolerations"] = own + [dict(t) for t in placement.tolerations if t not in own]
    if placement.labels:
        metadata["labels"] = {**placement.labels, **(metadata.get("labels") or {})}
    if placement.annotations:
        metadata["annotations"] = {**placement.annotations, **(metadata.get("annotations") or {})}
    return placed


def with_flavors(pod: Mapping[str, Any], node_labels: Mapping[str, str],
                 tolerations: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The pod on the admitted flavors alone (no admission check, no topology)."""
    if not node_labels and not tolerations:
        return dict(pod)
    return with_placement(pod, Placement(dict(node_labels), tuple(tolerations)), 0)
