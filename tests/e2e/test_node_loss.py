"""A node lost in the middle of real training (issues 37 and 60): every process of one of the two
real nodes is killed at once (kubelet, kube-proxy, containerd and the containers) and packets to
its pods vanish, as at a power loss (`hack/local-cluster.sh node-kill`). Two jobs lose it at once,
one kill for both (a node loss costs minutes, whatever it hits):

- a fixed-size job: its group restarts on the node that is left about a minute later (Kubernetes
  marks the node NotReady after 50 s, and spec.runPolicy.nodeLostTimeoutSeconds is 10 s), as a
  disruption that names the node, instead of waiting for the pods' 300 s toleration and a pod
  stuck Terminating for good; it resumes from its last checkpoint and succeeds;
- an elastic job whose pods fit one to a node: it shrinks to the node left, trains there with
  twice the gradient accumulation (the same batch), grows back when the node returns, and every
  step's loss matches the same training at full size.

The lost node carries one of the cluster's two CoreDNS replicas, as every node does: the operator
reaches the API server by its address, not by a DNS name (a lost DNS replica once stopped every
watch of the operator), so losing the DNS node costs what losing any node costs. Prints what the
loss cost each job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest
from accelerate_operator.timefmt import parse_time

from devtools.cluster import ROOT, kubectl, kubectl_json, wait_for
from tests.helpers.jobs import (
    apply_job,
    attempt_log,
    checkpointed_job,
    condition,
    follow_jobs,
    job_statuses,
    wait_until_finished,
)
from tests.helpers.operator import (
    OPERATOR_NAMESPACE,
    OPERATOR_SELECTOR,
    active_operator,
    running_operator_pods,
)
from tests.helpers.shared_volume import SharedDir, run_in_shared_root, shared_dir

FIXED, ELASTIC, REFERENCE = "lost", "elastic", "reference"
# Both jobs lose the node once they have trained KILL_AFTER_STEP steps. The fixed job sleeps 1 s a
# step, so it is still training when the elastic one (2 s a step) gets there; its group restarted
# on the node left trains without sleeping (it was the test's longest wait, 110 s).
MAX_STEPS, CHECKPOINT_EVERY, KILL_AFTER_STEP, FIXED_SLEEP = 120, 10, 15, 1.0
# The CPU request (millicores) of the fixed job's pods and of the reference's: small, so that
# four of them fit beside an elastic pod on one node.
SMALL_CPU = 100
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


def fixed_job(host_dir) -> dict:
    """The CPU example, 2 nodes x 2 processes, one pod per node where it can (a preference, so
    the restarted group fits on the node that is left), a checkpoint every 10 steps."""
    body = checkpointed_job(FIXED, host_dir, f"--max-steps={MAX_STEPS}", "--log-every=1",
                            f"--checkpoint-every={CHECKPOINT_EVERY}",
                            f"--sleep-per-step={FIXED_SLEEP}", "--sleep-until-attempt=1")
    # A node lost is not the job's failure: the restart it causes is not counted. One counted
    # restart is allowed after it (a rank of the new group failing: seen once in four runs,
    # cause not yet known; the test prints it).
    body["spec"]["runPolicy"]["backoffLimit"] = 1
    template = body["spec"]["template"]["spec"]
    template["containers"][0]["resources"]["requests"]["cpu"] = f"{SMALL_CPU}m"
    template["affinity"] = {"podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": {"accelerate-operator.io/job-name": FIXED}}}}]}}
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


# 2 s a step: the group stays reduced for as long as the node takes to come back (a minute or
# two), in fewer steps than the operator's log archive keeps (300 lines). The group grown back
# trains its last steps without sleeping: attempts 0 (full size), 1 (restarted at full size, a
# pod unschedulable for shrinkAfterSeconds), 2 (reduced), 3 (grown).
ELASTIC_STEPS, ELASTIC_CHECKPOINT_EVERY, ELASTIC_SLEEP = 120, 10, 2.0
GROWN_ATTEMPT = 3
SHRINK_AFTER = 30
# The loss of a step trained at 1 node with accumulation 4 against the same step at 2 nodes with
# accumulation 2: the same 32 samples, summed in another order (test_elastic_resume.py: 2e-6).
LOSS_TOLERANCE = 1e-5


def cpu_millis(quantity: str) -> int:
    return int(quantity[:-1]) if quantity.endswith("m") else int(float(quantity) * 1000)


def one_pod_per_node_cpu(kubeconfig: str, reserve: int) -> int:
    """A CPU request (millicores) that fits once on every node and never twice on one: what the
    fullest node has free less `reserve` (room for other pods beside it), which must be over half
    of any node's allocatable CPU."""
    nodes = json.loads(kubectl("get", "nodes", "-o", "json", kubeconfig=kubeconfig).stdout)
    allocatable = {n["metadata"]["name"]: cpu_millis(n["status"]["allocatable"]["cpu"])
                   for n in nodes["items"]}
    free = dict(allocatable)
    pods = json.loads(kubectl("get", "pods", "-A", "-o", "json", kubeconfig=kubeconfig).stdout)
    for pod in pods["items"]:
        node = pod["spec"].get("nodeName")
        if node in free and pod["status"].get("phase") not in ("Succeeded", "Failed"):
            free[node] -= sum(cpu_millis((c.get("resources") or {}).get("requests", {})
                                         .get("cpu", "0")) for c in pod["spec"]["containers"])
    request = min(free.values()) - reserve
    assert 2 * request > max(allocatable.values()), f"no request fits once per node only: {free}"
    return request


def elastic_job(host_dir, cpu_millicores: int) -> dict:
    """2 nodes x 1 process that may shrink to 1, accumulation 2 at full size; each pod asks for
    more than half a node's free CPU, so a node holds one; every checkpoint kept."""
    body = checkpointed_job(ELASTIC, host_dir, f"--max-steps={ELASTIC_STEPS}", "--log-every=1",
                            f"--checkpoint-every={ELASTIC_CHECKPOINT_EVERY}",
                            "--checkpoints-to-keep=100", f"--sleep-per-step={ELASTIC_SLEEP}",
                            f"--sleep-until-attempt={GROWN_ATTEMPT}",
                            "--gradient-accumulation-steps=2")
    spec = body["spec"]
    spec.update(numNodes=2, numProcPerNode=1, elastic={
        "minNodes": 1, "gradientAccumulationSteps": 2, "shrinkAfterSeconds": SHRINK_AFTER})
    spec["runPolicy"]["backoffLimit"] = 1
    spec["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = \
        f"{cpu_millicores}m"
    return body


def reference_job(host_dir) -> dict:
    """The same training at full size (2 nodes, accumulation 2), small pods, no sleep: resumed
    from a copy of the checkpoint the elastic job resumed from when it shrank."""
    body = checkpointed_job(REFERENCE, host_dir, f"--max-steps={ELASTIC_STEPS}", "--log-every=1",
                            f"--checkpoint-every={ELASTIC_CHECKPOINT_EVERY}",
                            "--gradient-accumulation-steps=2")
    body["spec"].update(numNodes=2, numProcPerNode=1)
    body["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = \
        f"{SMALL_CPU}m"
    return body


def step_losses(text: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^STEP step=(\d+) loss=(\S+)", text,
                                                          re.M)}


def copy_checkpoint(kubeconfig: str, namespace: str, source_dir: SharedDir, resumed_path: str,
                    target_dir: SharedDir) -> None:
    """The checkpoint a group resumed from (its path in the pod, under /checkpoints), as the
    only checkpoint of another job's folder: copied on the nodes' disk, through a pod."""
    source = f"/shared/{source_dir.name}/{resumed_path.removeprefix('/checkpoints/')}"
    target = f"/shared/{target_dir.name}/checkpoints"
    run_in_shared_root(kubeconfig, namespace,
                       f"mkdir -p {target} && cp -a {source} {target}/checkpoint_0 "
                       f"&& chmod -R a+rwX {target}")


def progress(status: dict) -> dict:
    return status.get("progress") or {}


def trained(steps: int):
    return lambda status, seen: progress(status).get("step", 0) >= steps


# What each job goes through once the node is lost, as follow_jobs' stages: (name, predicate of
# the job's status and the stages seen so far).
FIXED_RECOVERY = [
    ("fixed restarted", lambda status, seen: status.get("attempt", 0) >= 1),
    # Training again: the new group's pod 0 pushed a step (the old group's stopped with the node);
    # at full speed, it may have finished by the next poll.
    ("fixed trains again", lambda status, seen: status.get("phase") in ("Running", "Succeeded")
     and (status.get("trainer") or {}).get("attempt") == 1
     and progress(status).get("updateTime")
     != progress(seen["fixed restarted"][1]).get("updateTime")),
]
ELASTIC_SHRINK = [
    ("elastic shrinks", lambda status, seen: (status.get("elastic") or {}).get("nodes") == 1),
    ("elastic reduced trains", lambda status, seen:
     status["attempt"] == seen["elastic shrinks"][1]["attempt"]
     and status.get("phase") == "Running"
     and progress(status).get("updateTime")
     != progress(seen["elastic shrinks"][1]).get("updateTime")),
    # Goodput counts training between two reports: capacity returns only after the reduced group
    # reported a later step (restored at its first, the grow can leave it none).
    ("elastic reduced later step", lambda status, seen:
     status["attempt"] == seen["elastic shrinks"][1]["attempt"]
     and progress(status).get("step", 0)
     > progress(seen["elastic reduced trains"][1]).get("step", 0)),
]
ELASTIC_GROW = [
    ("elastic grown", lambda status, seen: (status.get("elastic") or {}).get("nodes") == 2),
]


def start_reference(kubeconfig: str, namespace: str, elastic_dir: SharedDir) -> str:
    """The reference job, from a copy of the checkpoint the reduced group resumed from (its
    first lines, read from the running pod): it trains while the node comes back. Returns the
    path the reduced group resumed from."""
    log = kubectl("-n", namespace, "logs", f"{ELASTIC}-0", kubeconfig=kubeconfig).stdout
    resumed = re.search(r"^RESUMED from=(\S+) step=\d+$", log, re.M)
    assert resumed, log[-2000:]
    reference_dir = shared_dir(kubeconfig, namespace)
    copy_checkpoint(kubeconfig, namespace, elastic_dir, resumed[1], reference_dir)
    apply_job(kubeconfig, namespace, reference_job(reference_dir))
    return resumed[1]


def test_a_lost_node_restarts_a_fixed_job_on_the_node_left_and_an_elastic_one_shrinks_and_grows(
        kubeconfig, namespace):
    victim = pick_victim(kubeconfig)
    fixed_dir, elastic_dir = shared_dir(kubeconfig, namespace), shared_dir(kubeconfig, namespace)
    # Room beside an elastic pod for the fixed job's two pods and the reference's two.
    elastic_cpu = one_pod_per_node_cpu(kubeconfig, reserve=4 * SMALL_CPU)
    applied = time.time()
    apply_job(kubeconfig, namespace, fixed_job(fixed_dir))
    apply_job(kubeconfig, namespace, elastic_job(elastic_dir, elastic_cpu))
    seen = follow_jobs(kubeconfig, namespace, {
        FIXED: [("fixed trained", trained(KILL_AFTER_STEP))],
        ELASTIC: [("elastic trained", trained(KILL_AFTER_STEP))]}, timeout=300)
    for job in (FIXED, ELASTIC):
        placed = node_of(kubeconfig, namespace, f"accelerate-operator.io/job-name={job}")
        assert victim in placed, (job, victim, placed)

    at_kill = job_statuses(kubeconfig, namespace)
    subprocess.run([LOCAL_CLUSTER, "node-kill", victim], check=True, timeout=120,
                   capture_output=True)
    killed = time.time()
    node_down = True
    try:
        follow_jobs(kubeconfig, namespace, {FIXED: FIXED_RECOVERY, ELASTIC: ELASTIC_SHRINK},
                    timeout=420, seen=seen)
        table = kubectl("-n", namespace, "get", "ajob", ELASTIC, kubeconfig=kubeconfig).stdout
        assert re.search(r"\s1/2\s", table), table  # SIZE: the nodes now over the nodes wanted
        reduced_from = start_reference(kubeconfig, namespace, elastic_dir)
        reduced_made = kubectl_json("-n", namespace, "get", "pod", f"{ELASTIC}-0",
                                    kubeconfig=kubeconfig)["metadata"]["creationTimestamp"]
        # Capacity returns: the placeholder is placed, and the group grows back at a checkpoint.
        restore(victim, kubeconfig)
        node_down = False
        follow_jobs(kubeconfig, namespace, {ELASTIC: ELASTIC_GROW}, timeout=300, seen=seen)
    finally:
        if node_down:
            restore(victim, kubeconfig)
    final = wait_until_finished(kubeconfig, namespace, [FIXED, ELASTIC, REFERENCE], timeout=600)
    check_fixed(kubeconfig, namespace, victim, killed, at_kill[FIXED], seen, final[FIXED])
    check_elastic(kubeconfig, namespace, at_kill[ELASTIC], seen, final[ELASTIC],
                  (reduced_from, reduced_made), (applied, killed))


def check_fixed(kubeconfig: str, namespace: str, victim: str, killed: float, at_kill: dict,
                seen: dict, final: dict) -> None:
    restart_seen, restarted = seen["fixed restarted"]
    training_seen, training = seen["fixed trains again"]
    restart_after, training_after = restart_seen - killed, training_seen - killed
    assert condition({"status": restarted}, "Restarting")["reason"] == "Disrupted", restarted
    assert re.search(rf"was lost with its node: node {victim} has been unreachable",
                     restarted["lastFailure"]), restarted
    # The new group ran on the node that is left (the lost one is tainted unreachable).
    assert victim not in node_of(kubeconfig, namespace,
                                 f"accelerate-operator.io/job-name={FIXED},"
                                 "accelerate-operator.io/attempt=1")
    # About 60 s: 50 s for Kubernetes to mark the node NotReady, then our 10 s; not the 300 s
    # toleration, and no pod left Terminating (that would block the group for good).
    assert restart_after < 120, restart_after
    assert final["phase"] == "Succeeded", (final.get("lastFailure"), final)
    assert final["restarts"] - final["restartsCounted"] == 1, final  # the node: not counted
    if final["restartsCounted"]:
        print(f"\nWARNING: the new group failed once after the node loss: "
              f"{final.get('lastFailure')}")
    log = kubectl("-n", namespace, "logs", f"{FIXED}-0", kubeconfig=kubeconfig).stdout
    resumed = re.search(r"RESUMED from=\S+ step=(\d+)", log)
    assert resumed, log[-3000:]
    last_step = progress(at_kill)["step"]
    assert last_step - int(resumed.group(1)) <= CHECKPOINT_EVERY + 5, (last_step, resumed[0])
    # The loss shows in the job's goodput: one interruption, whose recovery runs from the last
    # step reported before the kill to the new group's first.
    goodput = final["goodput"]
    assert goodput["interruptions"] == final["restarts"], goodput
    if not final["restartsCounted"]:
        assert 45 <= goodput["lastRecoverySeconds"] <= training_after + 15, (goodput,
                                                                               training_after)
    table = kubectl("-n", namespace, "get", "ajob", FIXED, kubeconfig=kubeconfig).stdout
    assert re.search(r"\sSucceeded\s", table) and goodput["summary"] in table, table
    print(f"\nnode lost ({victim}, with a CoreDNS replica) at step >= {last_step}: "
          f"group restarted {restart_after:.0f}s after the kill, training again after "
          f"{training_after:.0f}s (resumed from step {resumed.group(1)}; first step seen: "
          f"{progress(training)['step']}); goodput {goodput['summary']}, last "
          f"recovery {goodput['lastRecoverySeconds']}s, lost {json.dumps(goodput['lostSeconds'])}")


def check_elastic(kubeconfig: str, namespace: str, at_kill: dict, seen: dict, final: dict,
                  reduced_group: tuple[str, str], times: tuple[float, float]) -> None:
    """`reduced_group`: the checkpoint the reduced group resumed from and when its pod was made."""
    (reduced_path, reduced_made), (applied, killed) = reduced_group, times
    shrink_seen, shrinking = seen["elastic shrinks"]
    grow_seen, grown = seen["elastic grown"]
    shrunk = seen["elastic reduced trains"][1]
    reduced_attempt = shrinking["attempt"]
    assert reduced_attempt < GROWN_ATTEMPT, shrinking  # it must sleep
    assert final["phase"] == "Succeeded", (final.get("lastFailure"), final)
    # Shrunk as a disruption: a Warning naming the pod the scheduler could not place and why.
    resized = condition({"status": shrunk}, "Resized")
    assert (resized["status"], resized["reason"]) == ("True", "PodsUnschedulable"), resized
    assert re.search(rf"pod {ELASTIC}-\d cannot be scheduled: Unschedulable", resized["message"])
    # The group that never formed went at once: its placed pod, its trainer waiting for the
    # unplaced master's name, held the reduced group back for its whole grace period (120 s).
    made_after = (parse_time(reduced_made)
                  - parse_time(resized["lastTransitionTime"])).total_seconds()
    assert made_after < 30, (reduced_made, resized)
    assert condition({"status": grown}, "Resized")["reason"] == "CapacityReturned"
    assert final["restartsCounted"] == 0 and final["elastic"]["resizes"] == 2, final
    assert not kubectl("-n", namespace, "get", "pods", "-l",
                       f"accelerate-operator.io/placeholder-for={ELASTIC}", "-o", "name",
                       kubeconfig=kubeconfig).stdout.strip()  # gone with the full size

    # The reduced group trained on one node with twice the accumulation, from the checkpoint
    # before the kill; the grown group resumed where it stopped (it saved on SIGTERM).
    reduced_log = attempt_log(kubeconfig, namespace, ELASTIC, reduced_attempt, f"{ELASTIC}-0")
    assert "NOTE gradient_accumulation_steps=4" in reduced_log, reduced_log[-2000:]
    reduced_from = re.search(r"^RESUMED from=(\S+) step=(\d+)$", reduced_log, re.M)
    assert reduced_from and reduced_from[1] == reduced_path, (reduced_path, reduced_log[-2000:])
    resumed_step, last_full_step = int(reduced_from[2]), progress(at_kill)["step"]
    assert last_full_step - resumed_step <= ELASTIC_CHECKPOINT_EVERY + 5, reduced_from[0]
    reduced = step_losses(reduced_log)
    grown_log = kubectl("-n", namespace, "logs", f"{ELASTIC}-0", kubeconfig=kubeconfig).stdout
    grown_from = int(re.search(r"^RESUMED from=\S+ step=(\d+)$", grown_log, re.M)[1])
    # No step computed twice: the grown group resumed from the step the reduced one (a single
    # process, under accelerate's simple launcher) saved on SIGTERM. The archive is read as the
    # group is stopped, before its pods get SIGTERM: it may miss the steps trained in between
    # and the one that answered it (two, seen on a loaded machine). Issue 60 allows the
    # checkpoint interval.
    recomputed = max(reduced) - grown_from
    assert -3 <= recomputed <= 0, (grown_from, max(reduced))
    unarchived = set(range(max(reduced) + 1, grown_from + 1))
    # Back at full size the job's own accumulation (2): the trainer notes only an override.
    assert "NOTE gradient_accumulation_steps" not in grown_log, grown_log[-2000:]
    assert re.search(r"RANK_INFO rank=0 local_rank=0 world_size=2 ", grown_log), grown_log[-2000:]
    trained_losses = {**reduced, **step_losses(grown_log)}
    assert set(range(resumed_step + 1, ELASTIC_STEPS + 1)) - set(trained_losses) <= unarchived

    # The same job at full size from the same checkpoint: the same loss at every step.
    expected = step_losses(kubectl("-n", namespace, "logs", f"{REFERENCE}-0",
                                   kubeconfig=kubeconfig).stdout)
    assert set(trained_losses) <= set(expected), sorted(set(trained_losses) - set(expected))
    worst = max(abs(trained_losses[step] - expected[step]) for step in trained_losses)
    assert worst <= LOSS_TOLERANCE, {s: (trained_losses[s], expected[s]) for s in trained_losses
                                     if abs(trained_losses[s] - expected[s]) > LOSS_TOLERANCE}

    goodput = final["goodput"]
    assert goodput["reducedSeconds"] > 0 and "reduced)" in goodput["summary"], goodput
    # Only the time between the shrink and the growth ran reduced (polls a second late at most).
    assert goodput["reducedSeconds"] <= grow_seen - shrink_seen + 10, (
        goodput, grow_seen - shrink_seen)
    print(f"\nelastic: node lost at step {last_full_step}; shrunk and training on 1 node "
          f"{seen['elastic reduced trains'][0] - killed:.0f}s after the kill (resumed from step "
          f"{resumed_step}, {len(reduced)} steps at accumulation 4; its pod made {made_after:.0f}s "
          f"after the shrink), grown back at step "
          f"{grown_from} ({max(recomputed, 0)} steps computed twice); max loss difference "
          f"against the full-size run {worst:.2e}; goodput "
          f"{goodput['summary']}, {time.time() - applied:.0f}s in all")
