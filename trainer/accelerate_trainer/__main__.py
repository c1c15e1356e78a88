"""`accelerate-trainer SCRIPT [ARGS...]`: the container entrypoint of every AccelerateJob pod.

Logs the library versions it runs with (pod 0's supervisor reports them to the operator, for
status.trainer), reads the mounted accelerate YAML and the topology env,
validates them, unpacks the shipped code into the workspace and installs its requirements (when
the job ships code), waits for the master, then replaces itself with `accelerate launch` so
signals reach the training processes and their exit code is the pod's; as its container's PID 1
it is replaced with the supervisor that runs the launcher instead (supervise.wanted says why).
The script runs as `accelerate launch` runs it; ACCELERATE_TRAINER_FAST_EXIT=1 opts into ending
the launcher and the ranks without the interpreter's teardown (fast_exit.py). A config error
(or shipped code that cannot be used) exits 78 (permanent), a failed requirements install 75, each
with the reason in the termination log, where the operator shows it on the job.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from . import deepspeed_cpu, supervise
from .checkpoints import find_resume_checkpoint
from .command import LaunchPlan, build_launch_plan
from .config import (
    DEVICE_MODULES,
    OTHER_ACCELERATORS,
    ConfigError,
    check_against_accelerate_schema,
    check_job_fits,
    deepspeed_file,
    distributed_type,
    is_cpu_job,
    parse_accelerate_yaml,
    resolve_config_path,
)
from .contract import (
    CONFIG_ERROR_EXIT_CODE,
    ENV_CHECKPOINT_DIR,
    ENV_CONFIG_FILE,
    ENV_GRADIENT_ACCUMULATION,
    REQUIREMENTS_EXIT_CODE,
)
from .deepspeed_checks import check_accumulation_from_env, parse_deepspeed_json
from .deepspeed_universal import prepare_universal_resume
from .error_files import launch_env as hook_env
from .fast_exit import ENV_FAST_EXIT
from .ignored import check_in_pod, probe_hardware
from .rendezvous import MasterUnreachable, rendezvous_timeout, wait_for_master
from .schema import load as load_schema
from .termination import write_termination_message
from .topology import Topology, TopologyError, parse_topology
from .versions import describe, read_versions
from .workspace import (
    CodeError,
    RequirementsError,
    install_requirements,
    parse_shipped_code,
    unpack_code,
    workspace_env,
)

log = logging.getLogger("accelerate_trainer")

USAGE = ("usage: accelerate-trainer [--] SCRIPT [ARGS...]   or   "
         "accelerate-trainer -m MODULE [ARGS...]")


def read_config(topology: Topology) -> dict:
    path = Path(topology.config_file)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(
            f"cannot read the accelerate config {path} ({error.strerror}); the operator mounts it "
            f"from the ConfigMap <job>-accelerate-config, or set {ENV_CONFIG_FILE}"
        ) from None
    return parse_accelerate_yaml(text, source=str(path))


def read_deepspeed_json(config: Mapping, config_file: str) -> tuple[dict | None, str]:
    """The DeepSpeed JSON a DEEPSPEED config names, parsed, and where it was read; a relative
    path is read from the config's own folder (the operator mounts shipped files there)."""
    named = deepspeed_file(config)
    if named is None:
        return None, "the DeepSpeed config"
    path = Path(resolve_config_path(named, str(Path(config_file).parent)))
    source = f"deepspeed_config.deepspeed_config_file {named!r} ({path})"
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(
            f"{source} cannot be read ({error.strerror}); every rank would crash reading it. "
            "Ship it beside the accelerate YAML (a key of the same ConfigMap, or "
            "spec.accelerateConfigFiles), or point it into one of the pod's volumes"
        ) from None
    return parse_deepspeed_json(text, source), source


def validate(topology: Topology, config: Mapping, *, visible_gpus: int | None,
             deepspeed_json: Mapping | None = None,
             deepspeed_source: str = "the DeepSpeed config",
             deepspeed_on_cpu: bool = False) -> None:
    """`deepspeed_on_cpu`: the container opted into DeepSpeed without GPUs (deepspeed_cpu.py)."""
    schema = load_schema()  # the image's snapshot: no accelerate (and torch) import here
    check_against_accelerate_schema(config, schema)
    check_job_fits(config, num_nodes=topology.num_nodes, num_processes=topology.world_size,
                   master_port=topology.master_port, deepspeed_json=deepspeed_json,
                   deepspeed_source=deepspeed_source, fsdp_names=schema.fsdp)
    dtype = distributed_type(config)
    if topology.gradient_accumulation is not None and dtype == "DEEPSPEED":
        check_accumulation_from_env(deepspeed_json, topology.gradient_accumulation,
                                    ENV_GRADIENT_ACCUMULATION, deepspeed_source)
    if str(config.get("mixed_precision")).lower() == "fp8" and (
            is_cpu_job(config) or visible_gpus == 0):
        raise ConfigError(
            "mixed_precision fp8 needs GPUs with FP8 support (Hopper or newer, with "
            "TransformerEngine, MS-AMP or torchao) but this pod has none; use bf16 or request "
            "nvidia.com/gpu"
        )
    if visible_gpus is not None and not is_cpu_job(config) and dtype != "NO":
        if visible_gpus == 0 and dtype == "DEEPSPEED":
            if not deepspeed_on_cpu:
                raise ConfigError(deepspeed_cpu.refusal_message())
            return  # the opted-in CPU rehearsal: one process per --num_processes, over gloo
        needs = OTHER_ACCELERATORS.get(dtype, "GPUs")
        resource = "nvidia.com/gpu" if needs == "GPUs" else f"the {needs} of its device plugin"
        if visible_gpus == 0:
            raise ConfigError(
                f"distributed_type {dtype} needs {needs} but this pod sees none, so every "
                f"process would train alone; request {resource}, or set use_cpu: true "
                "(MULTI_CPU) for CPU training"
            )
        if visible_gpus < topology.nproc_per_node:
            raise ConfigError(
                f"NPROC_PER_NODE={topology.nproc_per_node} processes but only {visible_gpus} "
                f"of the {needs} visible; lower spec.numProcPerNode or use \"auto\" (with "
                f"{resource})"
            )


def count_visible_gpus(dtype: str = "MULTI_GPU") -> int | None:
    """The devices `dtype` trains on that this pod's torch sees, counted as `accelerate launch`
    counts them: CUDA's, or the vendor backend's (torch.xpu, torch.npu...) once accelerate's own
    check has imported its plugin (torch_npu, Habana's...); none without that plugin. None when
    it cannot tell here: no torch or accelerate, XLA's TPUs."""
    try:
        import torch
    except ImportError:
        return None
    if dtype == "XLA":
        return None
    backend = DEVICE_MODULES.get(dtype)
    if backend is None:
        return torch.cuda.device_count()
    try:
        from accelerate import utils
    except ImportError:
        return None
    available = getattr(utils, f"is_{backend}_available", None)
    if available is None:
        return None
    return getattr(torch, backend).device_count() if available() else 0


def log_versions(versions: dict[str, str], source: str) -> None:
    log.info("versions (%s): %s", source, describe(versions))


def prepare_workspace(environ: Mapping[str, str], versions: dict[str, str]) -> dict[str, str]:
    """Unpack the shipped code (if any) into the workspace, make it the working directory and
    install its requirements; returns the env the launch needs. Raises CodeError or
    RequirementsError."""
    code = parse_shipped_code(environ)
    if code is None:
        return {}
    files = unpack_code(code)
    log.info("unpacked the shipped code into %s: %d file(s)", code.workspace, len(files))
    os.chdir(code.workspace)
    packages = install_requirements(code, environ) if code.requirements else []
    if packages:
        installed = read_versions([*packages, *sys.path])
        if installed != versions:
            log_versions(installed, "image+requirements")
    return workspace_env(code, packages, environ)


def fast_exit_python(environ: Mapping[str, str]) -> str | None:
    """The interpreter that runs the launcher and the ranks under fast_exit (this one) when the
    container opts in with ACCELERATE_TRAINER_FAST_EXIT=1 and accelerate is installed beside
    this package; otherwise None: a plain `accelerate launch` from PATH."""
    if environ.get(ENV_FAST_EXIT, "").strip().lower() not in ("1", "true", "yes", "on"):
        return None
    if importlib.util.find_spec("accelerate") is None:
        return None
    return sys.executable


def resume_point(topology: Topology, config: Mapping, environ: Mapping[str, str],
                 deepspeed_json: Mapping | None) -> tuple[Path | None, str | None]:
    """The newest complete checkpoint, and the DeepSpeed JSON to load it with where it must load
    as a universal checkpoint (`deepspeed_resume`; None: the configured one)."""
    checkpoint_dir = environ.get(ENV_CHECKPOINT_DIR)
    resume_from = find_resume_checkpoint(checkpoint_dir) if checkpoint_dir else None
    if resume_from:
        log.info("resuming from %s", resume_from)
    return resume_from, deepspeed_resume(topology, config, resume_from, deepspeed_json,
                                         checkpoint_dir)


def log_launch(topology: Topology, plan: LaunchPlan) -> None:
    accumulation = topology.gradient_accumulation
    log.info(
        "node %d/%d, %d process(es) per node, world size %d%s: %s",
        topology.node_rank, topology.num_nodes, topology.nproc_per_node, topology.world_size,
        "" if accumulation is None else
        f", gradient accumulation {accumulation} ({ENV_GRADIENT_ACCUMULATION})",
        " ".join(plan.argv),
    )


class ConversionFailed(Exception):
    """DeepSpeed's converter failed on the checkpoint to resume from: the pod fails, naming it."""


def deepspeed_resume(topology: Topology, config: Mapping, resume_from: Path | None,
                     deepspeed_json: Mapping | None, checkpoint_dir: str | None) -> str | None:
    """The DeepSpeed JSON to launch with when the checkpoint was written by another number of
    ranks (an elastic job that changed size): pod 0 converts it to DeepSpeed's universal form
    first (deepspeed_universal.py). None: the launch as configured."""
    if resume_from is None or distributed_type(config) != "DEEPSPEED":
        return None
    started = time.monotonic()
    try:
        path = prepare_universal_resume(resume_from, dp_size=topology.world_size,
                                        node_rank=topology.node_rank, ds_json=deepspeed_json,
                                        workdir=checkpoint_dir or resume_from.parent)
    except subprocess.CalledProcessError as error:
        raise ConversionFailed(
            f"DeepSpeed's converter could not make {resume_from} a universal checkpoint "
            f"(exit {error.returncode}; its output is above)") from error
    if path is not None:
        log.info("%s loads as a DeepSpeed universal checkpoint at world size %d (%s, %.1fs)",
                 resume_from, topology.world_size, path, time.monotonic() - started)
    return str(path) if path else None


def fail(message: str, exit_code: int) -> int:
    log.error("%s", message)
    write_termination_message(message)
    return exit_code


def stop_at_once_until_launch() -> None:
    """Until the launch, a stop (a drain, the operator stopping the group) ends the pod at once,
    exit 128 + the signal: nothing has trained, so there is nothing to save. This process is its
    container's PID 1, for which the kernel drops a signal it has no handler for: waiting for
    the master's name (as long as the master is not placed) it held its pod for the whole grace
    period, 120 s. The launcher exec'd in its place starts with the default actions."""
    def stop(number: int, _frame: object) -> None:
        os.write(2, f"accelerate-trainer: {signal.Signals(number).name} before the launch: "
                    "stopped\n".encode())
        os._exit(128 + number)

    for number in supervise.STOP_SIGNALS:
        signal.signal(number, stop)


def run() -> int:
    """The console script: the container's entrypoint."""
    stop_at_once_until_launch()
    return main()


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="accelerate-trainer: %(message)s")
    script = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    if script[:1] == ["--"]:
        script = script[1:]
    if not script or script[0] in ("-h", "--help"):
        log.error(USAGE)
        return 2
    versions = read_versions()
    log_versions(versions, "image")
    try:
        topology, config, deepspeed_json = checked_config(environ)
        timeout = rendezvous_timeout(environ)
    except (TopologyError, ConfigError) as error:
        return fail(f"invalid configuration: {error}", CONFIG_ERROR_EXIT_CODE)
    try:
        launch_env = prepare_workspace(environ, versions)
    except CodeError as error:
        return fail(f"shipped code: {error}", CONFIG_ERROR_EXIT_CODE)
    except RequirementsError as error:
        return fail(f"requirements: {error}", REQUIREMENTS_EXIT_CODE)
    return resume_and_launch(topology, config, script, environ, deepspeed_json=deepspeed_json,
                             launch_env=launch_env, timeout=timeout)


def checked_config(environ: Mapping[str, str]) -> tuple[Topology, dict, dict | None]:
    """The topology, the accelerate config and its DeepSpeed JSON, checked before anything is
    unpacked or installed, so a mistake fails the pod at once. Raises TopologyError or
    ConfigError."""
    topology = parse_topology(environ)
    config = read_config(topology)
    deepspeed_json, deepspeed_source = read_deepspeed_json(config, topology.config_file)
    # Importing torch only to count GPUs costs seconds on every CPU job's start.
    gpus = None if is_cpu_job(config) else count_visible_gpus(distributed_type(config))
    validate(topology, config, visible_gpus=gpus, deepspeed_json=deepspeed_json,
             deepspeed_source=deepspeed_source,
             deepspeed_on_cpu=deepspeed_cpu.deepspeed_on_cpu_requested(environ))
    # Values accelerate would drop on this pod's real hardware: refused, or said here.
    for warning in check_in_pod(config, nproc_per_node=topology.nproc_per_node,
                                hardware=probe_hardware(config, gpus=gpus)):
        log.warning("WARNING: accelerate config: %s", warning)
    return topology, config, deepspeed_json


def resume_and_launch(topology: Topology, config: Mapping, script: Sequence[str],
                      environ: Mapping[str, str], *, deepspeed_json: Mapping | None,
                      launch_env: Mapping[str, str], timeout: int) -> int:
    """Find the checkpoint to resume from, wait for the master, then exec the launcher; the
    exit code where any of it fails (the launcher's own replaces this process)."""
    try:
        resume_from, universal_json = resume_point(topology, config, environ, deepspeed_json)
    except ConfigError as error:
        return fail(f"invalid configuration: {error}", CONFIG_ERROR_EXIT_CODE)
    except ConversionFailed as error:
        return fail(str(error), 1)

    try:
        wait_for_master(topology, timeout=timeout)
    except MasterUnreachable as error:
        return fail(str(error), 1)

    plan = build_launch_plan(
        topology, config, script, resume_from=str(resume_from) if resume_from else None,
        fast_exit_python=fast_exit_python(environ), rendezvous_timeout=timeout,
        deepspeed_config_file=universal_json,
    )
    log_launch(topology, plan)
    env = {**environ, **plan.env, **launch_env}
    env.update(hook_env(env))  # each process explains its own failure (error_files.py)
    return launch(plan.argv, env, topology.node_rank)


def launch(argv: list[str], env: dict[str, str], node_rank: int) -> int:
    """Replace this process with the launcher; where the pod reports or this process is PID 1
    (supervise.wanted), with the supervisor that runs it (supervise.py).
    transformers.Trainer scripts report with no code change: the operator points their
    KubeflowCallback at the same endpoint."""
    supervised = supervise.wanted(env, node_rank, os.getpid())
    if supervised:
        argv = supervise.command(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        with hold_stops_across_exec(supervised):
            os.execvpe(argv[0], argv, env)
    except OSError as error:
        return fail(f"cannot run {argv[0]!r} ({error.strerror}); is accelerate installed "
                    "and on PATH?", 127)
    return 0  # not reached: exec replaced this process


@contextlib.contextmanager
def hold_stops_across_exec(supervised: bool) -> Iterator[None]:
    """Block the stop signals over the exec of the supervisor, which unblocks them once its
    handlers are in: the signal mask survives an exec, handlers do not, and a SIGTERM sent
    between the two would be dropped by a PID 1 with none. Unblocked again if the exec fails.
    A launcher exec'd in this process's place starts with the default actions instead."""
    if not supervised:
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, supervise.STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, supervise.STOP_SIGNALS)


if __name__ == "__main__":
    sys.exit(run())
