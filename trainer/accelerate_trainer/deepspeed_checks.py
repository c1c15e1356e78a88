"""Check a DeepSpeed setup before any rank starts: the JSON that
`deepspeed_config.deepspeed_config_file` names (or, without one, the YAML's own deepspeed_config
block) against the accelerate YAML and the job's world size. Pure: mappings in, ConfigError out;
imports neither accelerate nor deepspeed, so the operator runs the same checks at reconcile time.

accelerate reads the JSON only inside each training process (DeepSpeedPlugin, when the script
builds its Accelerator), after the image pulled and the GPUs were allocated, and every
whole-group restart repeats the crash. The rules below are the ones accelerate 1.x
(`DeepSpeedPlugin.__post_init__`, `_deepspeed_config_checks`, `set_mixed_precision`) and
DeepSpeed (its batch-size assertion) apply there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .accelerate_reads import configured_precision
from .errors import ConfigError

FILE_KEY = "deepspeed_config_file"
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# With deepspeed_config_file, accelerate refuses these beside it in the YAML's deepspeed_config
# block (and a mixed_precision anywhere in the YAML): the JSON must say them.
KEYS_THE_JSON_OWNS = (
    "gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
    "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
    "zero3_save_16bit_model",
)
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def parse_deepspeed_json(text: str, source: str) -> dict[str, Any]:
    """The DeepSpeed config's text as a mapping; a syntax error names the line and column."""
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{source} is not valid JSON: {error.msg} at line {error.lineno} column "
            f"{error.colno}; DeepSpeed would fail reading it in every rank"
        ) from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{source} must be a JSON object, got {type(loaded).__name__}")
    return loaded


def check_deepspeed(
    config: Mapping[str, Any],
    ds_json: Mapping[str, Any] | None,
    *,
    world_size: int,
    source: str = "the DeepSpeed config",
) -> None:
    """`ds_json` is the parsed file `deepspeed_config_file` names (None when the YAML's own
    deepspeed_config block configures DeepSpeed, or when the file is not at hand here)."""
    block = config.get("deepspeed_config") or {}
    if not block.get(FILE_KEY):
        _check_yaml_block(block)
        return
    _check_yaml_beside_file(config, block, source)
    if ds_json is None:
        return  # the file lives where only the pod can read it: the trainer checks it there
    _check_precision(ds_json, source)
    _check_zero_optimization(ds_json, source)
    _check_batch_sizes(ds_json, world_size, source)


def _check_yaml_beside_file(config: Mapping[str, Any], block: Mapping[str, Any],
                            source: str) -> None:
    """With deepspeed_config_file, accelerate refuses in every rank what the JSON must say."""
    owned = [key for key in KEYS_THE_JSON_OWNS if key in block]
    if owned:
        raise ConfigError(
            f"deepspeed_config.{owned[0]} is set in the accelerate config beside "
            f"deepspeed_config_file ({source}); accelerate refuses both in every rank: set it in "
            f"the JSON and delete deepspeed_config.{owned[0]} from the YAML"
        )
    if configured_precision(config) is not None:  # the legacy fp16: true sets it too
        key = "mixed_precision" if "mixed_precision" in config else "fp16"
        raise ConfigError(
            f"{key}: {config[key]!r} is set in the accelerate config "
            f"beside deepspeed_config_file ({source}); accelerate refuses it in every rank: say "
            f"it in the JSON (fp16/bf16 \"enabled\") and delete {key} from the YAML"
        )


def _check_zero_optimization(ds_json: Mapping[str, Any], source: str) -> None:
    """accelerate requires a zero_optimization section, with a ZeRO stage its offloads allow."""
    zero = ds_json.get("zero_optimization")
    if not isinstance(zero, Mapping):
        raise ConfigError(
            f"{source} has no zero_optimization section; accelerate requires one: add "
            '"zero_optimization": {"stage": 2} (stage 0, 1, 2 or 3)'
        )
    stage = zero.get("stage", 0)
    if stage != "auto" and stage not in ZERO_STAGES:
        raise ConfigError(
            f"{source}: zero_optimization.stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3"
        )
    for part in ("offload_optimizer", "offload_param"):
        offload = zero.get(part)
        if offload is None:
            continue
        if not isinstance(offload, Mapping):
            raise ConfigError(f"{source}: zero_optimization.{part} must be an object")
        _check_offload(f"{source}: zero_optimization.{part}.device", offload.get("device", "none"),
                       offload.get("nvme_path"), part == "offload_param", stage)


def _check_yaml_block(block: Mapping[str, Any]) -> None:
    stage = block.get("zero_stage")
    if stage is not None and stage not in ZERO_STAGES:
        raise ConfigError(
            f"deepspeed_config.zero_stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3"
        )
    for key, nvme_key, is_param in (
        ("offload_optimizer_device", "offload_optimizer_nvme_path", False),
        ("offload_param_device", "offload_param_nvme_path", True),
    ):
        if block.get(key) is not None:
            _check_offload(f"deepspeed_config.{key}", block[key], block.get(nvme_key), is_param,
                           2 if stage is None else stage)
    steps = block.get("gradient_accumulation_steps")
    if steps is not None and steps != "auto" and not _positive_int(steps):
        raise ConfigError(
            f"deepspeed_config.gradient_accumulation_steps={steps!r} must be a positive integer "
            "or \"auto\""
        )


def _check_offload(key: str, device: Any, nvme_path: Any, is_param: bool, stage: Any) -> None:
    device = str(device).lower()
    if device not in (*OFFLOAD_DEVICES, "auto"):
        raise ConfigError(f"{key}={device!r} is not an offload device; use none, cpu or nvme")
    if device == "nvme" and not nvme_path:
        raise ConfigError(f"{key} is nvme but no nvme_path is given; name a fast local disk")
    if is_param and device not in ("none", "auto") and stage not in (3, "auto"):
        raise ConfigError(
            f"{key}={device!r} offloads parameters, which only ZeRO stage 3 does (stage is "
            f"{stage}); use stage 3 or set the device to none"
        )


def _check_precision(ds_json: Mapping[str, Any], source: str) -> None:
    enabled = []
    for dtype in ("fp16", "bf16"):
        section = ds_json.get(dtype)
        if section is None:
            continue
        if not isinstance(section, Mapping):
            raise ConfigError(f"{source}: {dtype} must be an object such as {{\"enabled\": true}}")
        value = section.get("enabled", False)
        if value not in (True, False, "auto"):
            raise ConfigError(
                f"{source}: {dtype}.enabled={value!r} must be true, false or \"auto\""
            )
        if value is True:
            enabled.append(dtype)
    if len(enabled) == 2:
        raise ConfigError(
            f"{source} enables both fp16 and bf16; DeepSpeed trains in one: set one of them to "
            "false (or both to \"auto\")"
        )


def _check_batch_sizes(ds_json: Mapping[str, Any], world_size: int, source: str) -> None:
    """DeepSpeed asserts train_batch_size == micro batch x accumulation steps x world size."""
    values = {}
    for key in BATCH_KEYS:
        value = ds_json.get(key)
        if value is None or value == "auto":
            continue
        if not _positive_int(value):
            raise ConfigError(f"{source}: {key}={value!r} must be a positive integer or \"auto\"")
        values[key] = value
    total = values.get("train_batch_size")
    micro = values.get("train_micro_batch_size_per_gpu")
    steps = values.get("gradient_accumulation_steps")
    if total is None:
        return
    if micro is not None and steps is not None and total != micro * steps * world_size:
        raise ConfigError(
            f"{source}: train_batch_size={total} must equal train_micro_batch_size_per_gpu x "
            f"gradient_accumulation_steps x world size = {micro} x {steps} x {world_size} = "
            f"{micro * steps * world_size}; fix one of them or set train_batch_size to \"auto\""
        )
    for known, other in ((micro, "gradient_accumulation_steps"),
                         (steps, "train_micro_batch_size_per_gpu")):
        if known is not None and total % (known * world_size):
            raise ConfigError(
                f"{source}: train_batch_size={total} is not a multiple of "
                f"{known} x world size {world_size}, so no whole {other} fits; fix the numbers "
                "or set train_batch_size to \"auto\""
            )


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_accumulation_from_env(ds_json: Mapping[str, Any] | None, steps: int, env_name: str,
                                source: str = "the DeepSpeed config") -> None:
    """With a DeepSpeed JSON, accelerate fills only an "auto" gradient_accumulation_steps from
    the environment: a number there (or none, which accelerate reads as 1) wins over `env_name`
    and would change the global batch the pod asks for."""
    if ds_json is None:
        return
    value = ds_json.get("gradient_accumulation_steps")
    if value != "auto" and value != steps:
        shown = "left out (accelerate then uses 1)" if value is None else f"{value!r}"
        raise ConfigError(
            f"{source}: gradient_accumulation_steps is {shown}, and accelerate would use it "
            f"over {env_name}={steps}; set it to \"auto\" in the JSON"
        )

