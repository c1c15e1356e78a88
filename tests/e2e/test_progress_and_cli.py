"""End to end: a job submitted with the `accelerate-job` CLI, watched through kubectl, the CLI and
the Python client: status.progress appears while it trains (kubectl's PROGRESS column), one
injected failure restarts the processes in place (the pod's log holds both attempts; nothing is
archived, no pod was deleted), then wait, logs of every node, and delete.

One node x two processes of the CPU example, 30 steps slowed to about 0.2 s each so that the
operator's 5 s progress timer sees it mid-run; rank 1 fails at step 20 of the first attempt only
(`--fail-attempt 0`, read from the ACCELERATE_JOB_ATTEMPT the operator sets), so the second
attempt runs through."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from accelerate_job import AccelerateJobClient

from devtools.cluster import kubectl, wait_for
from devtools.images import TRAINER_CPU_IMAGE
from tests.helpers.cli import cli

pytestmark = [pytest.mark.timeout(600)]

SCRIPT = Path("/opt/accelerate/examples/train.py")
IMAGE = TRAINER_CPU_IMAGE
NAME = "progress"
MAX_STEPS = 30
FAIL_AT_STEP = 20
CPU_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
use_cpu: true
mixed_precision: "no"
"""


def test_progress_logs_across_a_restart_and_the_cli(kubeconfig, namespace, tmp_path):
    config = tmp_path / "accelerate.yaml"
    config.write_text(CPU_CONFIG)
    client = AccelerateJobClient(kubeconfig=kubeconfig, namespace=namespace)
    started = time.monotonic()
    cli("submit", "--config", str(config), "--image", IMAGE, "--nodes", "1",
        "--procs-per-node", "2", "--name", NAME, "--backoff-limit", "2",
        "--env", "OMP_NUM_THREADS=1", "--env", "HF_HUB_OFFLINE=1",
        "--env", "HF_DATASETS_OFFLINE=1",
        "--in-image", str(SCRIPT), "--max-steps", str(MAX_STEPS), "--sleep-per-step", "0.2",
        "--log-every", "1", "--fail-at-step", str(FAIL_AT_STEP), "--fail-rank", "1",
        "--fail-attempt", "0",
        kubeconfig=kubeconfig, namespace=namespace)
    assert client.get(NAME)["spec"]["accelerateConfigFrom"]["configMapKeyRef"] == {
        "name": f"{NAME}-accelerate-yaml", "key": "accelerate.yaml"}

    # Progress while training, as kubectl shows it.
    def mid_run_progress():
        row = kubectl("-n", namespace, "get", "ajob", NAME, "--no-headers",
                      kubeconfig=kubeconfig).stdout.split()
        status = client.get(NAME).get("status") or {}
        progress = status.get("progress") or {}
        running = status.get("phase") == "Running"
        return running and 0 < progress.get("step", 0) < MAX_STEPS and f"/{MAX_STEPS}" in \
            " ".join(row) and (row, progress)
    row, progress = wait_for(mid_run_progress, timeout=240, interval=1,
                             description="status.progress mid-run")
    print(f"progress seen after {time.monotonic() - started:.0f}s: {' '.join(row)}")
    assert progress["totalSteps"] == MAX_STEPS and progress["summary"] in " ".join(row)
    assert {"loss", "epoch", "samplesPerSecond", "updateTime"} <= set(progress)

    # The injected failure restarts the processes in the same pod: its log goes on.
    wait_for(lambda: (client.get(NAME).get("status") or {}).get("restarts") == 1,
             timeout=240, interval=1, description="the restart after the injected failure")
    both = cli("logs", NAME, kubeconfig=kubeconfig, namespace=namespace).stdout
    assert f"FAILING on purpose rank=1 step={FAIL_AT_STEP}" in both
    assert client.archived_attempts(NAME) == []
    missing = cli("logs", NAME, "--attempt", "7", kubeconfig=kubeconfig,
                  namespace=namespace, check=False)
    assert missing.returncode == 1 and "no archived logs for attempt 7" in missing.stderr

    # Wait through the CLI, then the client: both see Succeeded.
    waited = cli("wait", NAME, "--timeout", "300s", kubeconfig=kubeconfig,
                 namespace=namespace, timeout=330)
    assert "Succeeded" in waited.stdout
    print(f"Succeeded after {time.monotonic() - started:.0f}s")
    done = client.wait(NAME, "Succeeded", timeout=10)
    assert done["status"]["restarts"] == 1
    final = client.progress(NAME)
    assert final["step"] == MAX_STEPS and final["summary"] == f"{MAX_STEPS}/{MAX_STEPS} (100%)"

    status = json.loads(cli("status", NAME, "-o", "json", kubeconfig=kubeconfig,
                            namespace=namespace).stdout)
    assert (status["phase"], status["restarts"]) == ("Succeeded", 1)
    assert "ended its training processes with exit code 1" in status["lastFailure"]
    logs = cli("logs", NAME, "--all", kubeconfig=kubeconfig, namespace=namespace)
    assert f"[node 0] TRAINING_DONE steps={MAX_STEPS}" in logs.stdout
    assert f"[node 0] FAILING on purpose rank=1 step={FAIL_AT_STEP}" in logs.stdout
    assert "--attempt N" not in logs.stderr  # nothing archived: no hint
    assert NAME in cli("get", kubeconfig=kubeconfig, namespace=namespace).stdout

    # Delete: the job goes, and its ConfigMaps with it (owner references).
    cli("delete", NAME, kubeconfig=kubeconfig, namespace=namespace)
    wait_for(lambda: not client.list(), timeout=60, description="the job to be deleted")
    gone = cli("status", NAME, kubeconfig=kubeconfig, namespace=namespace, check=False)
    assert gone.returncode == 1
    assert gone.stderr == (f"error: no AccelerateJob {NAME} in namespace {namespace}; "
                           "list them with `accelerate-job get`\n")
    wait_for(lambda: not [
        cm for cm in json.loads(kubectl("-n", namespace, "get", "configmaps", "-o", "json",
                                        kubeconfig=kubeconfig).stdout)["items"]
        if cm["metadata"]["name"].startswith(f"{NAME}-")], timeout=60,
        description="the job's ConfigMaps to be garbage collected")
