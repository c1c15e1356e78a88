"""What the installed accelerate accepts in a config file: the keys of its ClusterConfig, its
distributed types and precisions, its FSDP names, and its version.

They are read from accelerate itself, and importing accelerate imports torch: seconds on every
pod's start, spent again by `accelerate launch` right after (docs/performance.md, "The trainer's
start"). So the image snapshots them when it is built (`python -m accelerate_trainer.schema
--write PATH`), and a pod reads the snapshot when it was taken from the accelerate it has, and
imports accelerate only when it was not (a user's image that upgraded accelerate, or has no
snapshot)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from .fsdp_checks import FsdpNames

DEFAULT_SNAPSHOT = "/opt/accelerate-trainer/accelerate-schema.json"
SNAPSHOT_ENV = "ACCELERATE_TRAINER_SCHEMA"


@dataclass(frozen=True)
class AccelerateSchema:
    version: str
    config_keys: frozenset[str]
    distributed_types: tuple[str, ...]
    precisions: tuple[str, ...]
    fsdp: FsdpNames
    # The destinations of `accelerate launch`'s arguments: where a block's keys go (block_keys.py).
    launch_args: frozenset[str] = frozenset()

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "config_keys": sorted(self.config_keys),
                           "distributed_types": list(self.distributed_types),
                           "precisions": list(self.precisions),
                           "fsdp": dataclasses.asdict(self.fsdp),
                           "launch_args": sorted(self.launch_args)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> AccelerateSchema:
        data = json.loads(text)
        return cls(version=data["version"], config_keys=frozenset(data["config_keys"]),
                   distributed_types=tuple(data["distributed_types"]),
                   precisions=tuple(data["precisions"]),
                   fsdp=FsdpNames(**{k: tuple(v) if isinstance(v, list) else v
                                     for k, v in data["fsdp"].items()}),
                   launch_args=frozenset(data["launch_args"]))


def from_accelerate() -> AccelerateSchema:
    """Read from the installed accelerate (imports it, and torch)."""
    import accelerate
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import DistributedType, PrecisionType, constants

    return AccelerateSchema(
        version=accelerate.__version__,
        config_keys=frozenset(field.name for field in dataclasses.fields(ClusterConfig)),
        distributed_types=tuple(member.value for member in DistributedType),
        precisions=tuple(member.value for member in PrecisionType),
        fsdp=FsdpNames(
            sharding_strategies=tuple(constants.FSDP_SHARDING_STRATEGY),
            auto_wrap_policies=tuple(constants.FSDP_AUTO_WRAP_POLICY),
            state_dict_types=tuple(constants.FSDP_STATE_DICT_TYPE),
            fsdp2_state_dict_types=tuple(getattr(constants, "FSDP2_STATE_DICT_TYPE",
                                                 constants.FSDP_STATE_DICT_TYPE)),
            backward_prefetch=tuple(constants.FSDP_BACKWARD_PREFETCH),
            source=f"accelerate {accelerate.__version__}",
        ),
        launch_args=frozenset(action.dest for action in launch_command_parser()._actions),
    )


def installed_version() -> str | None:
    try:
        return metadata.version("accelerate")
    except metadata.PackageNotFoundError:
        return None


def load(path: str | None = None) -> AccelerateSchema:
    """The snapshot when it matches the installed accelerate, else accelerate itself."""
    snapshot = Path(path or os.environ.get(SNAPSHOT_ENV) or DEFAULT_SNAPSHOT)
    try:
        schema = AccelerateSchema.from_json(snapshot.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return from_accelerate()
    return schema if schema.version == installed_version() else from_accelerate()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accelerate_trainer.schema",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="PATH", default=DEFAULT_SNAPSHOT,
                        help=f"where to write the snapshot (default {DEFAULT_SNAPSHOT})")
    args = parser.parse_args(argv)
    schema = from_accelerate()
    Path(args.write).parent.mkdir(parents=True, exist_ok=True)
    Path(args.write).write_text(schema.to_json())
    print(f"accelerate {schema.version}: {len(schema.config_keys)} config keys -> {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
