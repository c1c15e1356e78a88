"""What a drained node costs a job, on the real nodes (issue 24): a drain restarts the group
without using backoffLimit, and the group resumes from the checkpoint every rank saved together on
SIGTERM. (A hung rank and a worker that never starts: test_stalls.py, which changes nothing the
other tests share; this module cordons a node, so make test runs it alone.)"""

from __future__ import annotations

import re
import subprocess

from accelerate_trainer.contract import JOB_NAME_LABEL

from devtools.cluster import kubectl, kubectl_binary
from tests.helpers.jobs import (
    apply_job,
    checkpointed_job,
    condition,
    phase_is,
    wait_for_job,
)
from tests.helpers.shared_volume import shared_dir


def follow_log(kubeconfig: str, namespace: str, pod: str) -> subprocess.Popen:
    """`kubectl logs -f`: the whole log of a pod the restart deletes, to its last line."""
    return subprocess.Popen(
        [kubectl_binary(), "--kubeconfig", kubeconfig, "-n", namespace, "logs", "-f", pod],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def steps_of(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"STEP step=(\d+)", log)]


def test_a_drained_node_costs_the_step_in_flight_not_the_restart_budget(kubeconfig, namespace):
    max_steps = 40
    host_dir = shared_dir(kubeconfig, namespace)
    # No periodic checkpoint: a resume can only come from the one saved at the drain. The
    # resumed group (attempt 1) trains at full speed.
    body = checkpointed_job("drain", host_dir, f"--max-steps={max_steps}", "--log-every=1",
                            "--sleep-per-step=1", "--sleep-until-attempt=1")
    body["spec"]["runPolicy"]["backoffLimit"] = 0
    apply_job(kubeconfig, namespace, body)
    wait_for_job(kubeconfig, namespace, "drain",
                 lambda job: (job["status"].get("progress") or {}).get("step", 0) >= 5,
                 timeout=300, description="the job to train 5 steps")
    node = kubectl("-n", namespace, "get", "pod", "drain-1", "-o",
                   "jsonpath={.spec.nodeName}", kubeconfig=kubeconfig).stdout.strip()
    rank0 = follow_log(kubeconfig, namespace, "drain-0")
    try:
        # Cordons the node and evicts this job's pods on it (the eviction API, as a
        # maintenance drain does); the operator stops the other pod the same way.
        kubectl("drain", node, f"--pod-selector={JOB_NAME_LABEL}=drain", "--ignore-daemonsets",
                "--delete-emptydir-data", "--timeout=240s", kubeconfig=kubeconfig, timeout=300)
        restarted = wait_for_job(kubeconfig, namespace, "drain",
                                 lambda job: job["status"].get("attempt", 0) >= 1,
                                 timeout=120, description="the group to restart")
    finally:
        kubectl("uncordon", node, kubeconfig=kubeconfig, check=False)
    assert condition(restarted, "Restarting")["reason"] == "Disrupted", restarted["status"]
    done = wait_for_job(kubeconfig, namespace, "drain", phase_is("Succeeded", "Failed"),
                        timeout=600, description="the resumed job to finish")
    status = done["status"]
    assert status["phase"] == "Succeeded", status
    assert (status["restarts"], status["restartsCounted"]) == (1, 0), status
    assert "EvictionByEvictionAPI" in status["lastFailure"] or "deleted" in status["lastFailure"]

    first = rank0.communicate(timeout=180)[0]
    assert "STOPPED checkpoint=/checkpoints/checkpoints/checkpoint_0" in first, first[-3000:]
    second = kubectl("-n", namespace, "logs", "drain-0", kubeconfig=kubeconfig).stdout
    resumed = re.search(r"RESUMED from=\S+checkpoint_0 step=(\d+)", second)
    assert resumed, second[-3000:]
    resumed_step = int(resumed.group(1))
    trained_before = max(steps_of(first))
    # The step in flight at SIGTERM is finished and saved: at most that one is trained again.
    assert 0 <= trained_before - resumed_step <= 1, (trained_before, resumed_step)
    assert steps_of(second) == list(range(resumed_step + 1, max_steps + 1))
    assert re.search(rf"TRAINING_DONE steps={max_steps} ", second)
    assert "checkpoints/checkpoint_0/COMPLETE" in host_dir.files(kubeconfig, namespace)
    table = kubectl("-n", namespace, "get", "ajob", "drain", kubeconfig=kubeconfig).stdout
    assert re.search(r"RESTARTS\s+COUNTED", table) and re.search(r"\s1\s+0\s", table), table
    goodput = status["goodput"]
    assert goodput["interruptions"] == 1 and goodput["lostSeconds"]["recomputed"] <= 2, goodput
    print(f"\ndrain: trained {trained_before} steps, resumed from step {resumed_step}; "
          f"{goodput['lastRecoverySeconds']}s with no step running, goodput {goodput['summary']}")
