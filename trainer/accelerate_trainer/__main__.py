"""`accelerate-trainer SCRIPT [ARGS...]`: the container entrypoint of every AccelerateJob pod.

Reads the mounted accelerate YAML and the topology env, validates them, waits for the master,
then replaces itself with `accelerate launch` so signals reach the training processes and their
exit code is the pod's. A config error exits 78 (permanent) with the reason in the termination
log, where the operator shows it on the job.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from .checkpoints import find_resume_checkpoint
from .command import build_launch_plan
from .config import (
    ConfigError,
    check_against_accelerate_schema,
    check_job_fits,
    distributed_type,
    is_cpu_job,
    parse_accelerate_yaml,
)
from .contract import CONFIG_ERROR_EXIT_CODE, ENV_CHECKPOINT_DIR, ENV_CONFIG_FILE
from .rendezvous import MasterUnreachable, wait_for_master
from .topology import Topology, TopologyError, parse_topology

log = logging.getLogger("accelerate_trainer")

TERMINATION_LOG = Path("/dev/termination-log")
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


def validate(topology: Topology, config: Mapping, *, visible_gpus: int | None) -> None:
    check_against_accelerate_schema(config)
    check_job_fits(config, num_nodes=topology.num_nodes, num_processes=topology.world_size,
                   master_port=topology.master_port)
    dtype = distributed_type(config)
    if visible_gpus is not None and not is_cpu_job(config) and dtype != "NO":
        if visible_gpus == 0:
            raise ConfigError(
                f"distributed_type {dtype} needs GPUs but this pod sees none, so every process "
                "would train alone; request nvidia.com/gpu, or set use_cpu: true for CPU training"
            )
        if visible_gpus < topology.nproc_per_node:
            raise ConfigError(
                f"NPROC_PER_NODE={topology.nproc_per_node} processes but only {visible_gpus} "
                "GPU(s) visible; lower spec.numProcPerNode or use \"auto\""
            )


def count_visible_gpus() -> int | None:
    """GPUs torch can see, or None when torch is not importable here."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.device_count()


def write_termination_message(message: str) -> None:
    """Kubernetes copies this file into the container's terminated state, where the operator
    reads it to explain a failure on the job."""
    try:
        TERMINATION_LOG.write_text(message[:4000])
    except OSError:
        pass


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="accelerate-trainer: %(message)s")
    script = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    if script[:1] == ["--"]:
        script = script[1:]
    if not script or script[0] in ("-h", "--help"):
        log.error(USAGE)
        return 2
    try:
        topology = parse_topology(environ)
        config = read_config(topology)
        # Importing torch only to count GPUs costs seconds on every CPU job's start.
        gpus = None if is_cpu_job(config) else count_visible_gpus()
        validate(topology, config, visible_gpus=gpus)
    except (TopologyError, ConfigError) as error:
        log.error("invalid configuration: %s", error)
        write_termination_message(f"invalid configuration: {error}")
        return CONFIG_ERROR_EXIT_CODE

    checkpoint_dir = environ.get(ENV_CHECKPOINT_DIR)
    resume_from = find_resume_checkpoint(checkpoint_dir) if checkpoint_dir else None
    if resume_from:
        log.info("resuming from %s", resume_from)

    timeout = float(environ.get("ACCELERATE_TRAINER_RENDEZVOUS_TIMEOUT", "600"))
    try:
        wait_for_master(topology, timeout=timeout)
    except MasterUnreachable as error:
        log.error("%s", error)
        write_termination_message(str(error))
        return 1

    plan = build_launch_plan(
        topology, config, script, resume_from=str(resume_from) if resume_from else None
    )
    log.info(
        "node %d/%d, %d process(es) per node, world size %d: %s",
        topology.node_rank, topology.num_nodes, topology.nproc_per_node, topology.world_size,
        " ".join(plan.argv),
    )
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(plan.argv[0], plan.argv, {**environ, **plan.env})
    except OSError as error:
        message = (f"cannot run {plan.argv[0]!r} ({error.strerror}); is accelerate installed "
                   "and on PATH?")
        log.error("%s", message)
        write_termination_message(message)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
