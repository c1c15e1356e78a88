"""What a hung rank and a worker that never starts cost a job, on the real nodes (issue 24): a
rank that blocks makes the job Stalled and restarted from its checkpoint, while a quiet end after
the last step does not; a node that never runs is named in the Stalled condition. Neither changes
what other tests share, so they run beside them (the drained node: test_disruptions.py).

The stall tests need the runtime to fill Observed.last_activity from rank 0's log (plan.py)."""

from __future__ import annotations

import copy
import json
import re

import yaml
from accelerate_trainer.contract import JOB_NAME_LABEL

from devtools.cluster import ROOT, kubectl
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
    # A small request: only the anti-affinity, not the trainings beside it, keeps a pod out.
    trainer.update(command=["python3", "-c", "import time; time.sleep(600)"], args=[],
                   resources={"requests": {"cpu": "10m", "memory": "64Mi"}})
    apply_job(kubeconfig, namespace, body)
    failed = wait_for_job(kubeconfig, namespace, "missing", phase_is("Failed"), timeout=180,
                          description="the job to be Stalled and fail (backoffLimit 0)")
    stalled = condition(failed, "Stalled")
    assert stalled["status"] == "True", failed["status"]
    # The node is named with the scheduler's own reason and words for its pod.
    assert re.match(r"node [0-2] \(pod missing-[0-2] cannot be scheduled: Unschedulable: 0/2 "
                    r"nodes are available: .*anti-affinity.*\) not running 30s after the group "
                    r"was created", stalled["message"]), stalled
    assert condition(failed, "Failed")["reason"] == "BackoffLimitExceeded"
    assert failed["status"]["restartsCounted"] == 0  # the budget was 0: failed, not restarted
