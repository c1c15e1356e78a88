"""What a drained node, a hung rank and a worker that never starts cost a job, on the real nodes
(issue 24): a drain restarts the group without using backoffLimit, and the group resumes from
the checkpoint every rank saved together on SIGTERM; a rank that blocks makes the job Stalled
and restarted from its checkpoint, while a quiet end after the last step does not; a node that
never runs is named in the Stalled condition.

The stall tests need the runtime to fill Observed.last_activity from rank 0's log (plan.py)."""

from __future__ import annotations

import copy
import json
import re
import subprocess

import yaml

from devtools.cluster import ROOT, kubectl, kubectl_binary
from tests.helpers.jobs import (
    apply_job,
    attempt_log,
    checkpointed_job,
    condition,
    phase_is,
    recent_events,
    wait_for_job,
)
from tests.helpers.shared_volume import shared_dir

JOB_NAME_LABEL = "accelerate-operator.io/job-name"


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


def stall_story(kubeconfig: str, namespace: str) -> str:
    """The namespace's events, and the last lines pod 0 of the stalled group printed (the
    operator's archive): whether its reports reached the operator is said there."""
    try:
        archive = attempt_log(kubeconfig, namespace, "stall", 0, "stall-0")
    except (AssertionError, KeyError) as error:
        archive = f"(no archive: {error})"
    return "\n".join([recent_events(kubeconfig, namespace),
                      "pod stall-0 before the restart, its last lines:",
                      *archive.splitlines()[-40:]])


def test_a_rank_that_blocks_is_stalled_and_restarted_from_its_checkpoint(kubeconfig, namespace):
    max_steps, hang_at = 20, 12
    host_dir = shared_dir(kubeconfig, namespace)
    body = checkpointed_job("stall", host_dir, f"--max-steps={max_steps}", "--log-every=1",
                            "--checkpoint-every=5", f"--hang-at-step={hang_at}", "--fail-rank=3",
                            "--fail-attempt=0", "--sleep-per-step=1", "--sleep-until-attempt=1",
                            "--quiet-end=40")
    # One step a second: rank 0's progress reports (at most one per 2 s) come close to the hang,
    # so the step the operator names is within two of it. The resumed group's end is quiet for
    # longer than the timeout (--quiet-end, as a final save would be): after the last step
    # that is not a stall, so the job ends with its one restart.
    body["spec"]["runPolicy"]["stallTimeoutSeconds"] = 30
    # A hung collective never reaches the step boundary where a stop is answered.
    body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 10
    apply_job(kubeconfig, namespace, body)
    done = wait_for_job(kubeconfig, namespace, "stall", phase_is("Succeeded", "Failed"),
                        timeout=600, description="the stalled job to restart and finish")
    status = done["status"]
    assert status["phase"] == "Succeeded", status
    assert (status["restarts"], status["restartsCounted"]) == (1, 1), status
    assert "no log line or progress report from rank 0" in status["lastFailure"], status
    events = json.loads(kubectl("-n", namespace, "get", "events", "--field-selector",
                                "involvedObject.name=stall", "-o", "json",
                                kubeconfig=kubeconfig).stdout)["items"]
    stalled = [e for e in events if e["reason"] == "Stalled" and e["type"] == "Warning"]
    named = re.search(r"the last step seen is (\d+)\b", stalled[0]["message"]) if stalled else None
    assert named and hang_at - 3 <= int(named.group(1)) <= hang_at, \
        stall_story(kubeconfig, namespace)
    log = kubectl("-n", namespace, "logs", "stall-0", kubeconfig=kubeconfig).stdout
    assert re.search(r"RESUMED from=\S+checkpoint_\d+ step=10\b", log), log[-3000:]
    assert re.search(rf"TRAINING_DONE steps={max_steps} ", log)


def test_a_node_that_never_runs_is_named_in_the_stalled_condition(kubeconfig, namespace):
    body = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "cpu-ddp.yaml").read_text()))
    body["metadata"] = {"name": "missing"}
    spec = body["spec"]
    spec["numNodes"], spec["numProcPerNode"] = 3, 1
    spec["runPolicy"] = {"backoffLimit": 0, "stallTimeoutSeconds": 30}
    pod = spec["template"]["spec"]
    # One pod per node on two nodes: one of the three never schedules.
    pod["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": {JOB_NAME_LABEL: "missing"}},
        "topologyKey": "kubernetes.io/hostname"}]}}
    trainer = pod["containers"][0]
    trainer.update(command=["python3", "-c", "import time; time.sleep(600)"], args=[])
    apply_job(kubeconfig, namespace, body)
    failed = wait_for_job(kubeconfig, namespace, "missing", phase_is("Failed"), timeout=180,
                          description="the job to be Stalled and fail (backoffLimit 0)")
    stalled = condition(failed, "Stalled")
    assert stalled["status"] == "True", failed["status"]
    assert re.match(r"node [0-2] \(pod missing-[0-2]: Pending, Unschedulable\) not running 30s "
                    r"after the group was created", stalled["message"]), stalled
    assert condition(failed, "Failed")["reason"] == "BackoffLimitExceeded"
    assert failed["status"]["restartsCounted"] == 0  # the budget was 0: failed, not restarted
