"""The container's entrypoint, run for real (`python -m accelerate_trainer -- script.py`, which
execs `accelerate launch`): by default the script ends through the interpreter's own exit, so an
object a library keeps until then is finalized, as on a laptop. The opt-in
ACCELERATE_TRAINER_FAST_EXIT=1 skips that teardown (config-mapping.md says so)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
mixed_precision: 'no'
num_machines: 1
num_processes: 1
use_cpu: true
"""
# An object held by a module until the interpreter's teardown, which finalizes it there: what a
# library that flushes or uploads in a finalizer relies on.
SCRIPT = """\
import json
import os
import sys


class Flush:
    def __init__(self, path, write=open):
        self.path, self.write = path, write

    def __del__(self):
        with self.write(self.path, "w") as mark:
            mark.write("finalized")


json._kept = Flush(os.environ["FINALIZED_MARK"])
print("trained", sys.argv[1:])
"""


def run_trainer(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "config.yaml").write_text(CONFIG)
    (tmp_path / "train.py").write_text(SCRIPT)
    inherited = {k: v for k, v in os.environ.items() if k != "ACCELERATE_TRAINER_FAST_EXIT"}
    env = {**inherited,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "trainer"), os.environ.get("PYTHONPATH", "")]),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "0",
           "NUM_NODES": "1", "NPROC_PER_NODE": "1", "WORLD_SIZE": "1",
           "ACCELERATE_CONFIG_FILE": str(tmp_path / "config.yaml"),
           "FINALIZED_MARK": str(tmp_path / "finalized"), **extra}
    return subprocess.run([sys.executable, "-m", "accelerate_trainer", "--", "train.py", "--x"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.mark.parametrize(("extra", "finalized"), [
    ({}, True),
    ({"ACCELERATE_TRAINER_FAST_EXIT": "1"}, False),
], ids=["default: plain accelerate launch", "opt-in: fast_exit"])
def test_the_script_ends_through_the_interpreters_own_exit_unless_opted_in(
        tmp_path, extra, finalized):
    result = run_trainer(tmp_path, **extra)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "trained ['--x']" in result.stdout  # the script ran, with its arguments
    assert (tmp_path / "finalized").exists() is finalized
