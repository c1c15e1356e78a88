"""A node lost in the middle of real training (issue 37): every process of one of the two real
nodes is killed at once (kubelet, kube-proxy, containerd and the containers) and packets to its
pods vanish, as at a power loss (`hack/local-cluster.sh node-kill`). The
group restarts on the node that is left about a minute later (Kubernetes marks the node NotReady
after 50 s, and spec.runPolicy.nodeLostTimeoutSeconds is 10 s), as a disruption that names the
node, instead of waiting for the pods' 300 s toleration and a pod stuck Terminating for good.
The job then resumes from its last checkpoint and succeeds. Prints what the loss cost.

The lost node carries one of the cluster's two CoreDNS replicas, as every node does: the operator
reaches the API server by its address, not by a DNS name (a lost DNS replica once stopped every
watch of the operator), so losing the DNS node costs what losing any node costs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from devtools.cluster import ROOT, kubectl, wait_for
from tests.helpers.jobs import (
    apply_job,
    checkpointed_job,
    condition,
    phase_is,
    shared_dir,
    wait_for_job,
)
from tests.helpers.operator import (
    OPERATOR_NAMESPACE,
    OPERATOR_SELECTOR,
    active_operator,
    running_operator_pods,
)

NAME = "lost"
MAX_STEPS, CHECKPOINT_EVERY, KILL_AFTER_STEP = 120, 10, 15
LOCAL_CLUSTER = str(ROOT / "hack" / "local-cluster.sh")

pytestmark = pytest.mark.skipif(os.environ.get("ACCELERATE_OPERATOR_EXTERNAL_CLUSTER") == "1",
                                reason="kills one of the local cluster's nodes")


def node_of(kubeconfig: str, namespace: str, selector: str) -> set[str]:
    out = kubectl("-n", namespace, "get", "pods", "-l", selector, "-o",
                  "jsonpath={.items[*].spec.nodeName}", kubeconfig=kubeconfig).stdout
    return set(out.split())


def pick_victim(kubeconfig: str) -> str:
    """A node that carries a CoreDNS replica (every node does: two replicas spread over the two
    nodes, as kubeadm and kind run them) and not the active operator: the test loses the job's
    node and a DNS replica with it, not the operator (its own loss is a failover, measured
    elsewhere). When the active operator runs there, the standby on the other node takes over
    (the active pod deleted: a failover of seconds)."""
    nodes = sorted(kubectl("get", "nodes", "-o", "name", kubeconfig=kubeconfig).stdout.split())
    nodes = [n.removeprefix("node/") for n in nodes]
    dns = node_of(kubeconfig, "kube-system", "k8s-app=kube-dns")
    assert dns == set(nodes), f"CoreDNS runs on {sorted(dns)}, not on every node of {nodes}"
    victim = nodes[-1]
    active, _ = active_operator(kubeconfig)
    on_victim = lambda: kubectl(  # noqa: E731
        "-n", OPERATOR_NAMESPACE, "get", "pod", active_operator(kubeconfig)[0], "-o",
        "jsonpath={.spec.nodeName}", kubeconfig=kubeconfig).stdout == victim
    if on_victim():
        kubectl("cordon", victim, kubeconfig=kubeconfig)
        try:
            kubectl("-n", OPERATOR_NAMESPACE, "delete", "pod", active, kubeconfig=kubeconfig)
            wait_for(lambda: not on_victim(), timeout=120, interval=1,
                     description="an operator replica off the node to be lost to take over")
        finally:
            kubectl("uncordon", victim, kubeconfig=kubeconfig)
    return victim


def spread_job(host_dir) -> dict:
    """The CPU example, 2 nodes x 2 processes, one pod per node where it can (a preference, so
    the restarted group fits on the node that is left), a checkpoint every 10 steps."""
    body = checkpointed_job(NAME, host_dir, f"--max-steps={MAX_STEPS}", "--log-every=1",
                            f"--checkpoint-every={CHECKPOINT_EVERY}", "--sleep-per-step=0.3")
    # A node lost is not the job's failure: the restart it causes is not counted. One counted
    # restart is allowed after it (a rank of the new group failing: seen once in four runs,
    # cause not yet known; the test prints it).
    body["spec"]["runPolicy"]["backoffLimit"] = 1
    body["spec"]["template"]["spec"]["affinity"] = {"podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": {"accelerate-operator.io/job-name": NAME}}}}]}}
    return body


def restore(node: str, kubeconfig: str) -> None:
    """Start the node again (`up` restarts what is not running), and wait for the operator's
    replica there to serve again, for the tests that follow (the failover test wants both)."""
    done = subprocess.run([LOCAL_CLUSTER, "up"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{node} did not come back:\n{done.stderr[-3000:]}"
    deployment = kubectl("-n", OPERATOR_NAMESPACE, "get", "deployment", "-l", OPERATOR_SELECTOR,
                         "-o", "name", kubeconfig=kubeconfig).stdout.split()[0]
    kubectl("-n", OPERATOR_NAMESPACE, "rollout", "status", deployment, "--timeout=300s",
            kubeconfig=kubeconfig, timeout=320)
    wait_for(lambda: len(running_operator_pods(kubeconfig)) >= 2, timeout=180, interval=1,
             description="both operator replicas running again")


def test_a_lost_node_restarts_the_group_on_the_node_left_within_about_a_minute(
        kubeconfig, namespace):
    victim = pick_victim(kubeconfig)
    host_dir = shared_dir()
    apply_job(kubeconfig, namespace, spread_job(host_dir))
    wait_for_job(kubeconfig, namespace, NAME,
                 lambda job: (job["status"].get("progress") or {}).get("step", 0)
                 >= KILL_AFTER_STEP, timeout=300, description=f"{KILL_AFTER_STEP} steps")
    placed = node_of(kubeconfig, namespace, f"accelerate-operator.io/job-name={NAME}")
    assert victim in placed, (victim, placed)

    killed = time.time()
    subprocess.run([LOCAL_CLUSTER, "node-kill", victim], check=True, timeout=120,
                   capture_output=True)
    try:
        restarted = wait_for_job(kubeconfig, namespace, NAME,
                                 lambda job: job["status"].get("attempt", 0) >= 1,
                                 timeout=240, description="the group to restart without the node")
        restart_after = time.time() - killed
        before = (restarted["status"].get("progress") or {}).get("updateTime")
        # Training again: the new group's pod 0 pushed a step (the old group's progress
        # stopped with the node).
        training = wait_for_job(
            kubeconfig, namespace, NAME,
            lambda job: job["status"].get("phase") == "Running"
            and (job["status"].get("trainer") or {}).get("attempt") == 1
            and (job["status"].get("progress") or {}).get("updateTime") != before,
            timeout=240, description="the new group to train")
        training_after = time.time() - killed
    finally:
        restore(victim, kubeconfig)

    status = restarted["status"]
    assert condition(restarted, "Restarting")["reason"] == "Disrupted", status
    assert re.search(rf"was lost with its node: node {victim} has been unreachable", status[
        "lastFailure"]), status
    # The new group runs on the node that is left (the lost one is tainted unreachable).
    assert victim not in node_of(kubeconfig, namespace,
                                 f"accelerate-operator.io/job-name={NAME},"
                                 "accelerate-operator.io/attempt=1")
    # About 60 s: 50 s for Kubernetes to mark the node NotReady, then our 10 s; not the 300 s
    # toleration, and no pod left Terminating (that would block the group for good).
    assert restart_after < 120, restart_after
    done = wait_for_job(kubeconfig, namespace, NAME, phase_is("Succeeded", "Failed"),
                        timeout=600, description="the resumed job to finish")
    final = done["status"]
    assert final["phase"] == "Succeeded", (final.get("lastFailure"), final)
    assert final["restarts"] - final["restartsCounted"] == 1, final  # the node: not counted
    if final["restartsCounted"]:
        print(f"\nWARNING: the new group failed once after the node loss: "
              f"{final.get('lastFailure')}")
    log = kubectl("-n", namespace, "logs", f"{NAME}-0", kubeconfig=kubeconfig).stdout
    resumed = re.search(r"RESUMED from=\S+ step=(\d+)", log)
    assert resumed, log[-3000:]
    assert KILL_AFTER_STEP - int(resumed.group(1)) <= CHECKPOINT_EVERY + 5, resumed.group(0)
    # The loss shows in the job's goodput: one interruption, whose recovery runs from the last
    # step reported before the kill to the new group's first.
    goodput = final["goodput"]
    assert goodput["interruptions"] == final["restarts"], goodput
    if not final["restartsCounted"]:
        assert 45 <= goodput["lastRecoverySeconds"] <= training_after + 15, (goodput,
                                                                               training_after)
    table = kubectl("-n", namespace, "get", "ajob", NAME, kubeconfig=kubeconfig).stdout
    assert re.search(r"\sSucceeded\s", table) and goodput["summary"] in table, table
    print(f"\nnode lost ({victim}, with a CoreDNS replica) at step >= {KILL_AFTER_STEP}: "
          f"group restarted {restart_after:.0f}s after the kill, training again after "
          f"{training_after:.0f}s "
          f"(resumed from step {resumed.group(1)}; first step seen: "
          f"{training['status']['progress']['step']}); goodput {goodput['summary']}, last "
          f"recovery {goodput['lastRecoverySeconds']}s, lost {json.dumps(goodput['lostSeconds'])}")
