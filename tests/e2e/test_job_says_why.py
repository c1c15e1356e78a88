"""Four ordinary mistakes on the real nodes, read only from what the job itself says (its status,
its conditions, its Warning events, `kubectl get ajob`), as a user does before opening pods
(issue 48): an image tag that does not exist, a CPU request no node meets, a rank over its memory
limit, a typo in the script path."""

from __future__ import annotations

import json
import re
import time

import pytest

from devtools.cluster import kubectl
from devtools.images import TRAINER_CPU_IMAGE
from tests.helpers.jobs import JobBuilder, apply_job, command_job, condition, wait_for_job

PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull"}
SLEEP = "import time; time.sleep(600)"


def warnings(kubeconfig: str, namespace: str, name: str) -> list[dict]:
    """The Warning events of the AccelerateJob itself, oldest first."""
    out = kubectl("-n", namespace, "get", "events", "-o", "json", "--field-selector",
                  f"involvedObject.kind=AccelerateJob,involvedObject.name={name},type=Warning",
                  kubeconfig=kubeconfig).stdout
    return sorted(json.loads(out)["items"], key=lambda e: e.get("lastTimestamp") or "")


def waits_for(reasons: set[str]):
    return lambda job: condition(job, "Waiting").get("status") == "True" \
        and condition(job, "Waiting").get("reason") in reasons


def reason_column(kubeconfig: str, namespace: str, name: str) -> str:
    """The REASON column of `kubectl get ajob`, as a user reads it."""
    header, row = kubectl("-n", namespace, "get", "acceleratejob", name,
                          kubeconfig=kubeconfig).stdout.splitlines()[:2]
    return row[header.index("REASON"):].split()[0]  # columns are aligned


def test_an_image_that_cannot_be_pulled_is_named_within_30s(kubeconfig, namespace):
    image = TRAINER_CPU_IMAGE.rsplit(":", 1)[0] + ":no-such-tag"
    apply_job(kubeconfig, namespace, command_job("pull", SLEEP).image(image).for_server().build())
    job = wait_for_job(kubeconfig, namespace, "pull", waits_for(PULL_REASONS), timeout=30,
                       description="the Waiting condition to name the pull error")
    message = condition(job, "Waiting")["message"]
    assert message.startswith("pod pull-") and "container trainer" in message, message
    assert "no-such-tag" in message, message
    assert job["status"]["phase"] == "Pending" and job["status"]["reason"] in PULL_REASONS
    assert reason_column(kubeconfig, namespace, "pull") in PULL_REASONS
    # One Warning per cause, however often the kubelet retries the pull.
    time.sleep(15)
    pulls = [e for e in warnings(kubeconfig, namespace, "pull") if e["reason"] in PULL_REASONS]
    assert len(pulls) == 1 and pulls[0]["message"].startswith("pod pull-"), pulls


def test_a_cpu_request_no_node_meets_says_unschedulable_with_the_schedulers_message(
        kubeconfig, namespace):
    body = command_job("cpu", SLEEP).container(resources={"requests": {"cpu": "64"}})
    apply_job(kubeconfig, namespace, body.for_server().build())
    job = wait_for_job(kubeconfig, namespace, "cpu", waits_for({"Unschedulable"}), timeout=30,
                       description="the Waiting condition to say Unschedulable")
    message = condition(job, "Waiting")["message"]
    # Both pods wait for the same reason: the one named is whichever the scheduler marked first.
    assert re.match(r"pod cpu-[01] cannot be scheduled: Unschedulable: 0/", message), message
    assert "Insufficient cpu" in message, message
    assert reason_column(kubeconfig, namespace, "cpu") == "Unschedulable"
    events = warnings(kubeconfig, namespace, "cpu")
    assert [e["reason"] for e in events] == ["Unschedulable"], events
    assert "Insufficient cpu" in events[0]["message"]


# Rank 1 (pod oom-1) writes 600 MiB under a 300Mi limit; pod oom-0 waits for it.
GREEDY = ("import os, time\n"
          "if os.environ.get('NODE_RANK') == '1':\n"
          "    hog = b'x' * (600 * 2**20)\n"
          "time.sleep(600)\n")


def test_a_rank_over_its_memory_limit_says_out_of_memory_naming_pod_and_limit(
        kubeconfig, namespace):
    body = command_job("oom", GREEDY).run_policy(backoffLimit=1).container(
        resources={"limits": {"memory": "300Mi"}, "requests": {"memory": "64Mi"}})
    apply_job(kubeconfig, namespace, body.for_server().build())
    job = wait_for_job(kubeconfig, namespace, "oom",
                       lambda j: j.get("status", {}).get("phase") == "Failed", timeout=240,
                       description="the job to fail after one counted restart")
    status = job["status"]
    expected = ("out of memory: the kernel killed container trainer of pod oom-1 at its memory "
                "limit 300Mi (OOMKilled)")
    assert condition(job, "Failed")["message"].startswith(expected), status
    assert (status["reason"], status["restartsCounted"]) == ("BackoffLimitExceeded", 1), status
    restarted = [e for e in warnings(kubeconfig, namespace, "oom") if e["reason"] == "PodFailed"]
    assert restarted and restarted[0]["message"].startswith(expected), restarted


def test_a_script_path_typo_names_pythons_own_message_first(kubeconfig, namespace):
    pytest.importorskip("accelerate_trainer.root_cause",
                        reason="the trainer's root cause report (issue 48, trainer side)")
    body = JobBuilder("typo").for_server().nodes(1).procs(1).run_policy(backoffLimit=0) \
        .args("/opt/accelerate/examples/trian.py")
    apply_job(kubeconfig, namespace, body.build())
    job = wait_for_job(kubeconfig, namespace, "typo",
                       lambda j: j.get("status", {}).get("phase") == "Failed", timeout=180,
                       description="the job to fail")
    first = condition(job, "Failed")["message"].splitlines()[0]
    assert "can't open file" in first and "trian.py" in first, first
