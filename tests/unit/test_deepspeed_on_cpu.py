"""DeepSpeed on pods without GPUs: refused unless the container opts in, launched with what each
rank must find when it does, and `check_accelerator` failing a rank whose accelerate set up
something else (a real Accelerator included)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import accelerate_trainer.__main__ as trainer_main
import pytest
from accelerate.utils import DistributedType
from accelerate_trainer.config import ConfigError, check_distribution
from accelerate_trainer.deepspeed_checks import check_accumulation_from_env
from accelerate_trainer.deepspeed_cpu import (
    ENV_DEEPSPEED_ON_CPU,
    ENV_EXPECTED_DISTRIBUTED_TYPE,
    ENV_EXPECTED_WORLD_SIZE,
    DistributedMismatch,
    check_accelerator,
    deepspeed_on_cpu_requested,
)

CONFIG = Path(__file__).parent / "deepspeed_on_cpu" / "accelerate.yaml"
TRAINER = Path(__file__).resolve().parents[2] / "trainer"
EXPECT_4 = {ENV_EXPECTED_DISTRIBUTED_TYPE: "DEEPSPEED", ENV_EXPECTED_WORLD_SIZE: "4"}


def job_env(**extra: str) -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "0",
            "NUM_NODES": "2", "NPROC_PER_NODE": "2", "WORLD_SIZE": "4",
            "ACCELERATE_CONFIG_FILE": str(CONFIG), **extra}


def test_deepspeed_on_a_pod_without_gpus_is_refused_with_the_fix_named(termination_log,
                                                                       no_exec):
    assert trainer_main.main(["train.py"], job_env()) == 78
    message = termination_log.read_text()
    assert "DEEPSPEED needs GPUs but this pod sees none" in message
    assert f"{ENV_DEEPSPEED_ON_CPU}=1" in message
    assert 'InitProcessGroupKwargs(backend="gloo")' in message
    assert no_exec == []


@pytest.mark.parametrize("value", ["0", "false", "", "maybe"])
def test_only_a_true_word_opts_in(value):
    assert not deepspeed_on_cpu_requested({ENV_DEEPSPEED_ON_CPU: value})
    assert deepspeed_on_cpu_requested({ENV_DEEPSPEED_ON_CPU: "True"})


def test_opted_in_deepspeed_launches_on_cpu_telling_each_rank_what_to_expect(termination_log,
                                                                            no_exec):
    assert trainer_main.main(["train.py"], job_env(**{ENV_DEEPSPEED_ON_CPU: "1"})) == 0
    ((_, argv, env),) = no_exec
    assert env[ENV_EXPECTED_DISTRIBUTED_TYPE] == "DEEPSPEED"
    assert env[ENV_EXPECTED_WORLD_SIZE] == "4"
    # Not the CPU path: ACCELERATE_USE_CPU would turn DeepSpeed into plain DDP.
    assert "ACCELERATE_USE_CPU" not in env
    assert "--cpu" not in argv and "--multi_gpu" not in argv
    assert argv[argv.index("--deepspeed_multinode_launcher") + 1] == "standard"


def test_a_json_accumulation_that_would_override_the_asked_for_one_is_refused(termination_log,
                                                                            no_exec):
    """ds_zero3.json says gradient_accumulation_steps: 1, which accelerate would use over the
    pod's ACCELERATE_GRADIENT_ACCUMULATION_STEPS (an elastic job's, at a reduced size)."""
    env = job_env(**{ENV_DEEPSPEED_ON_CPU: "1", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"})
    assert trainer_main.main(["train.py"], env) == 78
    assert ("gradient_accumulation_steps is 1, and accelerate would use it over "
            "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4; set it to \"auto\" in the JSON"
            ) in termination_log.read_text()
    assert no_exec == []


@pytest.mark.parametrize(("value", "refused"), [("auto", False), (4, False), (2, True),
                                                (None, True)])
def test_only_auto_or_the_same_number_lets_the_env_decide(value, refused):
    ds_json = {} if value is None else {"gradient_accumulation_steps": value}
    if refused:
        with pytest.raises(ConfigError, match="accelerate would use it over X=4"):
            check_accumulation_from_env(ds_json, 4, "X")
    else:
        check_accumulation_from_env(ds_json, 4, "X")
    check_accumulation_from_env(None, 4, "X")  # no JSON: the command line decides


def test_use_cpu_with_deepspeed_stays_refused_and_names_the_opt_in():
    with pytest.raises(ConfigError) as error:
        check_distribution({"distributed_type": "DEEPSPEED", "use_cpu": True},
                           num_nodes=2, num_processes=4)
    assert "would quietly train plain DDP" in str(error.value)
    assert f"remove use_cpu and set the env {ENV_DEEPSPEED_ON_CPU}=1" in str(error.value)


def state(dtype: DistributedType, processes: int) -> SimpleNamespace:
    return SimpleNamespace(distributed_type=dtype, num_processes=processes, process_index=0)


@pytest.mark.parametrize("dtype", [DistributedType.DEEPSPEED, DistributedType.NO])
def test_a_rank_without_the_gloo_backend_is_told_to_add_it(dtype):
    # accelerate 1.15 keeps DEEPSPEED with a world of 1 (seen in a pod); NO where no plugin is.
    with pytest.raises(DistributedMismatch, match="rank 0") as error:
        check_accelerator(state(dtype, 1), EXPECT_4)
    assert 'InitProcessGroupKwargs(backend="gloo")' in str(error.value)


def test_a_rank_that_fell_back_to_ddp_is_told_to_drop_use_cpu():
    with pytest.raises(DistributedMismatch, match="use_cpu / ACCELERATE_USE_CPU turns DeepSpeed"):
        check_accelerator(state(DistributedType.MULTI_CPU, 4), EXPECT_4)


def test_a_rank_in_a_smaller_world_fails():
    with pytest.raises(DistributedMismatch, match="world size 4 but rank 0 sees 2") as error:
        check_accelerator(state(DistributedType.DEEPSPEED, 2), EXPECT_4)
    assert "gloo" not in str(error.value)


def test_the_launched_setup_passes_and_a_run_outside_a_job_checks_nothing():
    check_accelerator(state(DistributedType.DEEPSPEED, 4), EXPECT_4)
    check_accelerator(state(DistributedType.NO, 1), {})


def test_a_real_accelerator_alone_in_a_deepspeed_launch_fails(monkeypatch):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    try:
        accelerator = Accelerator(cpu=True)
        with pytest.raises(DistributedMismatch, match="set up NO"):
            check_accelerator(accelerator, EXPECT_4)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()


ALONE_SCRIPT = """\
from accelerate import Accelerator

Accelerator(cpu=True)  # never checked by the script itself
print("TRAINED")
"""


@pytest.mark.parametrize(("expect", "code"), [(EXPECT_4, 1), ({}, 0)])
def test_a_rank_that_trained_alone_without_checking_fails_at_its_end(tmp_path, expect, code):
    """fast_exit makes the check for a script that did not: the rank exits 1, not 0."""
    (tmp_path / "alone.py").write_text(ALONE_SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", ENV_EXPECTED_WORLD_SIZE,
                        ENV_EXPECTED_DISTRIBUTED_TYPE)}
    env.update(expect, PYTHONPATH=os.pathsep.join([str(TRAINER), env.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "accelerate_trainer.fast_exit", "alone.py"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == code, result.stderr[-2000:]
    assert "TRAINED" in result.stdout
    assert ("checked after the script returned" in result.stderr) == bool(expect)


def test_a_failed_universal_conversion_fails_the_pod_naming_the_checkpoint(
        tmp_path, monkeypatch, termination_log, no_exec):
    """A DeepSpeed job resumed at another size has pod 0 convert the checkpoint first: when
    DeepSpeed's converter fails, the pod ends with 1 and its last word names the checkpoint."""
    checkpoint = tmp_path / "checkpoint_3"
    monkeypatch.setattr(trainer_main, "find_resume_checkpoint", lambda directory: checkpoint)

    def converter_fails(*args, **kwargs):
        raise subprocess.CalledProcessError(2, ["ds_to_universal.py"])

    monkeypatch.setattr(trainer_main, "prepare_universal_resume", converter_fails)
    env = job_env(**{ENV_DEEPSPEED_ON_CPU: "1", "ACCELERATE_CHECKPOINT_DIR": str(tmp_path)})
    assert trainer_main.main(["train.py"], env) == 1
    assert termination_log.read_text() == (
        f"DeepSpeed's converter could not make {checkpoint} a universal checkpoint (exit 2; "
        "its output is above)")
    assert no_exec == []
