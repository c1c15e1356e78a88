"""The ConfigMap `<job>-accelerate-config`: the user's accelerate YAML with the topology filled in.

The user's own keys are kept; the job decides num_machines, num_processes and main_process_port
(a contradiction is an error, checked by the trainer's shared checks), and machine_rank and
main_process_ip are per pod, so they are left to each pod's command line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml
from accelerate_trainer.config import check_job_fits, distributed_type
from accelerate_trainer.contract import CONFIG_KEY

from ..api import JobSpec
from ..labels import job_labels
from ..naming import configmap_name

PER_POD_KEYS = ("machine_rank", "main_process_ip")


def render_accelerate_config(job: JobSpec, user_config: Mapping[str, Any]) -> dict[str, Any]:
    """Raises accelerate_trainer.config.ConfigError when the config contradicts the job."""
    check_job_fits(user_config, num_nodes=job.num_nodes, num_processes=job.world_size,
                   master_port=job.master_port)
    rendered = {key: value for key, value in user_config.items() if key not in PER_POD_KEYS}
    rendered.setdefault("compute_environment", "LOCAL_MACHINE")
    rendered.setdefault("distributed_type", "NO" if job.world_size == 1 else "MULTI_GPU")
    rendered["num_machines"] = job.num_nodes
    rendered["num_processes"] = job.world_size
    rendered["main_process_port"] = job.master_port
    if distributed_type(rendered) == "DEEPSPEED" and job.num_nodes > 1:
        deepspeed = dict(rendered.get("deepspeed_config") or {})
        deepspeed["deepspeed_multinode_launcher"] = "standard"
        rendered["deepspeed_config"] = deepspeed
    return rendered


def build_configmap(job: JobSpec, rendered_config: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": configmap_name(job.name),
            "namespace": job.namespace,
            "labels": job_labels(job.name),
            "ownerReferences": [job.owner_reference],
        },
        "data": {CONFIG_KEY: yaml.safe_dump(dict(rendered_config), sort_keys=False)},
    }
