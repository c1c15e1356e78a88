"""The trainer's entrypoint is its container's first process, PID 1, and the kernel drops any
signal PID 1 has no handler for: a worker waiting for its master's name (a master never placed:
an elastic group that shrinks, a drained node) held its pod for the whole grace period, 120 s.
Run for real, it now handles SIGTERM before the launch and ends at once, exit 143, as a pod
stopped before its launch must: nothing has trained. (A process with no handler would die of
the signal here instead, returncode -15; as PID 1 it would ignore it.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from accelerate_trainer import supervise

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
mixed_precision: 'no'
num_machines: 2
num_processes: 2
use_cpu: true
"""


def waiting_worker(tmp_path: Path) -> subprocess.Popen:
    """Node 1 of 2, whose master's name never resolves (.invalid, RFC 6761)."""
    (tmp_path / "config.yaml").write_text(CONFIG)
    (tmp_path / "train.py").write_text("print('trained')\n")
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "trainer"), os.environ.get("PYTHONPATH", "")]),
           "MASTER_ADDR": "master.invalid", "MASTER_PORT": "29500", "NODE_RANK": "1",
           "NUM_NODES": "2", "NPROC_PER_NODE": "1", "WORLD_SIZE": "2",
           "ACCELERATE_CONFIG_FILE": str(tmp_path / "config.yaml")}
    return subprocess.Popen([sys.executable, "-m", "accelerate_trainer", "--", "train.py"],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)


def test_a_worker_waiting_for_its_master_stops_at_once_on_sigterm(tmp_path):
    trainer = waiting_worker(tmp_path)
    try:
        seen = []
        for line in trainer.stderr:  # the trainer says what it waits for, then keeps waiting
            seen.append(line)
            if "waiting for master.invalid" in line:
                break
        assert trainer.poll() is None, "".join(seen)
        trainer.send_signal(signal.SIGTERM)
        code = trainer.wait(timeout=30)  # it would wait for the master for 10 minutes
    finally:
        trainer.kill()
    rest = trainer.stderr.read()
    assert code == 128 + signal.SIGTERM, "".join(seen) + rest
    assert "SIGTERM before the launch: stopped" in rest, rest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def as_pid_1(tmp_path: Path) -> subprocess.Popen:
    """Node 1 of 2 as its container's first process (a PID namespace of its own), whose master
    is reachable by name but runs nothing: the launcher waits in the rendezvous."""
    if subprocess.run(["unshare", "-fp", "--mount-proc", "true"],
                      capture_output=True).returncode != 0:
        pytest.skip("needs root for a PID namespace (unshare -fp), as CI runs the unit tests")
    (tmp_path / "config.yaml").write_text(CONFIG)
    (tmp_path / "train.py").write_text("print('trained')\n")
    venv = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": os.pathsep.join([venv, os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "trainer"), os.environ.get("PYTHONPATH", "")]),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "1",
           "NUM_NODES": "2", "NPROC_PER_NODE": "1", "WORLD_SIZE": "2",
           "ACCELERATE_TRAINER_RENDEZVOUS_TIMEOUT": "120",
           "ACCELERATE_CONFIG_FILE": str(tmp_path / "config.yaml")}
    return subprocess.Popen(["unshare", "-fp", "--mount-proc", sys.executable, "-m",
                             "accelerate_trainer", "--", "train.py"],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)


def pid_1_of(unshare: subprocess.Popen) -> int:
    """The namespace's first process, as this namespace numbers it: unshare's one child."""
    children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children")
    for _ in range(100):
        found = children.read_text().split()
        if found:
            return int(found[0])
        time.sleep(0.05)
    raise AssertionError("unshare started no process")


@pytest.mark.parametrize("wait_s", [0.0, 8.0])  # while accelerate and torch import; in rendezvous
def test_a_pid_1_trainer_stopped_after_the_launch_began_ends_at_once(tmp_path, wait_s):
    trainer = as_pid_1(tmp_path)
    try:
        seen = []
        for line in trainer.stderr:  # the trainer logs the launch command as it starts it
            seen.append(line)
            if "node 1/2" in line:
                break
        time.sleep(wait_s)
        assert trainer.poll() is None, "".join(seen)
        os.kill(pid_1_of(trainer), signal.SIGTERM)
        code = trainer.wait(timeout=30)  # as PID 1 the launcher ignored it for 120 s
    finally:
        trainer.kill()
    assert code == 128 + signal.SIGTERM, "".join(seen) + trainer.stderr.read()


def test_a_trainer_that_is_pid_1_always_runs_the_launcher_under_the_supervisor():
    assert supervise.wanted({}, node_rank=1, pid=1)
    assert not supervise.wanted({}, node_rank=1, pid=4242)  # run by hand: exec, as before
