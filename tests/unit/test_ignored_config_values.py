"""Every entry of docs/ignored-config-values.md: a value accelerate 1.15 would drop or override
without an error is refused (the operator before any pod, or the trainer with exit 78 on the
pod's real hardware) or named in a warning (a Warning event and the ConfigWarnings condition; a
line in the pod's log). Plus the configs that must keep training with no new refusal."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from accelerate_operator.api import parse_job
from accelerate_operator.decide import decide
from accelerate_operator.lifecycle import run_lifecycle
from accelerate_operator.resources.configmap import ConfigSource, prepare_config
from accelerate_operator.status import CONFIG_WARNINGS
from accelerate_trainer import __main__ as trainer_main
from accelerate_trainer import ignored
from accelerate_trainer.config import ConfigError
from accelerate_trainer.contract import CONFIG_KEY
from accelerate_trainer.ignored import (
    PodHardware,
    check_in_pod,
    check_pod_hardware,
    probe_hardware,
)

from devtools.examples import EXAMPLES_DIR, load_example
from tests.helpers.jobs import JobBuilder, pod
from tests.helpers.passes import snapshot

NOW = datetime(2026, 1, 1, 12, 0, 0)
CPU = {"distributed_type": "MULTI_CPU", "use_cpu": True}
GPU = {"distributed_type": "MULTI_GPU"}


def cpu_job(**config):
    return JobBuilder("j").nodes(2).procs(2).config(**CPU, **config).build()


def gpu_job(gpus: int | None = 8, procs: int | str = "auto", **config):
    builder = JobBuilder("j").nodes(2).procs(procs).config(**GPU, **config)
    if gpus is not None:
        builder.container(resources={"limits": {"nvidia.com/gpu": gpus}})
    return builder.build()


def render(body):
    """The operator's render: (job with its warnings, the config the pods read)."""
    job, configmap = prepare_config(parse_job(body), None)
    return job, yaml.safe_load(configmap["data"][CONFIG_KEY])


def refused(body) -> str:
    with pytest.raises(ConfigError) as error:
        prepare_config(parse_job(body), None)
    return str(error.value)


# ---- refused by the operator, before any pod ---------------------------------------------------


@pytest.mark.parametrize(("block", "owner", "dtype", "trains"), [
    ("fsdp_config", "FSDP", "MULTI_GPU", "plain DDP"),
    ("fsdp_config", "FSDP", "MULTI_CPU", "plain DDP on CPU"),
    ("deepspeed_config", "DEEPSPEED", "MULTI_GPU", "plain DDP"),
    ("deepspeed_config", "DEEPSPEED", "FSDP", "FSDP"),
    ("megatron_lm_config", "MEGATRON_LM", "MULTI_GPU", "plain DDP"),
])
def test_a_backend_block_its_distributed_type_does_not_select_is_refused(block, owner, dtype,
                                                                        trains):
    config = {"distributed_type": dtype, block: {"some_setting": 1}}
    if dtype == "MULTI_CPU":
        config["use_cpu"] = True
    message = refused(JobBuilder("j").config(**config).build())
    assert message == (
        f"{block} is set ({{'some_setting': 1}}) but distributed_type is {dtype}: accelerate "
        f"reads {block} only when distributed_type is {owner}, so it would train {trains} and "
        f"none of these settings would apply. Set distributed_type: {owner} to use them, or "
        f"delete the {block} block")


def test_an_empty_backend_block_as_accelerate_config_writes_it_is_fine():
    job, _ = render(cpu_job(fsdp_config={}, deepspeed_config={}, megatron_lm_config={}))
    assert job.config_warnings == ()


def test_fp16_on_a_cpu_job_is_refused_because_it_would_train_fp32():
    message = refused(cpu_job(mixed_precision="fp16"))
    assert message.startswith("mixed_precision: fp16 on a CPU job (use_cpu: true or MULTI_CPU)")
    assert "every step would run in fp32 without a word" in message
    assert "Use bf16" in message


def test_fp8_on_a_cpu_job_is_refused_before_any_pod():
    assert refused(cpu_job(mixed_precision="fp8")).startswith(
        "mixed_precision fp8 needs GPUs with FP8 support")


def test_bf16_on_a_cpu_job_trains_as_written():
    """CPU autocast supports bf16: accelerate sets native_amp on for the cpu device."""
    job, rendered = render(cpu_job(mixed_precision="bf16"))
    assert job.config_warnings == () and rendered["mixed_precision"] == "bf16"


def test_gpu_ids_beyond_the_pods_gpu_limit_are_refused():
    message = refused(gpu_job(gpus=2, gpu_ids="0,3"))
    assert message.startswith("gpu_ids '0,3' names GPU(s) 3 but each pod has 2 GPU(s)")


def test_fewer_gpu_ids_than_processes_per_node_are_refused():
    message = refused(gpu_job(gpus=8, procs=4, gpu_ids="0,1"))
    assert "makes 2 GPU(s) visible but each pod runs 4 process(es)" in message


def test_gpu_ids_within_the_limit_and_enough_for_the_processes_pass():
    job, rendered = render(gpu_job(gpus=4, procs=2, gpu_ids="0,1"))
    assert job.config_warnings == () and rendered["gpu_ids"] == "0,1"


def test_gpu_ids_are_not_judged_without_a_gpu_limit_in_the_template():
    """The GPUs may come another way (a device class, a different resource): the pod decides."""
    job, _ = render(gpu_job(gpus=None, procs=2, gpu_ids="5,6"))
    assert job.config_warnings == ()


# ---- warned: harmless, training goes on -------------------------------------------------------


def test_gpu_ids_on_a_cpu_job_are_warned_and_left_out_of_the_rendered_config():
    job, rendered = render(cpu_job(gpu_ids="0"))
    assert len(job.config_warnings) == 1
    assert job.config_warnings[0].startswith("gpu_ids '0' is ignored: this is a CPU job")
    assert "gpu_ids" not in rendered


@pytest.mark.parametrize(("config", "warning"), [
    ({"downcast_bf16": "yes", "mixed_precision": "bf16"},
     "downcast_bf16 'yes' is ignored: accelerate reads it only on TPUs"),
    ({"fp8_config": {"backend": "TE"}, "mixed_precision": "bf16"},
     "fp8_config is ignored: mixed_precision is 'bf16'"),
    ({"enable_cpu_affinity": True}, "enable_cpu_affinity is ignored on a CPU job"),
    ({"mpirun_config": {"mpirun_hostfile": "/h"}},
     "mpirun_config ({'mpirun_hostfile': '/h'}) is ignored: the pods launch every process "
     "through torchrun"),
    ({"tpu_name": "t", "tpu_use_cluster": True},
     "tpu_name, tpu_use_cluster are ignored: only accelerate's TPU launchers read them"),
    ({"main_training_function": "train"}, "main_training_function 'train' is ignored"),
    ({"main_process_ip": "10.0.0.1"}, "main_process_ip '10.0.0.1' is replaced"),
])
def test_a_harmless_dropped_value_is_warned_and_trains(config, warning):
    job, _ = render(cpu_job(**config))
    assert len(job.config_warnings) == 1, job.config_warnings
    assert job.config_warnings[0].startswith(warning), job.config_warnings[0]


def test_the_defaults_accelerate_config_writes_are_not_warned():
    defaults = {"downcast_bf16": "no", "enable_cpu_affinity": False, "gpu_ids": "all",
                "main_training_function": "main", "main_process_ip": None, "tpu_env": [],
                "tpu_use_cluster": False, "tpu_use_sudo": False, "rdzv_backend": "static",
                "same_network": True, "machine_rank": 0, "fp8_config": {}, "mixed_precision": "no"}
    job, _ = render(cpu_job(**defaults))
    assert job.config_warnings == ()


def test_warnings_from_a_configmap_name_the_file():
    body = JobBuilder("j").nodes(1).procs(2).config_from("mine", "a.yaml").build()
    text = "distributed_type: MULTI_CPU\nuse_cpu: true\ndowncast_bf16: true\n"
    job, _ = prepare_config(parse_job(body), ConfigSource("mine", "a.yaml", text))
    assert job.config_warnings[0].startswith(
        "ConfigMap 'mine' key 'a.yaml': downcast_bf16 True is ignored")


# ---- the examples and a valid CPU DDP config train with no new refusal -------------------------


@pytest.mark.parametrize("path", sorted(EXAMPLES_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_renders_without_refusal_or_warning(path):
    body, configmaps = load_example(path)
    ref = (body["spec"].get("accelerateConfigFrom") or {}).get("configMapKeyRef")
    source = None
    if ref:
        data = configmaps[ref["name"]]["data"]
        source = ConfigSource(ref["name"], ref["key"], data[ref["key"]], files=data)
    job, _ = prepare_config(parse_job(body), source)
    assert job.config_warnings == ()


# ---- the status: a Warning event once, and the ConfigWarnings condition ------------------------


def test_config_warnings_give_one_warning_event_and_a_condition_that_stays():
    job, _ = render(cpu_job(downcast_bf16=True))
    first = run_lifecycle(job, {}, [], NOW)
    events = [(e.type, e.reason) for e in first.events]
    assert ("Warning", "IgnoredConfigValues") in events
    condition = next(c for c in first.status["conditions"] if c["type"] == CONFIG_WARNINGS)
    assert condition["status"] == "True" and condition["reason"] == "IgnoredConfigValues"
    assert condition["message"].startswith(
        "1 accelerate config value(s) would be ignored; training goes on: downcast_bf16 True")
    # Later passes do not render the config again: the condition stays, no second event.
    later = run_lifecycle(parse_job(cpu_job(downcast_bf16=True)), first.status,
                           [pod("j", 0), pod("j", 1)], NOW)
    assert CONFIG_WARNINGS not in [e.reason for e in later.events]
    assert [c for c in later.status["conditions"] if c["type"] == CONFIG_WARNINGS] == [condition]
    assert later.status["phase"] == "Running"


def test_a_config_without_dropped_values_has_no_config_warnings_condition():
    plan = run_lifecycle(render(cpu_job())[0], {}, [], NOW)
    assert CONFIG_WARNINGS not in {c["type"] for c in plan.status["conditions"]}
    assert "IgnoredConfigValues" not in {e.reason for e in plan.events}


def test_decide_carries_the_renders_warnings_into_the_status_and_events():
    body = cpu_job(tpu_zone="us-central1-a")
    actions = decide(snapshot(body, NOW))
    assert len(actions.pods) == 2
    assert "IgnoredConfigValues" in {e.reason for e in actions.outcome.events}
    assert CONFIG_WARNINGS in {c["type"] for c in actions.status["conditions"]}


def test_a_refused_config_fails_the_job_without_pods_naming_the_key():
    body = cpu_job(mixed_precision="fp16")
    actions = decide(snapshot(body, NOW))
    assert actions.status["phase"] == "Failed" and not actions.pods and not actions.children
    failed = next(c for c in actions.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidConfig"
    assert failed["message"].startswith("mixed_precision: fp16 on a CPU job")


# ---- refused in the pod, on its real hardware (exit 78) ---------------------------------------

FP8_GPU = {**GPU, "mixed_precision": "fp8"}
INDUCTOR = {"dynamo_config": {"dynamo_backend": "INDUCTOR"}}


@pytest.mark.parametrize(("capabilities", "refused_with"), [
    (((8, 0), (8, 0)), "mixed_precision fp8 on GPUs of compute capability 8.0"),
    (((9, 0), (8, 6)), "compute capability 8.6"),
    (((9, 0), (8, 9)), None),
])
def test_fp8_on_gpus_below_compute_capability_8_9_is_refused(capabilities, refused_with):
    hardware = PodHardware(gpus=len(capabilities), capabilities=capabilities)
    if refused_with is None:
        check_pod_hardware(FP8_GPU, hardware)
        return
    with pytest.raises(ConfigError, match=refused_with) as error:
        check_pod_hardware(FP8_GPU, hardware)
    assert "trains fp16 instead" in str(error.value)


@pytest.mark.parametrize(("gpus", "refused"), [(0, True), (1, False), (None, False)])
def test_fp16_without_use_cpu_on_a_pod_that_sees_no_gpu_is_refused(gpus, refused):
    config = {"distributed_type": "NO", "mixed_precision": "fp16"}
    if not refused:
        check_pod_hardware(config, PodHardware(gpus=gpus))
        return
    with pytest.raises(ConfigError, match="fp16 on a pod whose torch sees no GPU"):
        check_pod_hardware(config, PodHardware(gpus=gpus))


def test_the_trainer_exits_78_for_fp16_on_a_pod_without_gpus(pod_main, monkeypatch, tmp_path):
    monkeypatch.setattr(trainer_main, "count_visible_gpus", lambda *_: 0)
    assert pod_main({"distributed_type": "NO", "mixed_precision": "fp16"}, processes=1) == 78
    assert "fp16 on a pod whose torch sees no GPU" in (tmp_path / "termination-log").read_text()


@pytest.mark.parametrize(("config", "hardware", "refused_with"), [
    ({**CPU, **INDUCTOR}, PodHardware(), "has no C++ compiler"),
    ({**CPU, **INDUCTOR}, PodHardware(cxx_compiler="/usr/bin/g++"), None),
    ({**GPU, **INDUCTOR}, PodHardware(gpus=2, c_compiler="/usr/bin/gcc"), "the triton package"),
    ({**GPU, **INDUCTOR}, PodHardware(gpus=2, triton=True), "a C compiler"),
    ({**GPU, **INDUCTOR}, PodHardware(gpus=2, triton=True, c_compiler="/usr/bin/cc"), None),
    ({**GPU, "dynamo_backend": "inductor"}, PodHardware(gpus=2), "the triton package"),
    ({**CPU, "dynamo_config": {"dynamo_backend": "AOT_EAGER"}}, PodHardware(), None),
])
def test_inductor_without_the_compilers_it_needs_is_refused(config, hardware, refused_with):
    if refused_with is None:
        check_pod_hardware(config, hardware)
        return
    with pytest.raises(ConfigError, match=re.escape(refused_with)):
        check_pod_hardware(config, hardware)


def test_probe_looks_for_the_compilers_inductor_uses(monkeypatch):
    monkeypatch.setenv("CXX", "my-cxx")
    monkeypatch.delenv("CC", raising=False)
    found = {"my-cxx": "/opt/my-cxx", "gcc": "/usr/bin/gcc"}
    monkeypatch.setattr(ignored.shutil, "which", found.get)
    hardware = probe_hardware({**CPU, **INDUCTOR})
    assert (hardware.cxx_compiler, hardware.c_compiler) == ("/opt/my-cxx", "/usr/bin/gcc")
    assert probe_hardware(CPU) == PodHardware()  # nothing asked, nothing probed


def test_probe_counts_conda_as_a_compiler_only_where_inductor_would_install_gcc(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(ignored.shutil, "which", {"conda": "/opt/conda/bin/conda"}.get)
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)
    assert probe_hardware({**CPU, **INDUCTOR}).cxx_compiler is None
    monkeypatch.setenv("TORCH_INDUCTOR_INSTALL_GXX", "1")
    assert probe_hardware({**CPU, **INDUCTOR}).cxx_compiler == "/opt/conda/bin/conda"


def test_the_pod_checks_gpu_ids_against_the_gpus_torch_sees():
    with pytest.raises(ConfigError, match="names GPU\\(s\\) 2 but each pod has 2 GPU"):
        check_in_pod({**GPU, "gpu_ids": "0,2"}, nproc_per_node=2, hardware=PodHardware(gpus=2))
    assert check_in_pod({**CPU, "downcast_bf16": True}, nproc_per_node=2,
                        hardware=PodHardware())[0].startswith("downcast_bf16 True is ignored")


# ---- the trainer's hook: a line in the log, or exit 78 ----------------------------------------


def trainer_env(config_file: Path) -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "0",
            "NUM_NODES": "1", "NPROC_PER_NODE": "2", "WORLD_SIZE": "2",
            "ACCELERATE_CONFIG_FILE": str(config_file)}


@pytest.fixture
def pod_main(tmp_path, monkeypatch, termination_log):
    monkeypatch.setattr(trainer_main.os, "execvpe", lambda *args: None)
    monkeypatch.setattr(trainer_main, "wait_for_master", lambda *a, **k: None)

    def run(config: dict, processes: int = 2) -> int:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({**config, "num_machines": 1,
                                        "num_processes": processes}))
        env = {**trainer_env(path), "NPROC_PER_NODE": str(processes),
               "WORLD_SIZE": str(processes)}
        return trainer_main.main(["train.py"], env)
    return run


def test_the_trainer_logs_a_warning_line_and_launches(pod_main, caplog):
    assert pod_main({**CPU, "downcast_bf16": True}) == 0
    assert any(r.message.startswith("WARNING: accelerate config: downcast_bf16 True is ignored")
               for r in caplog.records)


def test_the_trainer_exits_78_when_the_image_has_no_compiler_for_inductor(
        pod_main, monkeypatch, tmp_path):
    monkeypatch.setattr(ignored.shutil, "which", lambda name: None)
    assert pod_main({**CPU, **INDUCTOR}) == 78
    message = (tmp_path / "termination-log").read_text()
    assert message.startswith("invalid configuration: dynamo_config.dynamo_backend INDUCTOR")
