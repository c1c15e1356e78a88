"""Where Kueue's admission puts the pods. Pure.

Kueue's documented path for job kinds it does not build in: the controller creates the
Workload, and starts its pods only once Kueue has admitted it.
Since the pods are created after the admission, everything Kueue decided (the flavors, the
admission checks' pod-set updates, a topology assignment) is written into them at creation:
nothing is gated, nothing is changed on a running pod."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..api import JobSpec
from ..pod_state import PodState
from ..resources.pods import build_pod
from .workload import (
    PodSetUpdate,
    TopologyError,
    read_pod_set_updates,
    read_topology_assignment,
    read_workload,
)


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


def merge_pod_set_updates(updates: Sequence[PodSetUpdate], node_labels: Mapping[str, str]
                          ) -> tuple[dict[str, str], dict[str, str], dict[str, str],
                                     list[dict[str, Any]]]:
    """The admission checks' updates merged over the flavors' node labels: (labels,
    annotations, nodeSelector, tolerations). A key two of them set to different values is a
    conflict Kueue's podset.Merge refuses (pkg/podset/podset.go, ErrInvalidPodSetUpdate), and
    so does this: ValueError naming the key, the check and both values."""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    selector: dict[str, str] = dict(node_labels)
    owner = {key: "the admitted ResourceFlavor" for key in selector}
    tolerations: list[dict[str, Any]] = []
    for update in updates:
        for kind, target, values in (("label", labels, update.labels),
                                     ("annotation", annotations, update.annotations),
                                     ("nodeSelector", selector, update.node_selector)):
            for key, value in values.items():
                if key in target and target[key] != value:
                    raise ValueError(
                        f"admission check {update.check!r} sets {kind} {key}={value!r}, but "
                        f"{owner.get((kind, key), owner.get(key, 'another check'))} set "
                        f"{target[key]!r}: Kueue's pod-set updates conflict; fix the "
                        "AdmissionCheck or the ResourceFlavor")
                target[key] = value
                owner[(kind, key) if kind != "nodeSelector" else key] = (
                    f"admission check {update.check!r}")
        for toleration in update.tolerations:
            if toleration not in tolerations:
                tolerations.append(dict(toleration))
    return labels, annotations, selector, tolerations


def admitted_placement(workload: Mapping[str, Any], flavors: Mapping[str, Mapping[str, Any]],
                       job: JobSpec, pods: Sequence[PodState]) -> Placement | str | None:
    """Where Kueue's admission puts the pods (flavors, admission checks' pod-set updates,
    topology), None while the Workload is not admitted or one of its ResourceFlavors is not
    known yet (`flavors`: the specs read), or a string saying why the admission cannot be
    applied (the job is refused, loudly, rather than placed where Kueue did not count it). A
    group whose pods are all there is not placed again."""
    if len([p for p in pods if p.live]) >= job.num_nodes:
        return None
    view = read_workload(workload)
    if not view.admitted or view.evicted is not None:
        return None
    specs = [flavors.get(name) for name in view.flavors]
    if any(spec is None for spec in specs):
        return None
    try:
        topology = read_topology_assignment(workload, job.num_nodes)
        return build_placement(specs, read_pod_set_updates(workload), topology,
                               build_pod(job, 0, 0))
    except (TopologyError, ValueError) as error:
        return f"Kueue admitted workload {view.name}, but its admission cannot be applied: {error}"
