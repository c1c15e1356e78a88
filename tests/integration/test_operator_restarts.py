"""The operator against the real API server, scheduler, garbage collector and node: whole-group
restarts, failures, and the run policy's stops (deadline, suspend). Pods run cheap Python
snippets; real training is in tests/e2e. The children and a job's end: test_operator_lifecycle.py
(two modules, so that pytest-xdist runs them side by side)."""

from __future__ import annotations

import json

from devtools.cluster import kubectl, wait_for
from tests.helpers.jobs import (
    apply_job,
    command_job,
    condition,
    phase_is,
    wait_for_job,
)
from tests.integration.test_operator_lifecycle import SLEEP, pods_of


def test_a_failed_rank_restarts_the_whole_group_then_backoff_fails_the_job(kubeconfig, namespace):
    # Node 1 always fails; with backoffLimit 1 the group restarts once, then the job fails.
    script = ("import os, sys, time\n"
              "if os.environ['NODE_RANK'] == '1':\n"
              "    time.sleep(2); print('rank 1 lost its GPU', file=sys.stderr); sys.exit(3)\n"
              "time.sleep(600)")
    apply_job(kubeconfig, namespace,
              command_job("flaky", script).run_policy(backoffLimit=1).build())
    restarting = wait_for_job(kubeconfig, namespace, "flaky",
                              lambda j: j.get("status", {}).get("restarts") == 1, timeout=120)
    assert "pod flaky-1 failed with exit code 3" in restarting["status"]["lastFailure"]
    failed = wait_for_job(kubeconfig, namespace, "flaky", phase_is("Failed"), timeout=120)
    message = condition(failed, "Failed")["message"]
    assert condition(failed, "Failed")["reason"] == "BackoffLimitExceeded"
    assert "pod flaky-1 failed with exit code 3" in message and "rank 1 lost its GPU" in message
    # Every pod of the second attempt is stopped: nothing hangs waiting for the lost rank.
    wait_for(lambda: all(p["status"].get("phase") in ("Succeeded", "Failed")
                         or p["metadata"].get("deletionTimestamp")
                         for p in pods_of(kubeconfig, namespace, "flaky")),
             timeout=60, description="no pod of the failed job left running")
    events = kubectl("-n", namespace, "get", "events", "--field-selector",
                     "involvedObject.name=flaky", "-o", "json", kubeconfig=kubeconfig)
    reasons = [e["reason"] for e in json.loads(events.stdout)["items"]]
    assert "PodFailed" in reasons and "BackoffLimitExceeded" in reasons


def test_config_error_exit_code_fails_at_once_without_restarts(kubeconfig, namespace):
    script = ("import sys; open('/dev/termination-log', 'w').write("
              "'invalid configuration: unknown accelerate config key(s) num_gpus'); sys.exit(78)")
    apply_job(kubeconfig, namespace, command_job("badcfg", script).build())
    failed = wait_for_job(kubeconfig, namespace, "badcfg", phase_is("Failed"), timeout=90)
    assert failed["status"].get("restarts", 0) == 0
    assert condition(failed, "Failed")["reason"] == "InvalidConfig"
    assert "num_gpus" in condition(failed, "Failed")["message"]


def test_deleting_a_running_pod_restarts_the_group(kubeconfig, namespace):
    apply_job(kubeconfig, namespace, command_job("evict", SLEEP).build())
    running = wait_for_job(kubeconfig, namespace, "evict", phase_is("Running"), timeout=90)
    old_uids = {p["metadata"]["uid"] for p in pods_of(kubeconfig, namespace, "evict")}
    kubectl("-n", namespace, "delete", "pod", "evict-1", "--wait=false", kubeconfig=kubeconfig)
    restarted = wait_for_job(
        kubeconfig, namespace, "evict",
        lambda j: j["status"].get("restarts") == 1 and j["status"].get("phase") == "Running",
        timeout=120, description="the group to restart and run again")
    assert "evict-1" in restarted["status"]["lastFailure"]
    new = pods_of(kubeconfig, namespace, "evict")
    assert len(new) == 2 and not old_uids & {p["metadata"]["uid"] for p in new}
    assert {p["metadata"]["labels"]["accelerate-operator.io/attempt"] for p in new} == {"1"}
    assert running["metadata"]["uid"] == restarted["metadata"]["uid"]


def test_active_deadline_fails_the_job_and_stops_its_pods(kubeconfig, namespace):
    apply_job(kubeconfig, namespace,
              command_job("deadline", SLEEP).run_policy(activeDeadlineSeconds=8).build())
    failed = wait_for_job(kubeconfig, namespace, "deadline", phase_is("Failed"), timeout=90)
    assert condition(failed, "Failed")["reason"] == "DeadlineExceeded"
    wait_for(lambda: not [p for p in pods_of(kubeconfig, namespace, "deadline")
                          if p["status"].get("phase") == "Running"
                          and not p["metadata"].get("deletionTimestamp")],
             timeout=60, description="the deadline job's pods to stop")


def test_suspend_deletes_pods_and_resume_starts_a_fresh_group(kubeconfig, namespace):
    apply_job(kubeconfig, namespace, command_job("pause", SLEEP).build())
    wait_for_job(kubeconfig, namespace, "pause", phase_is("Running"), timeout=90)
    kubectl("-n", namespace, "patch", "acceleratejob", "pause", "--type=merge", "-p",
            '{"spec": {"runPolicy": {"suspend": true}}}', kubeconfig=kubeconfig)
    suspended = wait_for_job(kubeconfig, namespace, "pause", phase_is("Suspended"), timeout=60)
    assert condition(suspended, "Suspended")["status"] == "True"
    wait_for(lambda: not pods_of(kubeconfig, namespace, "pause"), timeout=60,
             description="the suspended job's pods to be deleted")
    kubectl("-n", namespace, "patch", "acceleratejob", "pause", "--type=merge", "-p",
            '{"spec": {"runPolicy": {"suspend": false}}}', kubeconfig=kubeconfig)
    resumed = wait_for_job(kubeconfig, namespace, "pause", phase_is("Running"), timeout=90)
    assert condition(resumed, "Suspended")["status"] == "False"
    assert resumed["status"].get("restarts", 0) == 0
    attempts = {p["metadata"]["labels"]["accelerate-operator.io/attempt"]
                for p in pods_of(kubeconfig, namespace, "pause")}
    assert attempts == {"1"}
