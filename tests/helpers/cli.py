"""Run the `accelerate-job` CLI of this virtualenv as a user would, against a test cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def cli(*args: str, kubeconfig: str, namespace: str, timeout: float = 120,
        check: bool = True, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """`accelerate-job COMMAND --kubeconfig K -n NS ARGS...`: the cluster options go right after
    the command, because submit's own end at the script. Fails, with its stderr, on a non-zero
    exit when `check`."""
    command = [str(Path(sys.executable).parent / "accelerate-job"), args[0],
               "--kubeconfig", kubeconfig, "-n", namespace, *args[1:]]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if check:
        assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr}"
    return proc
