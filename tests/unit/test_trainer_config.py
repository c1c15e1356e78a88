"""Validation of real accelerate config files (as `accelerate config` writes them for accelerate
1.x, in accelerate_configs/), and the trainer's `main()` failing fast with exit code 78."""

from __future__ import annotations

import sys
from pathlib import Path

import accelerate_trainer.__main__ as trainer_main
import pytest
from accelerate_trainer import CONFIG_ERROR_EXIT_CODE, termination
from accelerate_trainer.config import (
    ConfigError,
    check_against_accelerate_schema,
    check_distribution,
    check_topology_keys,
    distributed_type,
    is_cpu_job,
    parse_accelerate_yaml,
)
from accelerate_trainer.termination import write_termination_message

CONFIGS = Path(__file__).parent / "accelerate_configs"

# The job each valid file was written for: (num_nodes, world_size, master_port).
VALID = {
    "no_distributed.yaml": (1, 1, 29500),
    "multi_cpu.yaml": (2, 4, 29500),
    "multi_gpu.yaml": (2, 16, 29500),
    "fsdp.yaml": (2, 16, 29500),
    "fsdp2.yaml": (2, 16, 29500),
    "deepspeed_zero2.yaml": (1, 8, 29500),
    "deepspeed_zero3_offload.yaml": (2, 16, 29500),
}


def load(name: str) -> dict:
    path = CONFIGS / name
    return parse_accelerate_yaml(path.read_text(), source=str(path))


def validate_all(config: dict, *, num_nodes: int, world_size: int, master_port: int) -> None:
    check_against_accelerate_schema(config)
    check_topology_keys(
        config, num_nodes=num_nodes, num_processes=world_size, master_port=master_port
    )
    check_distribution(config, num_nodes=num_nodes, num_processes=world_size)


# ---- valid files ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VALID))
def test_config_written_by_accelerate_config_passes_every_check(name):
    num_nodes, world_size, port = VALID[name]
    validate_all(load(name), num_nodes=num_nodes, world_size=world_size, master_port=port)


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_fixture_is_also_accepted_by_accelerates_own_loader(name):
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(CONFIGS / name))
    assert loaded.distributed_type.value == distributed_type(load(name))


@pytest.mark.parametrize(
    ("name", "cpu"),
    [
        ("no_distributed.yaml", False),
        ("multi_cpu.yaml", True),
        ("multi_gpu.yaml", False),
        ("fsdp.yaml", False),
        ("deepspeed_zero3_offload.yaml", False),
    ],
)
def test_cpu_jobs_are_recognised_by_multi_cpu_or_use_cpu(name, cpu):
    assert is_cpu_job(load(name)) is cpu


def test_use_cpu_with_multi_gpu_is_a_cpu_job():
    assert is_cpu_job({"distributed_type": "MULTI_GPU", "use_cpu": True})


def test_missing_distributed_type_reads_as_no():
    assert distributed_type({}) == "NO"


def test_topology_keys_left_out_or_null_are_filled_by_the_job():
    check_topology_keys(
        {"num_machines": None, "distributed_type": "MULTI_GPU"},
        num_nodes=3, num_processes=24, master_port=1234,
    )


def test_missing_mixed_precision_means_no():
    check_against_accelerate_schema({"distributed_type": "MULTI_GPU"})
    check_against_accelerate_schema({"distributed_type": "MULTI_GPU", "mixed_precision": None})


def test_mixed_precision_is_case_insensitive():
    check_against_accelerate_schema({"distributed_type": "MULTI_GPU", "mixed_precision": "BF16"})


def test_deepspeed_pdsh_is_fine_on_a_single_machine():
    check_distribution(load("invalid_deepspeed_pdsh.yaml"), num_nodes=1, num_processes=8)


def test_deepspeed_multinode_without_a_launcher_key_is_accepted():
    # The trainer passes --deepspeed_multinode_launcher standard itself (see command.py).
    check_distribution(load("deepspeed_zero2.yaml"), num_nodes=2, num_processes=16)


# ---- invalid files ----------------------------------------------------------------------------


def test_unknown_top_level_key_is_named_with_the_accepted_keys():
    with pytest.raises(ConfigError, match=r"unknown accelerate config key\(s\) num_gpus_per_node: "
                                          r"this image has accelerate 1\.\d+\.\d+.*"
                                          r"It accepts: .*num_machines"):
        check_against_accelerate_schema(load("invalid_unknown_key.yaml"))


def test_misspelt_distributed_type_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="distributed_type 'MULTI_GPUS' is not one of .*MULTI_"):
        check_against_accelerate_schema(load("invalid_distributed_type.yaml"))


def test_bad_mixed_precision_is_rejected_before_launch():
    with pytest.raises(ConfigError, match="mixed_precision 'fp32' is not one of no, fp8, fp16"):
        check_against_accelerate_schema(load("invalid_mixed_precision.yaml"))


def test_unquoted_no_for_mixed_precision_asks_for_quotes():
    with pytest.raises(ConfigError, match="mixed_precision is the boolean False.*quote it"):
        check_against_accelerate_schema(load("invalid_mixed_precision_unquoted_no.yaml"))


def test_accelerate_itself_only_catches_bad_mixed_precision_at_launch():
    """Why the trainer checks mixed_precision: accelerate's loader lets it through."""
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(CONFIGS / "invalid_mixed_precision.yaml"))
    assert loaded.mixed_precision == "fp32"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("invalid_unknown_key.yaml", "unknown keys"),
        ("invalid_distributed_type.yaml", "'MULTI_GPUS' is not a valid DistributedType"),
    ],
)
def test_accelerate_itself_rejects_unknown_keys_and_types(name, message):
    from accelerate.commands.config.config_args import load_config_from_file

    with pytest.raises(ValueError, match=message):
        load_config_from_file(str(CONFIGS / name))


def test_config_that_is_a_list_is_rejected():
    with pytest.raises(ConfigError, match="must be a mapping of accelerate keys, got list"):
        load("invalid_not_mapping.yaml")


def test_invalid_yaml_is_rejected_with_the_file_name():
    with pytest.raises(ConfigError, match=r"invalid_yaml\.yaml is not valid YAML"):
        load("invalid_yaml.yaml")


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"])
def test_empty_config_is_rejected(text):
    with pytest.raises(ConfigError, match="is empty"):
        parse_accelerate_yaml(text)


def test_num_machines_contradicting_the_job_is_rejected():
    with pytest.raises(
        ConfigError, match=r"num_machines=4 contradicts spec\.numNodes = 2.*make it 2"
    ):
        check_topology_keys(
            load("invalid_num_machines.yaml"), num_nodes=2, num_processes=16, master_port=29500
        )


def test_num_processes_is_the_total_over_all_machines():
    # multi_gpu.yaml says num_processes: 16 for 2 machines: 8 per machine, not 16.
    with pytest.raises(
        ConfigError, match=r"num_processes=16 contradicts spec\.numNodes x spec\.numProcPerNode = 8"
    ):
        check_topology_keys(load("multi_gpu.yaml"), num_nodes=2, num_processes=8, master_port=29500)


def test_main_process_port_contradicting_the_job_is_rejected():
    with pytest.raises(ConfigError, match=r"main_process_port=29500 contradicts spec\.masterPort"):
        check_topology_keys(
            load("multi_gpu.yaml"), num_nodes=2, num_processes=16, master_port=23456
        )


def test_deepspeed_multinode_with_pdsh_needs_ssh_and_is_rejected():
    with pytest.raises(ConfigError, match="deepspeed_multinode_launcher='pdsh' needs SSH"):
        check_distribution(load("invalid_deepspeed_pdsh.yaml"), num_nodes=2, num_processes=16)


def test_use_cpu_with_fsdp_is_rejected_because_it_would_quietly_be_ddp():
    with pytest.raises(ConfigError, match="use_cpu: true with distributed_type FSDP"):
        check_distribution(load("invalid_use_cpu_fsdp.yaml"), num_nodes=2, num_processes=16)


def test_no_distribution_with_several_processes_is_rejected():
    with pytest.raises(ConfigError, match="distributed_type NO runs one process"):
        check_distribution(load("no_distributed.yaml"), num_nodes=1, num_processes=2)


# ---- main(): exit 78 with the reason in the termination log -----------------------------------
# (the termination_log and no_exec fixtures are in conftest.py)


def job_env(config_file: Path, **extra: str) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "NODE_RANK": "0",
        "NUM_NODES": "2",
        "NPROC_PER_NODE": "2",
        "WORLD_SIZE": "4",
        "ACCELERATE_CONFIG_FILE": str(config_file),
        **extra,
    }


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("invalid_distributed_type.yaml", "distributed_type 'MULTI_GPUS' is not one of"),
        ("invalid_unknown_key.yaml", "unknown accelerate config key(s) num_gpus_per_node"),
        ("invalid_yaml.yaml", "is not valid YAML"),
        ("invalid_not_mapping.yaml", "must be a mapping"),
        ("invalid_num_machines.yaml", "num_machines=4 contradicts spec.numNodes = 2"),
    ],
)
def test_main_exits_78_and_explains_a_bad_config_in_the_termination_log(
    name, reason, termination_log, no_exec
):
    code = trainer_main.main(["train.py"], job_env(CONFIGS / name))
    assert code == CONFIG_ERROR_EXIT_CODE == 78
    message = termination_log.read_text()
    assert message.startswith("invalid configuration: ")
    assert reason in message
    assert no_exec == []


def test_main_exits_78_when_the_config_file_is_missing(tmp_path, termination_log, no_exec):
    code = trainer_main.main(["train.py"], job_env(tmp_path / "absent.yaml"))
    assert code == 78
    assert "cannot read the accelerate config" in termination_log.read_text()
    assert "ACCELERATE_CONFIG_FILE" in termination_log.read_text()


def test_main_exits_78_for_a_bad_topology(termination_log, no_exec):
    env = job_env(CONFIGS / "multi_cpu.yaml", WORLD_SIZE="5")
    assert trainer_main.main(["train.py"], env) == 78
    assert "WORLD_SIZE=5 must equal NUM_NODES x NPROC_PER_NODE" in termination_log.read_text()


def test_main_exits_78_for_a_gpu_config_on_a_pod_without_gpus(termination_log, no_exec):
    env = job_env(CONFIGS / "multi_gpu.yaml", NPROC_PER_NODE="8", WORLD_SIZE="16")
    assert trainer_main.main(["train.py"], env) == 78
    assert "needs GPUs but this pod sees none" in termination_log.read_text()


def test_termination_message_is_cut_to_what_kubernetes_keeps(termination_log):
    write_termination_message("x" * 10_000)
    assert len(termination_log.read_text()) == 4000


def test_termination_log_that_cannot_be_written_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setattr(termination, "TERMINATION_LOG", tmp_path / "no" / "such" / "dir")
    write_termination_message("still fine")
    directory = tmp_path / "a directory"
    directory.mkdir()
    write_termination_message("still fine", directory)


@pytest.mark.parametrize("argv", [[], ["--"], ["-h"], ["--help"]])
def test_main_without_a_script_prints_usage_and_exits_2(argv, termination_log, no_exec):
    assert trainer_main.main(argv, job_env(CONFIGS / "multi_cpu.yaml")) == 2
    assert termination_log.read_text() == ""  # nothing written


def test_main_execs_accelerate_launch_with_the_plan_for_a_valid_cpu_job(
    tmp_path, termination_log, no_exec
):
    checkpoint_dir = tmp_path / "job"
    (checkpoint_dir / "checkpoints" / "checkpoint_3").mkdir(parents=True)
    (checkpoint_dir / "checkpoints" / "checkpoint_3" / "COMPLETE").write_text("ok\n")
    (checkpoint_dir / "checkpoints" / "checkpoint_4").mkdir()  # half written
    env = job_env(CONFIGS / "multi_cpu.yaml", ACCELERATE_CHECKPOINT_DIR=str(checkpoint_dir))

    assert trainer_main.main(["--", "train.py", "--max-steps", "3"], env) == 0

    ((program, argv, exec_env),) = no_exec
    # Plain `accelerate launch` from PATH: the script runs as it runs on a laptop.
    assert program == "accelerate"
    assert argv[:2] == ("accelerate", "launch")
    assert "--multi_gpu" in argv
    assert argv[-3:] == ("train.py", "--max-steps", "3")
    assert "accelerate_trainer.fast_exit" not in argv
    assert exec_env["ACCELERATE_USE_CPU"] == "1"
    resume_from = checkpoint_dir / "checkpoints" / "checkpoint_3"
    assert exec_env["ACCELERATE_RESUME_FROM"] == str(resume_from)
    assert exec_env["MASTER_ADDR"] == "127.0.0.1"  # the pod's own env is passed on
    assert termination_log.read_text() == ""  # nothing written


@pytest.mark.parametrize("value", ["0", "", "no"])
def test_without_the_opt_in_the_launch_is_plain_accelerate_launch(value, termination_log,
                                                                   no_exec):
    env = job_env(CONFIGS / "multi_cpu.yaml", ACCELERATE_TRAINER_FAST_EXIT=value)

    assert trainer_main.main(["train.py", "--max-steps", "3"], env) == 0

    ((program, argv, _),) = no_exec
    assert program == "accelerate"
    assert argv[:2] == ("accelerate", "launch")
    assert argv[-3:] == ("train.py", "--max-steps", "3")


@pytest.mark.parametrize("value", ["1", "true", "on"])
def test_the_opt_in_runs_the_launcher_and_every_rank_under_fast_exit(value, termination_log,
                                                                      no_exec):
    env = job_env(CONFIGS / "multi_cpu.yaml", ACCELERATE_TRAINER_FAST_EXIT=value)

    assert trainer_main.main(["--", "train.py", "--max-steps", "3"], env) == 0

    ((program, argv, _),) = no_exec
    assert program == sys.executable
    assert argv[:6] == (sys.executable, "-m", "accelerate_trainer.fast_exit",
                        "-m", "accelerate.commands.accelerate_cli", "launch")
    assert argv[-5:] == ("--module", "accelerate_trainer.fast_exit",
                         "train.py", "--max-steps", "3")
