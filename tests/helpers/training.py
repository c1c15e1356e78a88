"""Helpers for tests that train for real: run `accelerate-trainer` processes playing the machines
of one job on this host, and parse the log lines that examples/train.py promises.

The trainer is run exactly as in a pod (its env, its `exec` of `accelerate launch`), only with
MASTER_ADDR=127.0.0.1. Every process is started in its own session so that a timeout can stop the
whole tree it spawned (torchrun and the training processes) by that one process group id.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = ROOT / "examples" / "train.py"
# Where the trainer image keeps it; jobs on the cluster name it by this path.
IMAGE_TRAIN_SCRIPT = Path("/opt/accelerate/examples/train.py")


def free_port() -> int:
    """A TCP port nobody listens on right now (static rendezvous binds it on machine 0)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_cpu_accelerate_config(
    path: Path, *, num_machines: int, num_processes: int, main_process_port: int
) -> Path:
    """A MULTI_CPU config as `accelerate config` writes it, with the job's topology keys."""
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "MULTI_CPU",
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "machine_rank": 0,
        "main_process_port": main_process_port,
        "main_training_function": "main",
        "mixed_precision": "no",
        "num_machines": num_machines,
        "num_processes": num_processes,
        "rdzv_backend": "static",
        "same_network": True,
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": True,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=True))
    return path


def machine_env(
    *,
    node_rank: int,
    num_nodes: int,
    nproc_per_node: int,
    master_port: int,
    config_file: Path,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The env the operator gives the pod of machine `node_rank`, plus what a test host needs."""
    env = dict(os.environ)
    for name in ("ACCELERATE_RESUME_FROM", "ACCELERATE_CHECKPOINT_DIR", "ACCELERATE_USE_CPU",
                 "ACCELERATE_FAIL_ONCE_MARKER", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    env.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
            "NODE_RANK": str(node_rank),
            "NUM_NODES": str(num_nodes),
            "NPROC_PER_NODE": str(nproc_per_node),
            "WORLD_SIZE": str(num_nodes * nproc_per_node),
            "ACCELERATE_CONFIG_FILE": str(config_file),
            # The trainer execs `accelerate` from PATH, as in the image: use this venv's.
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # Two cores are shared by every process of the job: no thread oversubscription.
            "OMP_NUM_THREADS": "1",
            "ACCELERATE_TRAINER_RENDEZVOUS_TIMEOUT": "120",
            # The checkout's trainer, not the venv's installed copy (which may lag behind it):
            # the trainer and the script's imports of accelerate_trainer both read this.
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(ROOT / "trainer"), env.get("PYTHONPATH")])),
        }
    )
    env.update(extra or {})
    return env


@dataclass
class MachineRun:
    """One `accelerate-trainer` process (one machine of the job) and its combined output."""

    node_rank: int
    returncode: int | None
    output: str
    seconds: float

    def tail(self, lines: int = 60) -> str:
        return f"--- machine {self.node_rank} (exit {self.returncode}) ---\n" + "\n".join(
            self.output.splitlines()[-lines:]
        )


def run_machines(
    envs: Sequence[Mapping[str, str]],
    script_args: Sequence[str],
    *,
    log_dir: Path,
    timeout: float,
    cwd: Path = ROOT,
) -> list[MachineRun]:
    """Start one `accelerate-trainer` per env at once and wait for all of them. On timeout every
    process tree is killed and the runs come back with returncode None."""
    trainer = Path(sys.executable).parent / "accelerate-trainer"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    procs = []
    for env in envs:
        node_rank = int(env["NODE_RANK"])
        log_path = log_dir / f"machine-{node_rank}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [str(trainer), str(TRAIN_SCRIPT), *script_args],
                env=dict(env),
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        procs.append((node_rank, proc, log_path))

    runs = []
    for node_rank, proc, log_path in procs:
        remaining = max(0.0, timeout - (time.monotonic() - started))
        try:
            returncode: int | None = proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            returncode = None
        runs.append([node_rank, proc, log_path, returncode, time.monotonic() - started])
    for _, proc, _, returncode, _ in runs:
        if returncode is None:
            _kill_tree(proc)
    return [
        MachineRun(node_rank, returncode, log_path.read_text(errors="replace"), seconds)
        for node_rank, _, log_path, returncode, seconds in runs
    ]


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill the session this test started (the trainer, torchrun, the training processes)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ---- the log contract of examples/train.py -------------------------------------------------

_RANK_INFO = re.compile(
    r"^RANK_INFO rank=(\d+) local_rank=(\d+) world_size=(\d+) node_rank=(\d+)$", re.M
)
_STEP = re.compile(r"^STEP step=(\d+) loss=(\S+) epoch=(\d+)$", re.M)
_FINAL = re.compile(r"^FINAL rank=(\d+) param_checksum=(\S+) steps=(\d+)$", re.M)
_DONE = re.compile(r"^TRAINING_DONE steps=(\d+) first_loss=(\S+) last_loss=(\S+)$", re.M)
_RESUMED = re.compile(r"^RESUMED from=(\S+) step=(\d+)$", re.M)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    node_rank: int


@dataclass(frozen=True)
class Step:
    step: int
    loss: float
    epoch: int


@dataclass(frozen=True)
class Final:
    rank: int
    param_checksum: str  # compared as printed (8 decimals): identical weights print identically
    steps: int


@dataclass(frozen=True)
class Done:
    steps: int
    first_loss: float
    last_loss: float


@dataclass(frozen=True)
class Resumed:
    path: str
    step: int


@dataclass(frozen=True)
class TrainingLog:
    rank_infos: tuple[RankInfo, ...] = ()
    steps: tuple[Step, ...] = ()
    finals: tuple[Final, ...] = ()
    done: tuple[Done, ...] = ()
    resumed: tuple[Resumed, ...] = field(default=())

    def __add__(self, other: TrainingLog) -> TrainingLog:
        return TrainingLog(
            self.rank_infos + other.rank_infos,
            self.steps + other.steps,
            self.finals + other.finals,
            self.done + other.done,
            self.resumed + other.resumed,
        )


def parse_training_log(text: str) -> TrainingLog:
    """Every contract line in `text`, in order of appearance."""
    return TrainingLog(
        rank_infos=tuple(RankInfo(*map(int, m.groups())) for m in _RANK_INFO.finditer(text)),
        steps=tuple(
            Step(int(m[1]), float(m[2]), int(m[3])) for m in _STEP.finditer(text)
        ),
        finals=tuple(Final(int(m[1]), m[2], int(m[3])) for m in _FINAL.finditer(text)),
        done=tuple(Done(int(m[1]), float(m[2]), float(m[3])) for m in _DONE.finditer(text)),
        resumed=tuple(Resumed(m[1], int(m[2])) for m in _RESUMED.finditer(text)),
    )
