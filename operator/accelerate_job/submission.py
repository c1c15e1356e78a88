"""Build what `accelerate-job submit` (and AccelerateJobClient.submit) create: the AccelerateJob
and the ConfigMap holding the user's accelerate YAML. Pure: no clock, no randomness, no API
calls; the CLI picks the name, the client sends the objects. Each object is built once, by
`prepare_submission`, whether it is then sent or printed (--dry-run)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from accelerate_operator.constants import API_VERSION, GPU_RESOURCE, KIND
from accelerate_operator.labels import job_labels
from accelerate_trainer.config import (
    check_distribution,
    check_topology_keys,
    parse_accelerate_yaml,
)

DEFAULT_CONFIG_KEY = "accelerate.yaml"
TRAINER_CONTAINER = "trainer"


def config_source_name(job_name: str) -> str:
    """The user's accelerate YAML; `<job>-accelerate-config` is the operator's rendered copy."""
    return f"{job_name}-accelerate-yaml"


def build_job(
    *,
    name: str,
    namespace: str,
    image: str,
    script: str,
    script_args: Sequence[str] = (),
    num_nodes: int = 1,
    nproc_per_node: int | str = 1,
    config_map: str | None = None,
    config_key: str = DEFAULT_CONFIG_KEY,
    env: Mapping[str, str] | None = None,
    gpus_per_node: int | None = None,
    backoff_limit: int | None = None,
) -> dict[str, Any]:
    """An AccelerateJob running `accelerate-trainer SCRIPT ARGS...` in `image`; its accelerate
    YAML is read from ConfigMap `config_map` (default: `<name>-accelerate-yaml`)."""
    container = _trainer_container(image, [script, *script_args], env, gpus_per_node)
    spec: dict[str, Any] = {
        "numNodes": num_nodes,
        "numProcPerNode": nproc_per_node,
        "accelerateConfigFrom": {"configMapKeyRef": {
            "name": config_map or config_source_name(name), "key": config_key}},
        "template": {"spec": {"containers": [container]}},
    }
    if backoff_limit is not None:
        spec["runPolicy"] = {"backoffLimit": backoff_limit}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def _trainer_container(image: str, args: list[str], env: Mapping[str, str] | None,
                       gpus_per_node: int | None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": TRAINER_CONTAINER,
        "image": image,
        "command": ["accelerate-trainer"],
        "args": args,
    }
    if env:
        container["env"] = [{"name": key, "value": value} for key, value in env.items()]
    if gpus_per_node:
        container["resources"] = {"limits": {GPU_RESOURCE: gpus_per_node}}
    return container


def build_config_source(job_name: str, namespace: str, config_yaml: str,
                        name: str | None = None,
                        key: str = DEFAULT_CONFIG_KEY) -> dict[str, Any]:
    """The ConfigMap holding the user's accelerate YAML as written (the operator renders it)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name or config_source_name(job_name),
            "namespace": namespace,
            "labels": job_labels(job_name),
        },
        "data": {key: config_yaml},
    }


def use_config_source(job: Mapping[str, Any]) -> tuple[dict[str, Any], str, str]:
    """A copy of `job` that reads its accelerate YAML from a ConfigMap, and that ConfigMap's name
    and key: the job's own accelerateConfigFrom if it has one, else `<name>-accelerate-yaml`
    (an inline accelerateConfig is dropped: the YAML given to submit replaces it)."""
    job = copy.deepcopy(dict(job))
    spec = job.setdefault("spec", {})
    ref = (spec.get("accelerateConfigFrom") or {}).get("configMapKeyRef") or {}
    name = ref.get("name") or config_source_name(job["metadata"]["name"])
    key = ref.get("key") or DEFAULT_CONFIG_KEY
    spec.pop("accelerateConfig", None)
    spec["accelerateConfigFrom"] = {"configMapKeyRef": {"name": name, "key": key}}
    return job, name, key


def check_accelerate_yaml(config_yaml: str, spec: Mapping[str, Any]) -> None:
    """Raise accelerate_trainer.config.ConfigError when the YAML cannot work for a job with this
    spec, before anything is created (the operator would fail the job with the same message)."""
    config = parse_accelerate_yaml(config_yaml, source="the accelerate config")
    procs = spec.get("numProcPerNode", 1)
    if isinstance(procs, int) and not isinstance(procs, bool):
        nodes = int(spec.get("numNodes", 1))
        check_topology_keys(config, num_nodes=nodes, num_processes=nodes * procs,
                            master_port=int(spec.get("masterPort", 29500)))
        check_distribution(config, num_nodes=nodes, num_processes=nodes * procs)


def prepare_submission(job: Mapping[str, Any], config_yaml: str,
                       namespace: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job, reading its accelerate YAML from a ConfigMap, and that ConfigMap, in `namespace`:
    what submit creates (the ConfigMap first). Raises ConfigError when the YAML cannot work for
    the job."""
    check_accelerate_yaml(config_yaml, job.get("spec") or {})
    job, configmap_name, key = use_config_source(job)
    configmap = build_config_source(job["metadata"]["name"], namespace, config_yaml,
                                    configmap_name, key)
    return job, configmap
