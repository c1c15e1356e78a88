"""build_launch_plan as whole argv tuples, then the same argv fed to accelerate's own launch
parser: the plumbing of CPU, FSDP and DeepSpeed jobs checked with accelerate's code, since only
CPU DDP can train on this host."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from accelerate_trainer.command import LaunchPlan, build_launch_plan
from accelerate_trainer.config import parse_accelerate_yaml
from accelerate_trainer.topology import Topology

CONFIGS = Path(__file__).parent / "accelerate_configs"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def load(name: str) -> dict:
    return parse_accelerate_yaml((CONFIGS / name).read_text())


def topology(name: str, *, num_nodes: int, nproc_per_node: int, node_rank: int = 0,
             gradient_accumulation: int | None = None) -> Topology:
    return Topology(
        master_addr="job-node-0.job",
        master_port=29500,
        node_rank=node_rank,
        num_nodes=num_nodes,
        nproc_per_node=nproc_per_node,
        world_size=num_nodes * nproc_per_node,
        config_file=str(CONFIGS / name),
        gradient_accumulation=gradient_accumulation,
    )


def head(name: str, *, num_nodes: int, world_size: int, node_rank: int) -> tuple[str, ...]:
    return (
        "accelerate", "launch",
        "--config_file", str(CONFIGS / name),
        "--num_machines", str(num_nodes),
        "--num_processes", str(world_size),
        "--machine_rank", str(node_rank),
        "--main_process_ip", "job-node-0.job",
        "--main_process_port", "29500",
        "--rdzv_conf", "timeout=600,join_timeout=600",
    )


# ---- build_launch_plan -------------------------------------------------------------------------


def test_cpu_job_launches_through_torchrun_with_use_cpu_env():
    plan = build_launch_plan(
        topology("multi_cpu.yaml", num_nodes=2, nproc_per_node=2, node_rank=1),
        load("multi_cpu.yaml"),
        ["train.py", "--max-steps", "3"],
    )
    assert plan == LaunchPlan(
        argv=head("multi_cpu.yaml", num_nodes=2, world_size=4, node_rank=1)
        + ("--multi_gpu", "--rdzv_backend", "static", "--same_network",
           "train.py", "--max-steps", "3"),
        env={"ACCELERATE_USE_CPU": "1"},
    )


def test_single_cpu_process_gets_use_cpu_but_not_multi_gpu():
    config = {"distributed_type": "NO", "use_cpu": True}
    plan = build_launch_plan(
        topology("no_distributed.yaml", num_nodes=1, nproc_per_node=1), config, ["train.py"]
    )
    assert plan == LaunchPlan(
        argv=head("no_distributed.yaml", num_nodes=1, world_size=1, node_rank=0) + ("train.py",),
        env={"ACCELERATE_USE_CPU": "1"},
    )


def test_single_gpu_process_is_launched_plainly():
    plan = build_launch_plan(
        topology("no_distributed.yaml", num_nodes=1, nproc_per_node=1),
        load("no_distributed.yaml"),
        ["train.py"],
    )
    assert plan == LaunchPlan(
        argv=head("no_distributed.yaml", num_nodes=1, world_size=1, node_rank=0)
        + ("--rdzv_backend", "static", "--same_network", "train.py"),
        env={},
    )


def test_gpu_job_leaves_the_launcher_to_the_config():
    plan = build_launch_plan(
        topology("multi_gpu.yaml", num_nodes=2, nproc_per_node=8), load("multi_gpu.yaml"),
        ["train.py"],
    )
    assert plan == LaunchPlan(
        argv=head("multi_gpu.yaml", num_nodes=2, world_size=16, node_rank=0)
        + ("--rdzv_backend", "static", "--same_network", "train.py"),
        env={},
    )


def test_deepspeed_multinode_job_gets_the_standard_launcher():
    plan = build_launch_plan(
        topology("deepspeed_zero2.yaml", num_nodes=2, nproc_per_node=8, node_rank=1),
        load("deepspeed_zero2.yaml"),
        ["train.py"],
    )
    assert plan.argv == head("deepspeed_zero2.yaml", num_nodes=2, world_size=16, node_rank=1) + (
        "--rdzv_backend", "static", "--same_network",
        "--deepspeed_multinode_launcher", "standard",
        "train.py",
    )
    # What each rank must find (accelerate_trainer.deepspeed_cpu.check_accelerator).
    assert plan.env == {"ACCELERATE_TRAINER_EXPECTED_DISTRIBUTED_TYPE": "DEEPSPEED",
                        "ACCELERATE_TRAINER_EXPECTED_WORLD_SIZE": "16"}


def test_deepspeed_on_one_machine_needs_no_multinode_launcher():
    plan = build_launch_plan(
        topology("deepspeed_zero2.yaml", num_nodes=1, nproc_per_node=8),
        load("deepspeed_zero2.yaml"),
        ["train.py"],
    )
    assert "--deepspeed_multinode_launcher" not in plan.argv


def test_rdzv_backend_from_the_yaml_is_passed_on_the_command_line():
    # accelerate ignores rdzv_backend in the YAML: its CLI default "static" is not None.
    config = {**load("multi_gpu.yaml"), "rdzv_backend": "c10d", "same_network": False}
    plan = build_launch_plan(
        topology("multi_gpu.yaml", num_nodes=2, nproc_per_node=8), config, ["train.py"]
    )
    assert plan.argv == head("multi_gpu.yaml", num_nodes=2, world_size=16, node_rank=0) + (
        "--rdzv_backend", "c10d", "train.py",
    )


def test_dash_m_module_becomes_accelerates_module_flag():
    plan = build_launch_plan(
        topology("multi_cpu.yaml", num_nodes=2, nproc_per_node=2),
        load("multi_cpu.yaml"),
        ["-m", "my_pkg.train", "--epochs", "1"],
    )
    assert plan.argv[-5:] == ("--same_network", "--module", "my_pkg.train", "--epochs", "1")


def test_fast_exit_wraps_the_launcher_and_every_rank():
    plan = build_launch_plan(
        topology("multi_cpu.yaml", num_nodes=2, nproc_per_node=2, node_rank=1),
        load("multi_cpu.yaml"),
        ["train.py", "--max-steps", "3"],
        fast_exit_python="/opt/venv/bin/python",
    )
    launch_flags = head("multi_cpu.yaml", num_nodes=2, world_size=4, node_rank=1)[2:]
    assert plan == LaunchPlan(
        argv=("/opt/venv/bin/python", "-m", "accelerate_trainer.fast_exit",
              "-m", "accelerate.commands.accelerate_cli", "launch") + launch_flags
        + ("--multi_gpu", "--rdzv_backend", "static", "--same_network",
           "--module", "accelerate_trainer.fast_exit", "train.py", "--max-steps", "3"),
        env={"ACCELERATE_USE_CPU": "1"},
    )


def test_fast_exit_passes_a_users_module_on_to_the_rank():
    plan = build_launch_plan(
        topology("multi_cpu.yaml", num_nodes=2, nproc_per_node=2),
        load("multi_cpu.yaml"),
        ["-m", "my_pkg.train", "--epochs", "1"],
        fast_exit_python="python3",
    )
    assert plan.argv[-7:] == ("--same_network", "--module", "accelerate_trainer.fast_exit",
                              "-m", "my_pkg.train", "--epochs", "1")


def test_resume_checkpoint_reaches_the_script_through_the_env():
    plan = build_launch_plan(
        topology("multi_gpu.yaml", num_nodes=2, nproc_per_node=8),
        load("multi_gpu.yaml"),
        ["train.py"],
        resume_from="/ckpt/checkpoints/checkpoint_7",
    )
    assert plan.env == {"ACCELERATE_RESUME_FROM": "/ckpt/checkpoints/checkpoint_7"}


def test_script_arguments_that_look_like_launcher_flags_stay_after_the_script():
    plan = build_launch_plan(
        topology("multi_gpu.yaml", num_nodes=2, nproc_per_node=8),
        load("multi_gpu.yaml"),
        ["train.py", "--num_processes", "1", "-m"],
    )
    assert plan.argv[-4:] == ("train.py", "--num_processes", "1", "-m")


def test_build_does_not_mutate_the_config_or_script():
    config = load("multi_cpu.yaml")
    before = dict(config)
    script = ["-m", "pkg"]
    build_launch_plan(topology("multi_cpu.yaml", num_nodes=2, nproc_per_node=2), config, script)
    assert config == before
    assert script == ["-m", "pkg"]


# ---- the same argv through accelerate's own launch parser ------------------------------------


def accelerate_args(plan: LaunchPlan):
    """Parse our argv exactly as `accelerate launch` does, config file and all."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    launch = plan.argv.index("launch")
    assert plan.argv[:launch] in (
        ("accelerate",),
        (sys.executable, "-m", "accelerate_trainer.fast_exit",
         "-m", "accelerate.commands.accelerate_cli"),
    )
    args = launch_command_parser().parse_args(list(plan.argv[launch + 1:]))
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    return args, defaults, mixed_precision_from_config


def test_accelerate_routes_our_cpu_argv_to_torchrun_with_the_machine_topology(monkeypatch):
    plan = build_launch_plan(
        topology("multi_cpu.yaml", num_nodes=2, nproc_per_node=2, node_rank=1),
        load("multi_cpu.yaml"),
        ["train.py", "--max-steps", "3"],
    )
    args, _, _ = accelerate_args(plan)
    # launch_command() takes the torchrun path (multi_gpu_launcher) only for multi_gpu and not cpu.
    assert args.multi_gpu and not args.cpu
    assert not args.use_fsdp and not args.use_deepspeed
    assert args.use_cpu is True  # from the YAML, but accelerate never passes it to the children

    from accelerate.utils.launch import prepare_multi_gpu_env

    for name, value in plan.env.items():
        monkeypatch.setenv(name, value)
    env = prepare_multi_gpu_env(args)  # machine rank 1: no port probe
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "2", 1)
    assert (args.master_addr, args.master_port) == ("job-node-0.job", "29500")  # --same_network
    assert (args.training_script, args.training_script_args) == ("train.py", ["--max-steps", "3"])
    assert env["ACCELERATE_USE_CPU"] == "1"  # what makes the children gloo ranks, not world size 1


def test_torchrun_starts_each_rank_under_fast_exit(monkeypatch):
    plan = build_launch_plan(
        topology("multi_cpu.yaml", num_nodes=2, nproc_per_node=2, node_rank=1),
        load("multi_cpu.yaml"),
        ["train.py", "--max-steps", "3"],
        fast_exit_python=sys.executable,
    )
    args, _, _ = accelerate_args(plan)
    from accelerate.commands.launch import _filter_args
    from accelerate.utils.launch import prepare_multi_gpu_env
    from torch.distributed.run import config_from_args, get_args_parser

    for name, value in plan.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    prepare_multi_gpu_env(args)
    # What multi_gpu_launcher() hands to torchrun.
    torchrun_args = _filter_args(args, get_args_parser(), [
        "--training_script", args.training_script,
        "--training_script_args", args.training_script_args])
    _, command, command_args = config_from_args(torchrun_args)
    assert [command, *command_args] == [
        sys.executable, "-u", "-m", "accelerate_trainer.fast_exit", "train.py", "--max-steps", "3"]


def test_accelerate_uses_a_rendezvous_endpoint_without_same_network():
    config = {**load("multi_gpu.yaml"), "same_network": False}
    plan = build_launch_plan(
        topology("multi_gpu.yaml", num_nodes=2, nproc_per_node=8, node_rank=1), config, ["t.py"]
    )
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = accelerate_args(plan)
    # The YAML says same_network: true, but only the CLI flag counts, and we did not pass it.
    prepare_multi_gpu_env(args)
    assert args.rdzv_endpoint == "job-node-0.job:29500"


def fsdp_env(name: str, monkeypatch) -> dict[str, str]:
    from accelerate.utils.launch import prepare_multi_gpu_env

    plan = build_launch_plan(
        topology(name, num_nodes=2, nproc_per_node=8, node_rank=1), load(name), ["train.py"]
    )
    args, _, _ = accelerate_args(plan)
    assert args.use_fsdp and not args.multi_gpu
    env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    assert (args.nnodes, args.nproc_per_node) == ("2", "8")
    return env


def test_fsdp_full_shard_config_reaches_the_fsdp_plugin(monkeypatch):
    env = fsdp_env("fsdp.yaml", monkeypatch)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert "ACCELERATE_USE_CPU" not in env

    import accelerate.utils.dataclasses as accelerate_dataclasses
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy, StateDictType

    # fsdp_sync_module_states (which accelerate config writes with cpu_ram_efficient_loading)
    # makes the plugin ask for the current GPU; pretend there is one: the plumbing is the test.
    monkeypatch.setattr(accelerate_dataclasses, "is_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 1
    assert plugin.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert plugin.backward_prefetch == BackwardPrefetch.BACKWARD_PRE
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    assert plugin.sync_module_states is True
    assert plugin.cpu_ram_efficient_loading is True


def test_fsdp1_plugin_cannot_even_be_built_on_a_host_without_gpus(monkeypatch):
    """Why the test above fakes a device: FSDP is GPU only, from the plugin on."""
    fsdp_env("fsdp.yaml", monkeypatch)
    from accelerate.utils import FullyShardedDataParallelPlugin

    with pytest.raises(RuntimeError, match="no available devices"):
        FullyShardedDataParallelPlugin()


def test_fsdp2_config_reaches_the_fsdp_plugin_as_version_2(monkeypatch):
    env = fsdp_env("fsdp2.yaml", monkeypatch)
    assert env["FSDP_VERSION"] == "2"
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True  # FSDP2's spelling of FULL_SHARD
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]


def deepspeed_env(name: str, *, num_nodes: int, gradient_accumulation: int | None = None,
                  drop_flag: bool = False) -> tuple[list[str] | None, dict[str, str]]:
    """`drop_flag`: without the --gradient_accumulation_steps build_launch_plan adds."""
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    plan = build_launch_plan(
        topology(name, num_nodes=num_nodes, nproc_per_node=8, node_rank=num_nodes - 1,
                 gradient_accumulation=gradient_accumulation),
        load(name),
        ["train.py"],
    )
    if drop_flag:
        argv = list(plan.argv)
        index = argv.index("--gradient_accumulation_steps")
        del argv[index:index + 2]
        plan = LaunchPlan(tuple(argv), plan.env)
    args, defaults, mixed_precision_from_config = accelerate_args(plan)
    assert args.use_deepspeed
    # What launch_command() adds before calling deepspeed_launcher().
    fields = list(defaults.deepspeed_config)
    if mixed_precision_from_config:
        fields.append("mixed_precision")
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    return prepare_deepspeed_cmd_env(args)


def test_deepspeed_multinode_argv_takes_the_torchrun_path_not_pdsh():
    cmd, env = deepspeed_env("deepspeed_zero3_offload.yaml", num_nodes=2)
    assert cmd is None  # no `deepspeed --hostfile ... --launcher pdsh` command: torchrun in-process
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "cpu"
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"] == "cpu"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "true"
    # It overrides the gradient_accumulation_steps a script passes to Accelerator().
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"


def test_accelerate_defaults_multinode_deepspeed_to_pdsh_without_our_flag():
    """Why build_launch_plan adds --deepspeed_multinode_launcher standard."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    plan = build_launch_plan(
        topology("deepspeed_zero2.yaml", num_nodes=2, nproc_per_node=8, node_rank=1),
        load("deepspeed_zero2.yaml"),
        ["train.py"],
    )
    argv = list(plan.argv[2:])
    index = argv.index("--deepspeed_multinode_launcher")
    del argv[index:index + 2]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    args.deepspeed_fields_from_accelerate_config = ""
    cmd, _ = prepare_deepspeed_cmd_env(args)
    assert cmd[:1] == ["deepspeed"] and "pdsh" in cmd


@pytest.mark.skipif(
    not HAS_DEEPSPEED,
    reason="deepspeed is not installed (not in the dev extras: it builds CUDA ops); "
           "pip install deepspeed to check DeepSpeedPlugin construction",
)
@pytest.mark.parametrize(
    ("name", "num_nodes", "stage", "offload"),
    [("deepspeed_zero2.yaml", 1, 2, "none"), ("deepspeed_zero3_offload.yaml", 2, 3, "cpu")],
)
def test_deepspeed_config_reaches_the_deepspeed_plugin(
    name, num_nodes, stage, offload, monkeypatch
):
    _, env = deepspeed_env(name, num_nodes=num_nodes)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == stage
    assert plugin.offload_param_device == offload
    assert plugin.offload_optimizer_device == offload
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == stage


# ---- the accumulation an elastic job's pods are told (ACCELERATE_GRADIENT_ACCUMULATION_STEPS) --


def test_an_asked_for_accumulation_reaches_every_rank_through_accelerates_variable():
    plan = build_launch_plan(
        topology("multi_cpu.yaml", num_nodes=1, nproc_per_node=2, gradient_accumulation=4),
        load("multi_cpu.yaml"), ["train.py"])
    assert plan.env == {"ACCELERATE_USE_CPU": "1", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}
    assert "--gradient_accumulation_steps" not in plan.argv  # a DeepSpeed-only flag


def test_a_deepspeed_launch_passes_it_on_the_command_line():
    plan = build_launch_plan(
        topology("deepspeed_zero2.yaml", num_nodes=1, nproc_per_node=8, gradient_accumulation=4),
        load("deepspeed_zero2.yaml"), ["train.py"])
    assert plan.argv[-3:] == ("--gradient_accumulation_steps", "4", "train.py")


def test_deepspeeds_launcher_takes_our_accumulation_over_the_yamls():
    """deepspeed_zero2.yaml says gradient_accumulation_steps: 1: accelerate's launcher would set
    the ranks' variable from it, over the pod's, without the command-line flag."""
    _, env = deepspeed_env("deepspeed_zero2.yaml", num_nodes=1, gradient_accumulation=4)
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"
    _, env = deepspeed_env("deepspeed_zero2.yaml", num_nodes=1, gradient_accumulation=4,
                           drop_flag=True)
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "1"



def test_a_universal_checkpoints_json_replaces_the_yamls_for_accelerate():
    """deepspeed_universal.py's copy of the JSON (with checkpoint.load_universal) reaches
    accelerate over the deepspeed_config_file the YAML names."""
    yaml_path = Path(__file__).parent / "deepspeed_on_cpu" / "accelerate.yaml"
    universal = "/ckpt/.accelerate-trainer/deepspeed-universal.json"
    plan = build_launch_plan(
        Topology(master_addr="job-0.job", master_port=29500, node_rank=0, num_nodes=1,
                 nproc_per_node=2, world_size=2, config_file=str(yaml_path)),
        parse_accelerate_yaml(yaml_path.read_text()), ["train.py"],
        deepspeed_config_file=universal)
    assert plan.argv[-3:] == ("--deepspeed_config_file", universal, "train.py")
    args, defaults, _ = accelerate_args(plan)
    assert defaults.deepspeed_config["deepspeed_config_file"] == "ds_zero3.json"
    assert args.deepspeed_config_file == universal
