"""Some values of a config file as accelerate 1.15 reads them (commands/config/config_args.py
`BaseConfig.process_config`, commands/launch.py, utils/launch.py), so the checks judge what
accelerate will do with the file, not what its YAML seems to say. Pure; no accelerate import
(the operator runs the same checks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import ConfigError

# accelerate.utils.environment.str_to_bool's words, after str.lower().
TRUE_WORDS = ("y", "yes", "t", "true", "on", "1")
FALSE_WORDS = ("n", "no", "f", "false", "off", "0")


def flag(config: Mapping[str, Any], key: str) -> bool:
    """A boolean key accelerate reads with str_to_bool: use_cpu reaches every rank as
    ACCELERATE_USE_CPU=str(value) (utils/launch.py), so a quoted 'false' is false. A value
    str_to_bool refuses would fail every launch: refused here, naming the key."""
    if key not in config:
        return False
    value = config[key]
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in TRUE_WORDS or text in FALSE_WORDS:
        return text in TRUE_WORDS
    raise ConfigError(
        f"{key} {value!r} is not a boolean: accelerate reads it as one of "
        f"{', '.join(TRUE_WORDS)} or {', '.join(FALSE_WORDS)} and would fail the launch "
        f"on it; write {key}: true or {key}: false"
    )


def configured_precision(config: Mapping[str, Any]) -> Any:
    """The mixed_precision accelerate's loader holds: the key's value, or, in a file without
    it that an older `accelerate config` wrote, "fp16" where the legacy fp16 key is truthy
    (process_config converts it so, by Python truth: even fp16: 'false' is fp16); None for
    none."""
    if "mixed_precision" in config:
        return config["mixed_precision"]
    return "fp16" if config.get("fp16") else None


def precision(config: Mapping[str, Any]) -> str:
    """The precision the launch trains in, lower-case ("no" for none; a boolean, YAML's bare
    no, is refused by the schema check)."""
    value = configured_precision(config)
    return "no" if value is None or isinstance(value, bool) else str(value).lower()


def said_precision(config: Mapping[str, Any]) -> str:
    """How the config says its precision, for a message to name the key to change."""
    if "mixed_precision" in config or not config.get("fp16"):
        return f"mixed_precision: {precision(config)}"
    return (f"fp16: {config['fp16']!r} (the legacy key, which accelerate reads as "
            "mixed_precision fp16)")


def gpu_ids(config: Mapping[str, Any]) -> str | None:
    """The gpu_ids text accelerate passes on as CUDA_VISIBLE_DEVICES; None when absent or
    null. accelerate splits it on commas as text (`'int' object has no attribute 'split'`
    otherwise), so a number or a list YAML made of it is refused, saying to quote it."""
    value = config.get("gpu_ids")
    if value is None or isinstance(value, str):
        return value
    shown = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    kind = {bool: "boolean", list: "list"}.get(type(value), "number")
    raise ConfigError(
        f"gpu_ids {value!r} is a {kind} (YAML reads a bare {shown} so), but "
        f"accelerate reads gpu_ids as text and would crash on it; quote it: gpu_ids: "
        f"'{shown}' (as `accelerate config` writes it), or gpu_ids: all"
    )
