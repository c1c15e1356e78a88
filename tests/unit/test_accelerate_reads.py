"""Values the checks read as accelerate 1.15's config loading reads them (accelerate_reads.py):
use_cpu through str_to_bool (a quoted 'false' is false), the legacy fp16 key as mixed_precision
fp16, gpu_ids only as text, and distributed_type required. Each is judged both where the
operator renders and where the trainer exits 78."""

from __future__ import annotations

import pytest
import yaml
from accelerate_operator.api import parse_job
from accelerate_operator.resources.configmap import prepare_config
from accelerate_trainer import __main__ as trainer_main
from accelerate_trainer.command import build_launch_plan
from accelerate_trainer.config import ConfigError, check_against_accelerate_schema, is_cpu_job
from accelerate_trainer.ignored import PodHardware, check_in_pod
from accelerate_trainer.topology import parse_topology

from tests.helpers.jobs import JobBuilder

ENV = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "0", "NUM_NODES": "1",
       "NPROC_PER_NODE": "1", "WORLD_SIZE": "1"}


@pytest.fixture
def pod_main(tmp_path, monkeypatch, termination_log):
    """main() in a pod without GPUs: (exit code, termination message, the env it launched)."""
    launched = []
    monkeypatch.setattr(trainer_main.os, "execvpe", lambda *args: launched.append(args[2]))
    monkeypatch.setattr(trainer_main, "wait_for_master", lambda *a, **k: None)
    monkeypatch.setattr(trainer_main, "count_visible_gpus", lambda *_: 0)

    def run(config: dict) -> tuple[int, str, dict | None]:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({"num_machines": 1, "num_processes": 1, **config}))
        code = trainer_main.main(["train.py"], {**ENV, "ACCELERATE_CONFIG_FILE": str(path)})
        return code, termination_log.read_text(), launched[-1] if launched else None
    return run


# ---- use_cpu: str_to_bool, as accelerate passes it to every rank ------------------------------


@pytest.mark.parametrize("value", [True, False, "true", "false", "yes", "no", "on", "off",
                                   "y", "n", "1", "0", 1, 0, "True", "FALSE"])
def test_use_cpu_means_what_accelerates_str_to_bool_makes_of_it(value):
    from accelerate.utils import str_to_bool

    config = {"distributed_type": "MULTI_GPU", "use_cpu": value}
    assert is_cpu_job(config) is bool(str_to_bool(str(value)))


def test_a_quoted_false_use_cpu_launches_on_the_gpus_as_accelerate_would():
    topology = parse_topology({**ENV, "ACCELERATE_CONFIG_FILE": "/etc/accelerate/config.yaml"})
    plan = build_launch_plan(topology, {"distributed_type": "NO", "use_cpu": "false"},
                             ["train.py"])
    assert "ACCELERATE_USE_CPU" not in plan.env


def test_a_quoted_false_use_cpu_on_a_pod_without_gpus_is_refused_for_its_gpus(pod_main):
    code, message, _ = pod_main({"distributed_type": "MULTI_GPU", "use_cpu": "false",
                                 "num_processes": 1})
    assert code == 78 and "needs GPUs but this pod sees none" in message


@pytest.mark.parametrize("value", ["maybe", None, 2])
def test_a_use_cpu_accelerate_cannot_read_is_refused_naming_it(pod_main, value):
    code, message, _ = pod_main({"distributed_type": "NO", "use_cpu": value})
    assert code == 78
    assert message.startswith(f"invalid configuration: use_cpu {value!r} is not a boolean")


# ---- the legacy fp16 key: mixed_precision fp16 -------------------------------------------------


def test_accelerates_loader_turns_the_legacy_fp16_key_into_mixed_precision(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "NO", "fp16": True}))
    assert load_config_from_file(str(path)).mixed_precision == "fp16"


def test_the_legacy_fp16_key_on_a_cpu_job_is_refused_naming_it(pod_main):
    code, message, _ = pod_main({"distributed_type": "NO", "use_cpu": True, "fp16": True})
    assert code == 78
    assert message.startswith("invalid configuration: fp16: True (the legacy key")


def test_the_legacy_fp16_key_on_a_pod_without_gpus_is_refused():
    with pytest.raises(ConfigError, match=r"^fp16: True \(the legacy key.*torch sees no GPU"):
        check_in_pod({"distributed_type": "MULTI_GPU", "fp16": True}, nproc_per_node=1,
                     hardware=PodHardware(gpus=0))
    check_in_pod({"distributed_type": "MULTI_GPU", "fp16": False}, nproc_per_node=1,
                 hardware=PodHardware(gpus=0))


def test_the_legacy_fp16_key_beside_a_deepspeed_file_is_refused_at_render():
    body = JobBuilder("j").nodes(1).procs(2).config(
        distributed_type="DEEPSPEED", fp16=True,
        deepspeed_config={"deepspeed_config_file": "/data/ds.json"}).build()
    with pytest.raises(ConfigError, match="^fp16: True is set in the accelerate config beside"):
        prepare_config(parse_job(body), None)


# ---- gpu_ids: text --------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "quoted"), [(0, "'0'"), ([0, 1], "'0,1'")])
def test_gpu_ids_yaml_did_not_read_as_text_are_refused_saying_to_quote_them(value, quoted):
    body = JobBuilder("j").nodes(2).procs(1).config(distributed_type="MULTI_GPU",
                                                    gpu_ids=value).build()
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {
        "limits": {"nvidia.com/gpu": 2}}
    with pytest.raises(ConfigError, match=f"^gpu_ids .* quote it: gpu_ids: {quoted}"):
        prepare_config(parse_job(body), None)


def test_gpu_ids_in_a_pod_are_refused_unless_text():
    with pytest.raises(ConfigError, match="quote it: gpu_ids: '0'"):
        check_in_pod({"distributed_type": "NO", "gpu_ids": 0}, nproc_per_node=1,
                     hardware=PodHardware(gpus=1))
    check_in_pod({"distributed_type": "NO", "gpu_ids": "0"}, nproc_per_node=1,
                 hardware=PodHardware(gpus=1))


# ---- distributed_type: required ---------------------------------------------------------------


def test_accelerates_loader_refuses_a_file_without_distributed_type(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"mixed_precision": "no", "use_cpu": True}))
    with pytest.raises(ValueError):
        load_config_from_file(str(path))


def test_a_config_without_distributed_type_exits_78_naming_it(pod_main):
    code, message, launched = pod_main({"mixed_precision": "no", "use_cpu": True})
    assert code == 78 and launched is None
    assert message.startswith("invalid configuration: distributed_type is missing")
    with pytest.raises(ConfigError, match="^distributed_type is missing"):
        check_against_accelerate_schema({"use_cpu": True})


# ---- the devices a distributed_type trains on, counted as accelerate launch counts them ------
def test_a_vendor_backend_is_counted_on_its_own_devices(monkeypatch):
    """MULTI_XPU on an Intel pod was refused: only CUDA's devices were counted."""
    import torch
    from accelerate import utils

    monkeypatch.setattr(utils, "is_xpu_available", lambda *a, **k: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert trainer_main.count_visible_gpus("MULTI_XPU") == 4
    assert trainer_main.count_visible_gpus("MULTI_GPU") == 0
    monkeypatch.setattr(utils, "is_npu_available", lambda *a, **k: False)
    assert trainer_main.count_visible_gpus("MULTI_NPU") == 0  # no plugin: none usable
    assert trainer_main.count_visible_gpus("XLA") is None


def test_a_vendor_backend_without_devices_is_refused_naming_them(pod_main):
    code, message, _ = pod_main({"distributed_type": "MULTI_XPU"})
    assert code == 78
    assert "MULTI_XPU needs Intel XPUs but this pod sees none" in message
    assert "the Intel XPUs of its device plugin" in message
