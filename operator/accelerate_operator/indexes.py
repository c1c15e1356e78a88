"""What kopf's indexes keep of each object (handlers.py's index functions), by the job it belongs
to, (namespace, job name): little more than a pass reads of it. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from accelerate_trainer.contract import JOB_NAME_LABEL

from .constants import KIND
from .kueue.workload import lean_workload
from .pod_state import PodState, read_pod_state
from .resources.configmap import read_ca_digest
from .resources.placeholder import PLACEHOLDER_LABEL

JobKey = tuple[str, str]  # (namespace, job name)
# kubectl apply keeps a full copy of the object in this annotation; nothing here reads it.
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def lean_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """managedFields are most of an object's metadata, and nothing here reads them."""
    lean = {key: value for key, value in metadata.items() if key != "managedFields"}
    annotations = lean.get("annotations")
    if annotations and LAST_APPLIED in annotations:
        lean["annotations"] = {k: v for k, v in annotations.items() if k != LAST_APPLIED}
    return lean


def owning_job(metadata: Mapping[str, Any]) -> JobKey | None:
    """The job an object belongs to, by its job-name label."""
    name = (metadata.get("labels") or {}).get(JOB_NAME_LABEL)
    return (metadata.get("namespace") or "", name) if name else None


def is_placeholder(metadata: Mapping[str, Any]) -> bool:
    """An elastic job's placeholder pod (resources/placeholder.py): indexed apart from its pods."""
    return PLACEHOLDER_LABEL in (metadata.get("labels") or {})


def owner_uid(metadata: Mapping[str, Any]) -> str | None:
    """The uid of the AccelerateJob that is the object's controller (the operator sets
    `controller: true`; another ownerReference of that kind makes no one the owner)."""
    return next((ref.get("uid") for ref in metadata.get("ownerReferences") or []
                 if ref.get("kind") == KIND and ref.get("controller") is True), None)


def job_entry(body: Mapping[str, Any]) -> dict[str, Any]:
    return {"metadata": lean_metadata(body["metadata"]), "spec": body.get("spec") or {},
            "status": body.get("status") or {}}


def pod_entry(body: Mapping[str, Any]) -> tuple[str | None, PodState]:
    """(the uid of the job that owns it, the pod as a pass reads it)."""
    return owner_uid(body["metadata"]), read_pod_state(body)


def configmap_entry(body: Mapping[str, Any]) -> tuple[str, str]:
    """(name, the digest of the report CA bundle it holds): whether a job's ConfigMap holds the
    current bundle is the one thing a pass reads of it beyond its existence."""
    return body["metadata"]["name"], read_ca_digest(body)


def workload_entry(body: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    return owner_uid(body["metadata"]), lean_workload(body, lean_metadata(body["metadata"]))
