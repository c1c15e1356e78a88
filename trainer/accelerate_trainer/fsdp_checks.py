"""Check an FSDP config block (`fsdp_config`) before any rank starts. Pure: no accelerate or
torch import, so the operator runs it at reconcile time with the names below (accelerate 1.x's);
the trainer passes the names of the accelerate installed in its image (schema.py's snapshot).

accelerate reads `fsdp_config` only inside each training process (FullyShardedDataParallelPlugin),
where a misspelt name is a ValueError or KeyError in every rank, and where some combinations are
quietly ignored: a transformer layer class beside a size-based policy, a sharding strategy under
FSDP2. Both are rejected here, naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class FsdpNames:
    """The values accelerate accepts (accelerate.utils.constants)."""

    sharding_strategies: tuple[str, ...] = (
        "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
    auto_wrap_policies: tuple[str, ...] = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
    state_dict_types: tuple[str, ...] = (
        "FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
    fsdp2_state_dict_types: tuple[str, ...] = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
    backward_prefetch: tuple[str, ...] = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
    source: str = "accelerate 1.x"


def check_fsdp(config: Mapping[str, Any], names: FsdpNames | None = None) -> None:
    """Only an FSDP job reads fsdp_config; other types ignore the block, as accelerate does."""
    if str(config.get("distributed_type")) != "FSDP":
        return
    names = names or FsdpNames()
    block = config.get("fsdp_config") or {}
    if not isinstance(block, Mapping):
        raise ConfigError("fsdp_config must be a mapping of fsdp_* keys")
    version = block.get("fsdp_version", 1)
    if version not in (1, 2):
        raise ConfigError(f"fsdp_config.fsdp_version={version!r} must be 1 or 2")
    _check_sharding_strategy(block.get("fsdp_sharding_strategy"), version, names)
    _check_reshard_after_forward(block.get("fsdp_reshard_after_forward"), version)
    _check_wrap_policy(block, names)
    _check_state_dict_type(block.get("fsdp_state_dict_type"), version, names)
    prefetch = block.get("fsdp_backward_prefetch")
    if prefetch is not None:
        _one_of("fsdp_config.fsdp_backward_prefetch", prefetch, names.backward_prefetch,
                names.source, numbered=True)


def _check_sharding_strategy(strategy: Any, version: int, names: FsdpNames) -> None:
    """FSDP2 ignores fsdp_sharding_strategy; FSDP1 needs one of accelerate's names."""
    if strategy is None:
        return
    if version == 2:
        raise ConfigError(
            f"fsdp_config.fsdp_sharding_strategy={strategy!r} is FSDP1's and FSDP2 ignores "
            "it; with fsdp_version 2 use fsdp_reshard_after_forward: true (FULL_SHARD) or "
            "false (SHARD_GRAD_OP)"
        )
    _one_of("fsdp_config.fsdp_sharding_strategy", strategy, names.sharding_strategies,
            names.source, numbered=True)


def _check_reshard_after_forward(reshard: Any, version: int) -> None:
    """FSDP2 reads fsdp_reshard_after_forward as a boolean; FSDP1 has the strategy instead."""
    if reshard is None:
        return
    if version == 2 and not isinstance(reshard, bool) and str(reshard).lower() not in (
            "true", "false"):
        raise ConfigError(
            f"fsdp_config.fsdp_reshard_after_forward={reshard!r} must be true or false "
            "with fsdp_version 2"
        )
    if version == 1 and isinstance(reshard, bool):
        raise ConfigError(
            f"fsdp_config.fsdp_reshard_after_forward={reshard!r} is FSDP2's; with "
            "fsdp_version 1 use fsdp_sharding_strategy (FULL_SHARD, SHARD_GRAD_OP, ...)"
        )


def _check_wrap_policy(block: Mapping[str, Any], names: FsdpNames) -> None:
    """A layer class or a parameter count is read only under its own policy, else ignored."""
    policy = block.get("fsdp_auto_wrap_policy")
    if policy is not None:
        _one_of("fsdp_config.fsdp_auto_wrap_policy", policy, names.auto_wrap_policies,
                names.source)
    policy = str(policy or "NO_WRAP").upper()
    layer_class = block.get("fsdp_transformer_layer_cls_to_wrap")
    if layer_class is not None and policy != "TRANSFORMER_BASED_WRAP":
        raise ConfigError(
            f"fsdp_config.fsdp_transformer_layer_cls_to_wrap={layer_class!r} is only read with "
            f"fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP (the policy is {policy}), so it would "
            "be ignored; set the policy or delete the layer class"
        )
    min_params = block.get("fsdp_min_num_params")
    if min_params is None:
        return
    if policy != "SIZE_BASED_WRAP":
        raise ConfigError(
            f"fsdp_config.fsdp_min_num_params={min_params!r} is only read with "
            f"fsdp_auto_wrap_policy SIZE_BASED_WRAP (the policy is {policy}); set the policy "
            "or delete fsdp_min_num_params"
        )
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 0:
        raise ConfigError(
            f"fsdp_config.fsdp_min_num_params={min_params!r} must be a whole number"
        )


def _check_state_dict_type(state_dict: Any, version: int, names: FsdpNames) -> None:
    """FSDP2 accepts fewer state dict types than FSDP1, and numbers none of them."""
    if state_dict is None:
        return
    allowed = names.fsdp2_state_dict_types if version == 2 else names.state_dict_types
    _one_of(f"fsdp_config.fsdp_state_dict_type (FSDP{version})", state_dict, allowed,
            names.source, numbered=version == 1)


def _one_of(key: str, value: Any, allowed: tuple[str, ...], source: str,
            numbered: bool = False) -> None:
    """accelerate accepts a name in any case and, for the enums it numbers, 1..N."""
    text = str(value)
    if text.upper() in allowed:
        return
    if numbered and text.isdigit() and 1 <= int(text) <= len(allowed):
        return
    raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)} ({source})")
