"""End to end: the CLI's kubectl habits against the local cluster, run as a user runs them, as
`accelerate-job` and as `kubectl accelerate` (kubectl finds the plugin `kubectl-accelerate` on
PATH), on the same jobs: `-n NS get` (flags before the command), `get -o jsonpath`,
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

ROOT = Path(__file__).resolve().parents[2]
FLAKY = ("import os, sys; attempt = os.environ['ACCELERATE_JOB_ATTEMPT']; "
         "print(f'flaky attempt={attempt}', flush=True); sys.exit(3 if attempt == '0' else 0)")
STEADY = "print('steady done', flush=True)"
# What pip writes for the console scripts `accelerate-job` and `kubectl-accelerate`, here running
# this checkout's code (the venv's installed copy is whichever checkout installed it last).
ENTRY_POINT = """#!{python}
import sys
sys.path[:0] = [{operator!r}, {trainer!r}]
from accelerate_job.cli import main
sys.exit(main())
"""


def front_ends(bin_dir: Path) -> dict[str, list[str]]:
    """The two ways a user runs the CLI, with `accelerate-job` and `kubectl-accelerate` in
    `bin_dir` (krew's convention: kubectl runs the `kubectl-NAME` it finds on PATH)."""
    bin_dir.mkdir(exist_ok=True)
    for name in ("accelerate-job", "kubectl-accelerate"):
        script = bin_dir / name
        script.write_text(ENTRY_POINT.format(python=sys.executable,
                                             operator=str(ROOT / "operator"),
                                             trainer=str(ROOT / "trainer")))
        script.chmod(0o755)
    return {"accelerate-job": [str(bin_dir / "accelerate-job")],
            "kubectl accelerate": [kubectl_binary(), "accelerate"]}


def runner(front_end: str, kubeconfig: str, bin_dir: Path):
    """Run the CLI through `front_end`, with `bin_dir` first on PATH and KUBECONFIG set."""
    command = front_ends(bin_dir)[front_end]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "KUBECONFIG": kubeconfig}

    def run(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run([*command, *args], capture_output=True, text=True, env=env,
                              timeout=timeout)
        if check:
            assert proc.returncode == 0, (f"{front_end} {' '.join(args)} exited "
                                          f"{proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc
    return run


def test_kubectl_habits_on_the_cluster(kubeconfig, namespace, tmp_path):
    """Both front ends on the same two jobs: every reading command through each (the same answer
    where nothing in it ticks); the writes (delete, wait for it) one through each."""
    bin_dir = tmp_path / "bin"
    job_cli, plugin = (runner(name, kubeconfig, bin_dir)
                       for name in ("accelerate-job", "kubectl accelerate"))

    def both(*args: str, **kwargs) -> subprocess.CompletedProcess:
        first, second = job_cli(*args, **kwargs), plugin(*args, **kwargs)
        assert (first.returncode, first.stdout) == (second.returncode, second.stdout), (
            args, first.stdout, second.stdout)
        return first

    for name, script in (("flaky", FLAKY), ("steady", STEADY)):
        apply_job(kubeconfig, namespace,
                  command_job(name, script, nodes=1).labels(suite="cli").for_server().build())

    table = job_cli("-n", namespace, "get").stdout.splitlines()
    assert table[0].split()[:2] == ["NAME", "PHASE"]
    assert [line.split()[0] for line in table[1:]] == ["flaky", "steady"]
    table = plugin("-n", namespace, "get").stdout.splitlines()
    assert [line.split()[0] for line in table[1:]] == ["flaky", "steady"]

    waited = both("-n", namespace, "wait", "--for=condition=Succeeded", "--timeout=10m",
                  "flaky", "steady", timeout=630).stdout
    assert waited == ("acceleratejob/flaky condition met: Succeeded (Succeeded)\n"
                      "acceleratejob/steady condition met: Succeeded (Succeeded)\n")
    assert both("get", "flaky", "-n", namespace, "-o",
                "jsonpath={.status.phase} {.status.restarts}").stdout == "Succeeded 1"

    for run in (job_cli, plugin):  # each: describe shows ages, which tick between the two
        story = run("describe", "flaky", "-n", namespace).stdout
        assert "Phase:        Succeeded" in story
        for section in ("Conditions:", "Last failure:", "Pods:", "Events:"):
            assert section in story.splitlines()
        conditions = story.split("Conditions:")[1].split("Last failure:")[0]
        assert any(line.split()[:2] == ["Succeeded", "True"] for line in conditions.splitlines())
        events = story.split("Events:")[1]
        assert "Warning" in events and "Normal" in events

    assert "flaky attempt=0" in both("-n", namespace, "logs", "flaky", "-p").stdout
    for run in (job_cli, plugin):
        now = run("-n", namespace, "logs", "flaky")
        assert "flaky attempt=1" in now.stdout and "attempt=0" not in now.stdout
        assert "-p (the last)" in now.stderr
        missing = run("-n", namespace, "logs", "steady", "-p", check=False)
        assert missing.returncode == 1 and "no previous attempt archived" in missing.stderr

    deleted = plugin("-n", namespace, "delete", "-l", "suite=cli").stdout
    assert deleted == "acceleratejob/flaky deleted\nacceleratejob/steady deleted\n"
    job_cli("-n", namespace, "wait", "--for=delete", "--timeout=2m", "flaky", "steady",
            timeout=150)
    assert both("-n", namespace, "get", "-o", "name").stdout == ""
