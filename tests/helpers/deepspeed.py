"""DeepSpeed rehearsal jobs on the CPU nodes (examples/cpu-deepspeed-zero3.yaml with another
ZeRO config), and the lines examples/train.py prints about them: SETUP, and with
--report-shards, SHARD (every rank) and SLICES (rank 0) from examples/zero_shards.py."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

import yaml

from devtools.cluster import ROOT

EXAMPLE = ROOT / "examples" / "cpu-deepspeed-zero3.yaml"
DDP_EXAMPLE = ROOT / "examples" / "cpu-ddp.yaml"

_SETUP = re.compile(r"^SETUP distributed_type=(\S+) mixed_precision=\S+"
                    r"(?: zero_stage=(\S+) offload_optimizer=(\S+))?", re.M)
_SHARD = re.compile(r"^SHARD rank=(\d+) stage=(\d) what=(\w+) numel=(\d+) total=(\d+) "
                    r"max_fraction=(\S+) adam_numel=(\d+) sum=(\S+)$", re.M)
_SLICES = re.compile(r"^SLICES stage=(\d) world=(\d+) sums=(\S+)$", re.M)


def zero_config(stage: int, *, offload_optimizer: bool = False) -> dict:
    """The DeepSpeed JSON: batch sizes left to accelerate, clipping at 1.0 (what accelerate
    forces), ZeRO-3's persistence thresholds at 0 so that even a tiny model's parameters are
    partitioned."""
    zero: dict = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, model_persistence_threshold=0)
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": zero}


def deepspeed_job(name: str, ds_config: dict, args: list[str]) -> dict:
    """The CPU DeepSpeed example with this JSON and these script arguments."""
    body = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    body["metadata"] = {"name": name}
    body["spec"]["accelerateConfigFiles"] = {"ds_config.json": json.dumps(ds_config, indent=1)}
    body["spec"]["template"]["spec"]["containers"][0]["args"] = [
        "/opt/accelerate/examples/train.py", *args]
    return body


def ddp_job(name: str, args: list[str]) -> dict:
    """The CPU DDP example (MULTI_CPU over gloo, clipping at 1.0) with these script arguments."""
    body = copy.deepcopy(yaml.safe_load(DDP_EXAMPLE.read_text()))
    body["metadata"] = {"name": name}
    body["spec"]["template"]["spec"]["containers"][0]["args"] = [
        "/opt/accelerate/examples/train.py", *args]
    return body


def add_checkpoints(body: dict, host_dir: str) -> dict:
    """A host folder both nodes mount (the local nodes share the host's disk, as pods share an
    NFS volume) as the job's checkpoint volume."""
    spec = body["spec"]
    spec["checkpoint"] = {"volumeName": "checkpoints", "mountPath": "/checkpoints"}
    spec["template"]["spec"]["volumes"].append(
        {"name": "checkpoints", "hostPath": {"path": host_dir, "type": "DirectoryOrCreate"}})
    return body


@dataclass(frozen=True)
class Setup:
    distributed_type: str
    zero_stage: str | None
    offload_optimizer: str | None


@dataclass(frozen=True)
class Shard:
    rank: int
    stage: int
    what: str
    numel: int
    total: int
    max_fraction: float
    adam_numel: int
    sum: float


@dataclass(frozen=True)
class Slices:
    stage: int
    world: int
    sums: tuple[float, ...]


def parse_setup(text: str) -> list[Setup]:
    return [Setup(*m.groups()) for m in _SETUP.finditer(text)]


def parse_shards(text: str) -> list[Shard]:
    return [Shard(int(m[1]), int(m[2]), m[3], int(m[4]), int(m[5]), float(m[6]), int(m[7]),
                  float(m[8])) for m in _SHARD.finditer(text)]


def parse_slices(text: str) -> list[Slices]:
    return [Slices(int(m[1]), int(m[2]), tuple(float(s) for s in m[3].split(",")))
            for m in _SLICES.finditer(text)]
