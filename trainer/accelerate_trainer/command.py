"""Build the `accelerate launch` command line and its env. Pure: no probes, no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import distributed_type, is_cpu_job
from .contract import ENV_GRADIENT_ACCUMULATION
from .deepspeed_cpu import build_expectation_env
from .topology import Topology

FAST_EXIT_MODULE = "accelerate_trainer.fast_exit"
# Seconds a group may take to form (env ENV_RENDEZVOUS_TIMEOUT on the trainer container).
ENV_RENDEZVOUS_TIMEOUT = "ACCELERATE_TRAINER_RENDEZVOUS_TIMEOUT"
DEFAULT_RENDEZVOUS_TIMEOUT = 600
# What the `accelerate` console script runs.
ACCELERATE_CLI_MODULE = "accelerate.commands.accelerate_cli"


@dataclass(frozen=True)
class LaunchPlan:
    """What to exec: argv and the env variables to add to the pod's own."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


def build_launch_plan(
    topology: Topology,
    config: Mapping[str, Any],
    script: Sequence[str],
    *,
    resume_from: str | None = None,
    fast_exit_python: str | None = None,
    rendezvous_timeout: int = DEFAULT_RENDEZVOUS_TIMEOUT,
    deepspeed_config_file: str | None = None,
) -> LaunchPlan:
    """Every topology flag is passed explicitly: accelerate reads none of MASTER_ADDR, RANK or
    PET_* for itself, and a value on the command line wins over the YAML. `deepspeed_config_file`
    replaces the YAML's DeepSpeed JSON (a copy that loads a universal checkpoint).

    With fast_exit_python (an interpreter that has accelerate and this package), the launcher
    and every rank run under fast_exit, which ends each process as soon as its program has
    returned and its atexit work is done: `PYTHON -m accelerate_trainer.fast_exit -m
    accelerate.commands.accelerate_cli launch ... --module accelerate_trainer.fast_exit SCRIPT`.
    """
    resize_argv, resize_env = _resize_flags(topology, config, deepspeed_config_file)
    argv = [
        *_launcher(fast_exit_python), "launch",
        *_topology_flags(topology, rendezvous_timeout),
        *_config_flags(topology, config),
        *resize_argv,
        *_script_argv(script, fast_exit_python),
    ]
    return LaunchPlan(argv=tuple(argv),
                      env=_launch_env(topology, config, resize_env, resume_from))


def _launcher(fast_exit_python: str | None) -> list[str]:
    """The `accelerate` console script, or the same CLI run under fast_exit."""
    if fast_exit_python:
        return [fast_exit_python, "-m", FAST_EXIT_MODULE, "-m", ACCELERATE_CLI_MODULE]
    return ["accelerate"]


def _topology_flags(topology: Topology, rendezvous_timeout: int) -> list[str]:
    """Where this node stands in the group: accelerate reads none of it from the env."""
    return [
        "--config_file", topology.config_file,
        "--num_machines", str(topology.num_nodes),
        "--num_processes", str(topology.world_size),
        "--machine_rank", str(topology.node_rank),
        "--main_process_ip", topology.master_addr,
        "--main_process_port", str(topology.master_port),
        # A group that has not formed within this ends the launch with a rendezvous error
        # (`timeout`: the static store's wait; `join_timeout`: c10d's).
        "--rdzv_conf", f"timeout={rendezvous_timeout},join_timeout={rendezvous_timeout}",
    ]


def _config_flags(topology: Topology, config: Mapping[str, Any]) -> list[str]:
    """The YAML's values that only take effect on the command line."""
    argv: list[str] = []
    if is_cpu_job(config) and topology.world_size > 1:
        # MULTI_CPU (or --cpu) goes to accelerate's simple launcher: one process, no mpirun. The
        # torchrun path with ACCELERATE_USE_CPU=1 gives real gloo ranks on CPU.
        argv.append("--multi_gpu")
    # accelerate ignores these two in the YAML (their CLI defaults are not None): pass them here.
    if config.get("rdzv_backend"):
        argv += ["--rdzv_backend", str(config["rdzv_backend"])]
    if config.get("same_network"):
        argv.append("--same_network")
    if distributed_type(config) == "DEEPSPEED" and topology.num_nodes > 1:
        argv += ["--deepspeed_multinode_launcher", "standard"]
    return argv


def _script_argv(script: Sequence[str], fast_exit_python: str | None) -> list[str]:
    """What each rank runs: the script (or `-m MODULE`), under fast_exit where asked."""
    if fast_exit_python:
        # The rank runs `python -m accelerate_trainer.fast_exit SCRIPT` (or `... -m MODULE`).
        return ["--module", FAST_EXIT_MODULE, *script]
    if script and script[0] == "-m":
        return ["--module", *script[1:]]
    return list(script)


def _launch_env(topology: Topology, config: Mapping[str, Any], resize_env: Mapping[str, str],
                resume_from: str | None) -> dict[str, str]:
    """The variables every rank reads that accelerate does not set from the command line."""
    env: dict[str, str] = {}
    if is_cpu_job(config):
        # With --multi_gpu (_config_flags), torchrun's ranks train on CPU over gloo.
        env["ACCELERATE_USE_CPU"] = "1"
    env.update(resize_env)
    # Each rank can check that accelerate set up what was launched (deepspeed_cpu.py).
    env.update(build_expectation_env(distributed_type(config), topology.world_size))
    if resume_from:
        env["ACCELERATE_RESUME_FROM"] = resume_from
    return env


def _resize_flags(topology: Topology, config: Mapping[str, Any],
                  deepspeed_config_file: str | None) -> tuple[list[str], dict[str, str]]:
    """What a group at another size than its checkpoint's needs: the gradient accumulation the
    operator asks for, and the DeepSpeed JSON that loads a universal checkpoint."""
    argv: list[str] = []
    env: dict[str, str] = {}
    if topology.gradient_accumulation is not None:
        # Every rank's Accelerator takes it over the script's value. accelerate's DeepSpeed
        # launcher would set the variable again from the YAML's deepspeed_config, where the
        # command line wins.
        env[ENV_GRADIENT_ACCUMULATION] = str(topology.gradient_accumulation)
        if distributed_type(config) == "DEEPSPEED":
            argv += ["--gradient_accumulation_steps", str(topology.gradient_accumulation)]
    if deepspeed_config_file:
        # deepspeed_universal.py's copy of the JSON: the command line wins over the YAML's.
        argv += ["--deepspeed_config_file", deepspeed_config_file]
    return argv, env

