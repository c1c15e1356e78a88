"""End to end: the CLI's kubectl habits against the local cluster, run as a user runs them, once
as `accelerate-job` and once as `kubectl accelerate` (kubectl finds the plugin
`kubectl-accelerate` on PATH): `-n NS get` (flags before the command), `get -o jsonpath`,
`wait --for=condition=Succeeded --timeout=10m a b`, `describe`, `logs -p`, `delete -l`, and
`wait --for=delete`.

The pods run a Python snippet, not training: job `flaky` fails its first attempt (a container
that is not accelerate-trainer cannot restart in place, so the operator archives its log and
restarts the group) and succeeds on the second; job `steady` succeeds at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.cluster import kubectl_binary
from tests.helpers.jobs import apply_job, command_job

pytestmark = [pytest.mark.timeout(600)]

VENV_BIN = Path(sys.executable).parent
FLAKY = ("import os, sys; attempt = os.environ['ACCELERATE_JOB_ATTEMPT']; "
         "print(f'flaky attempt={attempt}', flush=True); sys.exit(3 if attempt == '0' else 0)")
STEADY = "print('steady done', flush=True)"
FRONT_ENDS = {"accelerate-job": [str(VENV_BIN / "accelerate-job")],
              "kubectl accelerate": [kubectl_binary(), "accelerate"]}


def runner(front_end: str, kubeconfig: str):
    """Run the CLI through `front_end` with the venv's bin first on PATH (krew's convention:
    kubectl runs the `kubectl-accelerate` it finds there) and KUBECONFIG set."""
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "KUBECONFIG": kubeconfig}

    def run(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run([*FRONT_ENDS[front_end], *args], capture_output=True, text=True,
                              env=env, timeout=timeout)
        if check:
            assert proc.returncode == 0, (f"{front_end} {' '.join(args)} exited "
                                          f"{proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc
    return run


@pytest.mark.parametrize("front_end", list(FRONT_ENDS))
def test_kubectl_habits_on_the_cluster(kubeconfig, namespace, front_end):
    run = runner(front_end, kubeconfig)
    for name, script in (("flaky", FLAKY), ("steady", STEADY)):
        apply_job(kubeconfig, namespace,
                  command_job(name, script, nodes=1).labels(suite="cli").for_server().build())

    table = run("-n", namespace, "get").stdout.splitlines()
    assert table[0].split()[:2] == ["NAME", "PHASE"]
    assert [line.split()[0] for line in table[1:]] == ["flaky", "steady"]

    waited = run("-n", namespace, "wait", "--for=condition=Succeeded", "--timeout=10m",
                 "flaky", "steady", timeout=630).stdout
    assert waited == ("acceleratejob/flaky condition met: Succeeded (Succeeded)\n"
                      "acceleratejob/steady condition met: Succeeded (Succeeded)\n")
    assert run("get", "flaky", "-n", namespace, "-o",
               "jsonpath={.status.phase} {.status.restarts}").stdout == "Succeeded 1"

    story = run("describe", "flaky", "-n", namespace).stdout
    assert "Phase:        Succeeded" in story
    for section in ("Conditions:", "Last failure:", "Pods:", "Events:"):
        assert section in story.splitlines()
    conditions = story.split("Conditions:")[1].split("Last failure:")[0]
    assert any(line.split()[:2] == ["Succeeded", "True"] for line in conditions.splitlines())
    events = story.split("Events:")[1]
    assert "Warning" in events and "Normal" in events

    assert "flaky attempt=0" in run("-n", namespace, "logs", "flaky", "-p").stdout
    now = run("-n", namespace, "logs", "flaky")
    assert "flaky attempt=1" in now.stdout and "attempt=0" not in now.stdout
    assert "-p (the last)" in now.stderr
    missing = run("-n", namespace, "logs", "steady", "-p", check=False)
    assert missing.returncode == 1 and "no previous attempt archived" in missing.stderr

    deleted = run("-n", namespace, "delete", "-l", "suite=cli").stdout
    assert deleted == "acceleratejob/flaky deleted\nacceleratejob/steady deleted\n"
    run("-n", namespace, "wait", "--for=delete", "--timeout=2m", "flaky", "steady", timeout=150)
    assert run("-n", namespace, "get", "-o", "name").stdout == ""
