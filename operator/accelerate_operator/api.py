"""Parse an AccelerateJob body into frozen dataclasses. Pure: no API calls.

The CRD's schema and CEL rules reject most bad input at admission; what reaches here is checked
again only where the operator alone can know (a ConfigMap's content, `auto` processes)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .constants import API_VERSION, GPU_RESOURCE, KIND


class SpecError(ValueError):
    """The job cannot run as written; the message names the field and the fix."""


@dataclass(frozen=True)
class ConfigMapKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class RunPolicy:
    backoff_limit: int = 3
    permanent_exit_codes: tuple[int, ...] = ()
    active_deadline_seconds: int | None = None
    ttl_seconds_after_finished: int | None = None
    clean_pod_policy: str = "Running"
    suspend: bool = False


@dataclass(frozen=True)
class Checkpoint:
    volume_name: str
    mount_path: str = "/checkpoints"


@dataclass(frozen=True)
class JobSpec:
    """One AccelerateJob as the builders need it."""

    name: str
    namespace: str
    uid: str
    generation: int
    num_nodes: int
    nproc_per_node: int
    master_port: int
    template: Mapping[str, Any]
    accelerate_config: Mapping[str, Any] | None = None
    config_from: ConfigMapKeyRef | None = None
    run_policy: RunPolicy = field(default_factory=RunPolicy)
    checkpoint: Checkpoint | None = None

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.nproc_per_node

    @property
    def owner_reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def resolve_nproc_per_node(value: Any, template: Mapping[str, Any]) -> int:
    """An integer, or "auto": the trainer container's GPU limit, else 1."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise SpecError("spec.numProcPerNode must be at least 1")
        return value
    if value == "auto":
        containers = template.get("spec", {}).get("containers") or [{}]
        limits = (containers[0].get("resources") or {}).get("limits") or {}
        gpus = limits.get(GPU_RESOURCE)
        try:
            return max(int(gpus), 1) if gpus is not None else 1
        except (TypeError, ValueError):
            raise SpecError(
                f"spec.template's first container has {GPU_RESOURCE} limit {gpus!r}, "
                "not an integer; numProcPerNode \"auto\" needs a whole number of GPUs"
            ) from None
    raise SpecError(f"spec.numProcPerNode must be a positive integer or \"auto\", got {value!r}")


def parse_job(body: Mapping[str, Any]) -> JobSpec:
    metadata = body.get("metadata", {})
    spec = body.get("spec", {})
    template = copy.deepcopy(spec.get("template") or {})
    if not template.get("spec", {}).get("containers"):
        raise SpecError("spec.template.spec.containers must list the trainer container")
    policy = spec.get("runPolicy") or {}
    config_from = None
    if spec.get("accelerateConfigFrom"):
        ref = spec["accelerateConfigFrom"].get("configMapKeyRef") or {}
        config_from = ConfigMapKeyRef(name=ref.get("name", ""), key=ref.get("key", ""))
    checkpoint = None
    if spec.get("checkpoint"):
        checkpoint = Checkpoint(
            volume_name=spec["checkpoint"]["volumeName"],
            mount_path=spec["checkpoint"].get("mountPath", "/checkpoints"),
        )
    return JobSpec(
        name=metadata["name"],
        namespace=metadata.get("namespace", "default"),
        uid=metadata.get("uid", ""),
        generation=int(metadata.get("generation", 1)),
        num_nodes=int(spec.get("numNodes", 1)),
        nproc_per_node=resolve_nproc_per_node(spec.get("numProcPerNode", 1), template),
        master_port=int(spec.get("masterPort", 29500)),
        template=template,
        accelerate_config=copy.deepcopy(spec["accelerateConfig"])
        if spec.get("accelerateConfig") is not None
        else None,
        config_from=config_from,
        run_policy=RunPolicy(
            backoff_limit=int(policy.get("backoffLimit", 3)),
            permanent_exit_codes=tuple(policy.get("permanentExitCodes") or ()),
            active_deadline_seconds=policy.get("activeDeadlineSeconds"),
            ttl_seconds_after_finished=policy.get("ttlSecondsAfterFinished"),
            clean_pod_policy=policy.get("cleanPodPolicy", "Running"),
            suspend=bool(policy.get("suspend", False)),
        ),
        checkpoint=checkpoint,
    )
