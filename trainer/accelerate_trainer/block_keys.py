"""Keys inside a config block that accelerate would drop without a word, and ND parallelism where
it would not apply. Pure: the names accelerate's launcher accepts come from schema.py.

`accelerate launch` turns each key of a block into a launch argument (commands/launch.py
`_validate_launch_command`: fsdp_config's `x` becomes `fsdp_x`, fp8_config's `fp8_x`,
dynamo_config's `dynamo_x`; the other blocks' keys are taken as they are) and sets it on its
argument namespace. A key that is no launch argument is set and never read again: a misspelt
`fsdp_sharding_strategi`, `dynamo_config: {mode: max-autotune}` under an older name, a
parallelism_config `dp_shard_size` without its `parallelism_config_` prefix (all sizes stay 1).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError

# block -> the prefix accelerate adds to a key that lacks it (None: none added)
BLOCKS = {"fsdp_config": "fsdp_", "fp8_config": "fp8_", "dynamo_config": "dynamo_",
          "parallelism_config": None, "deepspeed_config": None, "megatron_lm_config": None}


def argument_name(block: str, key: str) -> str:
    """The launch argument accelerate sets for `key` of `block`."""
    prefix = BLOCKS[block]
    return key if prefix is None or key.startswith(prefix) else prefix + key


def check_block_keys(config: Mapping[str, Any], launch_args: frozenset[str],
                     version: str) -> None:
    """Every key of every block is one the launcher reads (`launch_args`: its argument names)."""
    for block in BLOCKS:
        value = config.get(block)
        if not isinstance(value, Mapping):
            continue
        dropped = sorted(key for key in value if argument_name(block, str(key)) not in launch_args)
        if dropped:
            known = sorted(name for name in launch_args if _belongs(block, name))
            hints = [f"{key} (did you mean {close}?)" if close else str(key)
                     for key in dropped for close in [_closest(block, str(key), known)]]
            raise ConfigError(
                f"{block} key(s) {', '.join(hints)}: accelerate {version} has no launch "
                f"argument for them, so it would drop them without a word. Rename or delete "
                f"them; {block} accepts: {', '.join(known) or 'nothing'}"
            )


def _closest(block: str, key: str, known: list[str]) -> str | None:
    """The argument a dropped key was most likely meant as: the same name with the prefix
    accelerate does not add here (parallelism_config's), else the nearest spelling."""
    prefixed = [name for name in known if name.endswith("_" + key)]
    close = prefixed or difflib.get_close_matches(argument_name(block, key), known, n=1)
    return close[0] if close else None


def _belongs(block: str, name: str) -> bool:
    prefix = BLOCKS[block] or {"parallelism_config": "parallelism_config_"}.get(block)
    return name.startswith(prefix) if prefix else True


def check_parallelism(config: Mapping[str, Any], *, cpu: bool) -> None:
    """parallelism_config (ND parallelism, accelerate 1.10+) applies only to an FSDP2 launch on
    GPUs: the CPU launch never exports PARALLELISM_CONFIG_* (utils/launch.py
    `prepare_multi_gpu_env` reads it only when the config decides the launcher), so the run
    would be plain DDP and succeed."""
    block = config.get("parallelism_config")
    if not block:
        return
    if cpu:
        raise ConfigError(
            "parallelism_config is set, but this is a CPU job (use_cpu: true or MULTI_CPU): "
            "accelerate applies ND parallelism only to an FSDP2 launch on GPUs, so the job "
            "would train plain DDP without a word. Delete parallelism_config, or request "
            "nvidia.com/gpu with distributed_type: FSDP and fsdp_config.fsdp_version: 2"
        )
    fsdp = config.get("fsdp_config") or {}
    version = str(fsdp.get("fsdp_version", 1)) if isinstance(fsdp, Mapping) else "1"
    if str(config.get("distributed_type")) != "FSDP" or version != "2":
        raise ConfigError(
            "parallelism_config needs distributed_type: FSDP with fsdp_config.fsdp_version: 2 "
            f"(here {config.get('distributed_type')}, fsdp_version {version}); accelerate "
            "refuses it otherwise in every rank. Set both, or delete parallelism_config"
        )
