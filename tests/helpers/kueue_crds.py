"""Workload CRDs of Kueue's two API versions, written by us (Kueue itself cannot be had here),
for the integration test that puts the operator's Workload writes through a real API server.

Structural, and as strict as Kueue's own CRD where our writes go (written from
config/components/crd/bases/kueue.x-k8s.io_workloads.yaml of Kueue v0.14 and v0.20, and
apis/kueue/v1beta1 + v1beta2 workload_types.go): unknown spec fields are pruned (so a
v1beta1-only field sent to v1beta2, `priorityClassName`, would vanish and the test sees it),
status.conditions is a list map keyed by type with metav1.Condition's required fields, and
/status is a subresource. The pod template and the admission are kept whole
(x-kubernetes-preserve-unknown-fields): their shape is Kubernetes' and Kueue's, not ours to
check here. `group` is a test group of its own, so a run never touches kueue.x-k8s.io."""

from __future__ import annotations

from typing import Any

ANY = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
STRING = {"type": "string"}

CONDITION = {
    "type": "object",
    "required": ["type", "status", "reason", "message", "lastTransitionTime"],
    "properties": {
        "type": STRING, "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": STRING, "message": {"type": "string", "maxLength": 32768},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer", "format": "int64"},
    },
}


def _schema(version: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "queueName": STRING,
        "active": {"type": "boolean"},
        "priority": {"type": "integer", "format": "int32"},
        "podSets": {"type": "array", "maxItems": 8, "items": {
            "type": "object", "required": ["name", "count", "template"],
            "properties": {"name": STRING, "count": {"type": "integer", "minimum": 0},
                           "minCount": {"type": "integer"}, "template": ANY}}},
    }
    if version == "v1beta1":
        spec |= {"priorityClassName": STRING, "priorityClassSource": STRING}
    else:
        spec["priorityClassRef"] = {
            "type": "object", "required": ["group", "kind", "name"],
            "properties": {"group": {"type": "string", "enum": ["kueue.x-k8s.io",
                                                                 "scheduling.k8s.io"]},
                           "kind": {"type": "string", "enum": ["WorkloadPriorityClass",
                                                                "PriorityClass"]},
                           "name": STRING}}
    status = {
        "admission": ANY,
        "conditions": {"type": "array", "items": CONDITION, "x-kubernetes-list-type": "map",
                       "x-kubernetes-list-map-keys": ["type"]},
        "admissionChecks": {"type": "array", "x-kubernetes-list-type": "map",
                            "x-kubernetes-list-map-keys": ["name"], "items": {
                                "type": "object", "required": ["name", "state"],
                                "x-kubernetes-preserve-unknown-fields": True,
                                "properties": {"name": STRING, "state": STRING}}},
        "requeueState": ANY,
        "resourceRequests": {"type": "array", "items": ANY},
    }
    return {"type": "object", "properties": {
        "apiVersion": STRING, "kind": STRING, "metadata": {"type": "object"},
        "spec": {"type": "object", "required": ["podSets"], "properties": spec},
        "status": {"type": "object", "properties": status}}}


def workload_crd(group: str, versions: tuple[str, ...]) -> dict[str, Any]:
    """The Workload CRD serving `versions` (the first one stored) under `group`."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"workloads.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": "Workload", "listKind": "WorkloadList", "plural": "workloads",
                      "singular": "workload"},
            "versions": [{"name": v, "served": True, "storage": i == 0,
                          "subresources": {"status": {}},
                          "schema": {"openAPIV3Schema": _schema(v)}}
                         for i, v in enumerate(versions)],
        },
    }


def read_priority_class(workload: dict[str, Any]) -> str | None:
    """The WorkloadPriorityClass a Workload names, as Kueue reads it: v1beta1
    spec.priorityClassName (+ priorityClassSource), v1beta2 spec.priorityClassRef.name."""
    spec = workload.get("spec") or {}
    ref = spec.get("priorityClassRef") or {}
    return ref.get("name") or spec.get("priorityClassName") or None
