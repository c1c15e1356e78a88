"""Parse and validate the accelerate config YAML. Pure: text and mappings in, errors out.

accelerate has no public validator: `load_config_from_file` catches unknown top-level keys and
bad enum values, but nothing checks the topology, and several valid-looking configs silently run
undistributed (see shared/accelerate-facts.md). The checks here close those gaps. The topology
checks import nothing heavy, so the operator uses them too; `check_against_accelerate_schema`
imports accelerate and runs in the trainer only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import yaml

# distributed_type values that run the training processes through torchrun (accelerate's
# multi_gpu_launcher), the only launcher that works between pods without SSH.
SHARDED_TYPES = frozenset({"FSDP", "DEEPSPEED", "MEGATRON_LM"})
CPU_TYPES = frozenset({"MULTI_CPU"})
LEGACY_KEYS = frozenset({"fp16", "dynamo_backend"})


class ConfigError(ValueError):
    """The accelerate config is invalid; the message names the key and the fix."""


def parse_accelerate_yaml(text: str, source: str = "the accelerate config") -> dict[str, Any]:
    """Parse the YAML text of an accelerate config into a mapping."""
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{source} is not valid YAML: {error}") from None
    if loaded is None:
        raise ConfigError(f"{source} is empty; write it with `accelerate config` or inline it")
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"{source} must be a mapping of accelerate keys, got {type(loaded).__name__}"
        )
    return loaded


def distributed_type(config: Mapping[str, Any]) -> str:
    return str(config.get("distributed_type", "NO"))


def is_cpu_job(config: Mapping[str, Any]) -> bool:
    """True when the processes must train on CPU over gloo."""
    return bool(config.get("use_cpu")) or distributed_type(config) in CPU_TYPES


def check_topology_keys(
    config: Mapping[str, Any], *, num_nodes: int, num_processes: int, master_port: int
) -> None:
    """A topology key in the user's YAML must agree with the job: the job wins, never silently."""
    expected = {
        "num_machines": (num_nodes, "spec.numNodes"),
        "num_processes": (num_processes, "spec.numNodes x spec.numProcPerNode"),
        "main_process_port": (master_port, "spec.masterPort"),
    }
    for key, (want, owner) in expected.items():
        if key in config and config[key] is not None and config[key] != want:
            raise ConfigError(
                f"accelerate config key {key}={config[key]!r} contradicts {owner} = {want}; "
                f"{owner} decides it: remove {key} from the config or make it {want}"
            )


def check_distribution(config: Mapping[str, Any], *, num_nodes: int, num_processes: int) -> None:
    """Reject configs that accelerate would run silently undistributed or through SSH."""
    dtype = distributed_type(config)
    if dtype == "NO" and num_processes > 1:
        raise ConfigError(
            f"distributed_type NO runs one process, but the job asks for {num_processes}; "
            "use MULTI_GPU (or MULTI_CPU with use_cpu: true), FSDP or DEEPSPEED"
        )
    if config.get("use_cpu") and dtype in SHARDED_TYPES:
        raise ConfigError(
            f"use_cpu: true with distributed_type {dtype} would quietly train plain DDP on CPU "
            f"({dtype} needs GPUs); remove use_cpu or use MULTI_CPU"
        )
    if dtype == "DEEPSPEED" and num_nodes > 1:
        launcher = (config.get("deepspeed_config") or {}).get(
            "deepspeed_multinode_launcher", "standard"
        )
        if launcher != "standard":
            raise ConfigError(
                f"deepspeed_config.deepspeed_multinode_launcher={launcher!r} needs SSH between "
                "pods; set it to standard (or leave it out)"
            )


def check_job_fits(
    config: Mapping[str, Any], *, num_nodes: int, num_processes: int, master_port: int
) -> None:
    """Everything the operator (at render) and the trainer (in each pod) both check: the
    topology keys agree with the job, and the config really distributes over it."""
    check_topology_keys(
        config, num_nodes=num_nodes, num_processes=num_processes, master_port=master_port
    )
    check_distribution(config, num_nodes=num_nodes, num_processes=num_processes)


def check_against_accelerate_schema(config: Mapping[str, Any]) -> None:
    """Check keys and enum values with accelerate's own config classes (imports accelerate)."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType, PrecisionType

    # Older `accelerate config` files still load: accelerate converts these two on read.
    known = {field.name for field in dataclasses.fields(ClusterConfig)} | LEGACY_KEYS
    unknown = sorted(set(config) - known)
    if unknown:
        raise ConfigError(
            f"unknown accelerate config key(s) {', '.join(unknown)}; accelerate "
            f"{_accelerate_version()} accepts: {', '.join(sorted(known))}"
        )
    dtype = distributed_type(config)
    valid_types = [member.value for member in DistributedType]
    if dtype not in valid_types:
        raise ConfigError(
            f"distributed_type {dtype!r} is not one of {', '.join(valid_types)}"
        )
    raw_precision = config.get("mixed_precision")
    valid_precisions = [member.value for member in PrecisionType]
    if isinstance(raw_precision, bool):
        # YAML 1.1 reads a bare `no` as false; accelerate then crashes on `False.lower()`.
        raise ConfigError(
            f"mixed_precision is the boolean {raw_precision} (YAML reads a bare no/off as false); "
            f"quote it: mixed_precision: 'no' (one of {', '.join(valid_precisions)})"
        )
    precision = "no" if raw_precision is None else str(raw_precision).lower()
    if precision not in valid_precisions:
        raise ConfigError(
            f"mixed_precision {config.get('mixed_precision')!r} is not one of "
            f"{', '.join(valid_precisions)}"
        )


def _accelerate_version() -> str:
    import accelerate

    return accelerate.__version__
