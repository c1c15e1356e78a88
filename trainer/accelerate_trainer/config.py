"""Parse and validate the accelerate config YAML. Pure: text and mappings in, errors out.

accelerate has no public validator: `load_config_from_file` catches unknown top-level keys and
bad enum values, but nothing checks the topology, and several valid-looking configs silently run
undistributed (see shared/accelerate-facts.md). The checks here close those gaps. The topology
checks import nothing heavy, so the operator uses them too; `check_against_accelerate_schema`
imports accelerate and runs in the trainer only.

Files a config names (the DeepSpeed JSON above all) resolve against the config's own folder when
the path is relative, as a user reads the config beside them: `resolve_config_path`.
"""

from __future__ import annotations

import difflib
import posixpath
from collections.abc import Mapping
from typing import Any

import yaml

from .accelerate_reads import flag
from .block_keys import check_block_keys, check_parallelism
from .deepspeed_checks import FILE_KEY as DEEPSPEED_FILE_KEY
from .deepspeed_checks import check_deepspeed
from .deepspeed_cpu import ENV_DEEPSPEED_ON_CPU
from .errors import ConfigError
from .fsdp_checks import FsdpNames, check_fsdp
from .schema import AccelerateSchema
from .schema import load as load_schema

# distributed_type values that run the training processes through torchrun (accelerate's
# multi_gpu_launcher), the only launcher that works between pods without SSH.
SHARDED_TYPES = frozenset({"FSDP", "DEEPSPEED", "MEGATRON_LM"})
CPU_TYPES = frozenset({"MULTI_CPU"})
LEGACY_KEYS = frozenset({"fp16", "dynamo_backend"})
# Keys an older `accelerate config` wrote that newer accelerate versions dropped:
# key -> (which accelerate wrote it, what deleting it changes).
OBSOLETE_KEYS = {
    "ipex_config": (
        "accelerate 0.x (0.28's `accelerate config` wrote it for Intel Extension for PyTorch)",
        "it can simply be deleted: it only switched IPEX optimisations on, and training runs "
        "the same without them",
    ),
}
# The paths an accelerate config may name: (block, key), block None for a top-level key.
FILE_KEYS = (
    ("deepspeed_config", DEEPSPEED_FILE_KEY),
    ("deepspeed_config", "deepspeed_hostfile"),
    ("mpirun_config", "mpirun_hostfile"),
    (None, "command_file"),
)
# Accelerators other than NVIDIA GPUs, by the distributed_type that needs them.
# The torch module that counts each one's devices (torch.xpu...), as `accelerate launch` counts
# them; CUDA's for every other distributed_type.
DEVICE_MODULES = {"MULTI_XPU": "xpu", "MULTI_NPU": "npu", "MULTI_MLU": "mlu", "MULTI_SDAA": "sdaa",
                  "MULTI_MUSA": "musa", "MULTI_HPU": "hpu", "MULTI_NEURON": "neuron"}
OTHER_ACCELERATORS = {
    "MULTI_XPU": "Intel XPUs", "MULTI_NPU": "Ascend NPUs", "MULTI_MLU": "Cambricon MLUs",
    "MULTI_SDAA": "SDAA devices", "MULTI_MUSA": "Moore Threads GPUs", "MULTI_HPU": "Gaudi HPUs",
    "MULTI_NEURON": "AWS Neuron devices", "XLA": "TPUs",
}


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
    """True when the processes must train on CPU over gloo (use_cpu read as accelerate reads
    it: accelerate_reads.flag)."""
    return flag(config, "use_cpu") or distributed_type(config) in CPU_TYPES


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
    if flag(config, "use_cpu") and dtype in SHARDED_TYPES:
        raise ConfigError(
            f"use_cpu: true with distributed_type {dtype} would quietly train plain DDP on CPU "
            f"({dtype} needs GPUs); remove use_cpu or use MULTI_CPU"
            + (f". To rehearse DeepSpeed on CPU pods, remove use_cpu and set the env "
               f"{ENV_DEEPSPEED_ON_CPU}=1 on the trainer container (docs/deepspeed-on-cpu.md)"
               if dtype == "DEEPSPEED" else "")
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


# torchrun's rendezvous backends that work between these pods with nothing else running: static
# (pod 0 hosts the store, the default) and c10d (pod 0 hosts it too: the endpoint accelerate
# passes is --main_process_ip:--main_process_port, pod 0's name).
RENDEZVOUS_BACKENDS = ("static", "c10d")


def check_rendezvous(config: Mapping[str, Any], *, num_nodes: int) -> None:
    """A rendezvous setting that cannot bring the pods together is refused, naming the key: the
    group would wait, Running at step 0, until the rendezvous timeout."""
    backend = config.get("rdzv_backend")
    backend = "static" if backend is None else str(backend)
    if backend not in RENDEZVOUS_BACKENDS:
        raise ConfigError(
            f"rdzv_backend {backend!r}: torchrun would look for a {backend} rendezvous server "
            "at pod 0's name and main port, and none runs there, so the group would never "
            "form; use rdzv_backend: static (the default) or c10d"
        )
    if backend == "c10d" and num_nodes > 1 and bool(config.get("same_network")):
        raise ConfigError(
            "same_network: true with rdzv_backend: c10d: accelerate then passes no "
            "--rdzv_endpoint, and torchrun on each pod rendezvouses on its own localhost:29400, "
            "so the pods never meet; delete same_network (c10d then meets at pod 0), or use "
            "rdzv_backend: static"
        )


def check_environment(config: Mapping[str, Any]) -> None:
    """Keys whose value means the config was written for somewhere other than a pod."""
    environment = config.get("compute_environment", "LOCAL_MACHINE")
    if environment != "LOCAL_MACHINE":
        raise ConfigError(
            f"compute_environment {environment!r} launches on Amazon SageMaker, not on these "
            "pods; set compute_environment: LOCAL_MACHINE and remove the SageMaker keys "
            "(ec2_instance_type, iam_role_name, ...)"
        )
    dtype = config.get("distributed_type")
    if isinstance(dtype, bool):
        raise ConfigError(
            f"distributed_type is the boolean {dtype} (YAML reads a bare NO as false); quote "
            "it: distributed_type: 'NO'"
        )


def file_references(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(dotted key, path) for every file the config names."""
    found = []
    for block, key in FILE_KEYS:
        holder = config.get(block) if block else config
        if isinstance(holder, Mapping) and isinstance(holder.get(key), str) and holder[key]:
            found.append((f"{block}.{key}" if block else key, holder[key]))
    return found


def deepspeed_file(config: Mapping[str, Any]) -> str | None:
    """The DeepSpeed JSON the launch will read: only a DEEPSPEED job reads it."""
    if distributed_type(config) != "DEEPSPEED":
        return None
    path = (config.get("deepspeed_config") or {}).get(DEEPSPEED_FILE_KEY)
    return path if isinstance(path, str) and path else None


def resolve_config_path(path: str, config_dir: str) -> str:
    """A path as the config means it: relative ones against the config's own folder."""
    return posixpath.normpath(posixpath.join(config_dir, path))


def check_job_fits(
    config: Mapping[str, Any],
    *,
    num_nodes: int,
    num_processes: int,
    master_port: int,
    deepspeed_json: Mapping[str, Any] | None = None,
    deepspeed_source: str = "the DeepSpeed config",
    fsdp_names: FsdpNames | None = None,
) -> None:
    """Everything the operator (at render) and the trainer (in each pod) both check: the config
    is for pods, its topology keys agree with the job, it really distributes over it, and its
    DeepSpeed (with `deepspeed_json`, the parsed file it names) and FSDP settings can work."""
    check_environment(config)
    check_topology_keys(
        config, num_nodes=num_nodes, num_processes=num_processes, master_port=master_port
    )
    check_distribution(config, num_nodes=num_nodes, num_processes=num_processes)
    check_rendezvous(config, num_nodes=num_nodes)
    check_parallelism(config, cpu=is_cpu_job(config))
    if distributed_type(config) == "DEEPSPEED":
        check_deepspeed(config, deepspeed_json, world_size=num_processes, source=deepspeed_source)
    check_fsdp(config, fsdp_names or FsdpNames())


def check_against_accelerate_schema(config: Mapping[str, Any],
                                    schema: AccelerateSchema | None = None) -> None:
    """Check keys and enum values with what accelerate's own config classes accept (schema.py:
    the image's snapshot of them, or accelerate itself)."""
    schema = schema or load_schema()
    # Older `accelerate config` files still load: accelerate converts these two on read.
    known = set(schema.config_keys) | LEGACY_KEYS
    unknown = sorted(set(config) - known)
    _check_obsolete_keys(unknown, schema.version)
    _check_unknown_keys(unknown, known, schema.version)
    check_block_keys(config, schema.launch_args, schema.version)
    _check_distributed_type_name(config, list(schema.distributed_types))
    _check_mixed_precision_name(config, list(schema.precisions))


def _check_obsolete_keys(unknown: list[str], version: str) -> None:
    """A key an older accelerate wrote gets its own message: what deleting it changes."""
    obsolete = [key for key in unknown if key in OBSOLETE_KEYS]
    if obsolete:
        key = obsolete[0]
        written_by, deletable = OBSOLETE_KEYS[key]
        raise ConfigError(
            f"accelerate config key {key} was written by {written_by}; this image has accelerate "
            f"{version}, which no longer knows it and would refuse the file: "
            f"{deletable}"
        )


def _check_unknown_keys(unknown: list[str], known: set[str], version: str) -> None:
    """accelerate refuses a file with a key it does not know; the closest known one is named."""
    if unknown:
        hints = [f"{key} (did you mean {close[0]}?)" if close else key
                 for key in unknown
                 for close in [difflib.get_close_matches(key, known, n=1)]]
        raise ConfigError(
            f"unknown accelerate config key(s) {', '.join(hints)}: this image has accelerate "
            f"{version}, which does not know them (a newer or older accelerate may "
            f"have written them; delete or rename them). It accepts: {', '.join(sorted(known))}"
        )


def _check_distributed_type_name(config: Mapping[str, Any], valid_types: list[str]) -> None:
    """accelerate refuses a distributed_type its DistributedType enum lacks, and a file without
    one (process_config raises ValueError in `accelerate launch`). The operator's render fills
    it in; a config the trainer is pointed at otherwise may lack it."""
    if "distributed_type" not in config:
        raise ConfigError(
            "distributed_type is missing: accelerate refuses a config file without it; add "
            "distributed_type: 'NO' (one process), MULTI_GPU, MULTI_CPU (with use_cpu: true), "
            f"FSDP or DEEPSPEED (one of {', '.join(valid_types)})"
        )
    dtype = distributed_type(config)
    if dtype not in valid_types:
        raise ConfigError(
            f"distributed_type {dtype!r} is not one of {', '.join(valid_types)}"
        )


def _check_mixed_precision_name(config: Mapping[str, Any], valid_precisions: list[str]) -> None:
    """accelerate refuses a mixed_precision it does not know, and crashes on a boolean one."""
    raw_precision = config.get("mixed_precision")
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
