"""The trainer's entrypoint is its container's first process, PID 1, and the kernel drops any
signal PID 1 has no handler for: a worker waiting for its master's name (a master never placed:
an elastic group that shrinks, a drained node) held its pod for the whole grace period, 120 s.
Run for real, it now handles SIGTERM before the launch and ends at once, exit 143, as a pod
stopped before its launch must: nothing has trained. (A process with no handler would die of
the signal here instead, returncode -15; as PID 1 it would ignore it.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

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
