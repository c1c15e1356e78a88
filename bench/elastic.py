"""What an elastic job's shrink and growth cost (docs/elastic.md), on the local cluster's two
nodes: the CPU example at 2 nodes x 1 process, elastic down to 1 node (gradient accumulation 2
at full size, 4 reduced), each pod asking for over half a node's free CPU so that a node holds
one, a checkpoint every 10 steps. Once step --fault-step is seen, the last node by name loses
power for good (hack/local-cluster.sh node-kill): the group restarts, its replacement pod finds
no node, and past spec.elastic.shrinkAfterSeconds the group restarts on the node left. Then the
node comes back, the job's placeholder pod is placed, and the group grows back at a checkpoint.

Measured (the kubelets' own timestamps of the STEP lines, read from their log files as written;
the pods' PodScheduled condition for when the replacement became unschedulable):
  start        apply -> the job's first step
  shrink       the replacement pod unschedulable + shrinkAfterSeconds -> the first step on the
               node left; the target is at most 1.5 x start
  recomputed   steps computed twice; the target is at most the checkpoint interval
  grow         the operator saw the placeholder placed (status.elastic.lastResizeTime) -> the
               first step at full size (and its steps computed twice: the steps after the
               checkpoint the grown group resumed from; docs/elastic.md has what was measured)

Usage: python bench/elastic.py [--fault-step 15] [--max-steps 120] [--shrink-after 30]
       [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime

import yaml
from common import Cluster, emit_result, machine_line, wait_until
from recovery import (
    SCRIPT,
    LogCollector,
    Timeline,
    inflict,
    operator_off,
    restore_node,
    shared_dir,
    victim_node,
)
from startup import EXAMPLE

NAME = "elastic"
CHECKPOINT_EVERY = 10
JOB_LABEL = "accelerate-operator.io/job-name"


def cpu_millis(quantity: str) -> int:
    return int(quantity[:-1]) if quantity.endswith("m") else int(float(quantity) * 1000)


def one_pod_per_node_cpu(cluster: Cluster) -> int:
    """What the fullest node has free, which must be over half of any node's allocatable CPU:
    a node holds one such pod, and never two."""
    allocatable = {n.metadata.name: cpu_millis(n.status.allocatable["cpu"])
                   for n in cluster.core.list_node().items}
    free = dict(allocatable)
    for pod in cluster.core.list_pod_for_all_namespaces().items:
        if pod.spec.node_name in free and pod.status.phase not in ("Succeeded", "Failed"):
            free[pod.spec.node_name] -= sum(
                cpu_millis(((c.resources and c.resources.requests) or {}).get("cpu", "0"))
                for c in pod.spec.containers)
    request = min(free.values())
    if 2 * request <= max(allocatable.values()):
        raise SystemExit(f"no CPU request fits once per node only: {free}")
    return request


def elastic_job(namespace: str, host_dir: str, cpu: int, args: argparse.Namespace) -> dict:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"] = {"name": NAME, "namespace": namespace}
    spec = body["spec"]
    spec.update(numNodes=2, numProcPerNode=1,
                elastic={"minNodes": 1, "gradientAccumulationSteps": 2,
                         "shrinkAfterSeconds": args.shrink_after},
                checkpoint={"volumeName": "checkpoints", "mountPath": "/checkpoints"})
    spec["runPolicy"] = {"backoffLimit": 1, "cleanPodPolicy": "None"}
    pod = spec["template"]["spec"]
    pod["volumes"].append({"name": "checkpoints",
                           "hostPath": {"path": host_dir, "type": "DirectoryOrCreate"}})
    container = pod["containers"][0]
    container["volumeMounts"].append({"name": "checkpoints", "mountPath": "/checkpoints"})
    container["resources"]["requests"]["cpu"] = f"{cpu}m"
    container["args"] = [SCRIPT, f"--max-steps={args.max_steps}", "--log-every=1",
                         f"--checkpoint-every={CHECKPOINT_EVERY}",
                         f"--sleep-per-step={args.sleep_per_step}",
                         "--gradient-accumulation-steps=2"]
    return body


class Unschedulable:
    """The earliest time a pod of the job was found unschedulable after `since` (its
    PodScheduled condition), polled."""

    def __init__(self, cluster: Cluster, namespace: str, since: float):
        self.cluster, self.namespace, self.since = cluster, namespace, since
        self.first: float | None = None

    def poll(self) -> None:
        for pod in self.cluster.core.list_namespaced_pod(
                self.namespace, label_selector=JOB_LABEL).items:
            for condition in pod.status.conditions or []:
                if condition.type == "PodScheduled" and condition.reason == "Unschedulable":
                    when = condition.last_transition_time.timestamp()
                    if when >= self.since and (self.first is None or when < self.first):
                        self.first = when


def first_step_after(timeline: Timeline, moment: float) -> tuple[float, int] | None:
    """(when, which) of the first STEP line after `moment`."""
    return next(((when, step) for when, step in timeline.sorted() if when > moment), None)


def size(cluster: Cluster, namespace: str) -> int | None:
    return (cluster.job(namespace, NAME).get("status", {}).get("elastic") or {}).get("nodes")


def shrink_phase(cluster: Cluster, namespace: str, timeline: Timeline, node: str,
                 args: argparse.Namespace) -> dict:
    """Kill the node; wait for the group to train on the node left."""
    before = timeline.highest()
    killed = time.time()
    inflict(cluster, "node", namespace, "", node)
    unschedulable = Unschedulable(cluster, namespace, killed)

    def shrunk() -> bool:
        unschedulable.poll()
        wait_over = (unschedulable.first or float("inf")) + args.shrink_after
        return size(cluster, namespace) == 1 and first_step_after(timeline, wait_over) is not None

    wait_until(shrunk, args.timeout, "the group to train on the node left", interval=1.0)
    wait_over = unschedulable.first + args.shrink_after
    when, step = first_step_after(timeline, wait_over)
    # The steps after the checkpoint it resumed from, up to the last one seen before the kill.
    return {"steps_before_kill": before, "resumed_at_step": step - 1,
            "recomputed_at_shrink": max(before - (step - 1), 0),
            "unschedulable_after_kill_s": unschedulable.first - killed,
            "shrink_s": when - wait_over}


def grow_phase(cluster: Cluster, namespace: str, timeline: Timeline, restored: float,
               args: argparse.Namespace) -> dict:
    """The node is back: wait for the group to train at 2 nodes. The placeholder may run for
    a moment only (the operator deletes it as it grows the group), so its placing is timed by
    the pass that saw it: status.elastic.lastResizeTime (the CapacityReturned event's).
    `restored`: when the node's power came back (before it was Ready)."""
    wait_until(lambda: size(cluster, namespace) == 2, args.timeout, "the group to grow",
               interval=0.5)
    elastic = cluster.job(namespace, NAME)["status"]["elastic"]
    placed = datetime.fromisoformat(elastic["lastResizeTime"].replace("Z", "+00:00")).timestamp()
    started = wait_until(lambda: group_started(cluster, namespace, placed), args.timeout,
                         "the grown group's pods to start", interval=0.5)
    # The reduced group may log a step during its grace period: the first one at full size
    # comes after the grown group's containers started.
    wait_until(lambda: first_step_after(timeline, started) is not None, args.timeout,
               "a step at full size", interval=0.5)
    return {"placeholder_after_restore_s": placed - restored,
            "grow_s": first_step_after(timeline, started)[0] - placed}


def group_started(cluster: Cluster, namespace: str, since: float) -> float | None:
    """When the last of the job's 2 pods started its container after `since`; None before."""
    pods = cluster.core.list_namespaced_pod(
        namespace, label_selector=f"{JOB_LABEL}={NAME}").items
    started = [c.state.running.started_at.timestamp() for p in pods
               for c in (p.status.container_statuses or []) if c.state and c.state.running]
    fresh = [when for when in started if when >= since - 1]
    return max(fresh) if len(fresh) == 2 else None


def run(cluster: Cluster, args: argparse.Namespace) -> dict:
    node = victim_node(cluster)
    operator_off(cluster, node)
    namespace = cluster.create_namespace("elastic")
    timeline = Timeline()
    collector = LogCollector(namespace, timeline)
    collector.start()
    cpu = one_pod_per_node_cpu(cluster)
    applied = time.time()
    cluster.create_job(elastic_job(namespace, shared_dir(), cpu, args))
    node_down = False
    try:
        wait_until(lambda: timeline.highest() >= args.fault_step, args.timeout,
                   f"step {args.fault_step}", interval=0.1)
        start_s = timeline.sorted()[0][0] - applied
        node_down = True
        shrink = shrink_phase(cluster, namespace, timeline, node, args)
        restored = time.time()
        restore_node(cluster)
        node_down = False
        grow = grow_phase(cluster, namespace, timeline, restored, args)
        wait_until(lambda: cluster.job(namespace, NAME).get("status", {}).get("phase")
                   in ("Succeeded", "Failed"), args.timeout, "the job to finish", interval=1.0)
    finally:
        if node_down:
            restore_node(cluster)
        collector.done.set()
        collector.join()
    status = cluster.job(namespace, NAME)["status"]
    recomputed = timeline.figures(applied)["recomputed_steps"]
    cluster.delete_namespace(namespace, wait=False)
    return {"cpu_request_m": cpu, "phase": status["phase"], "start_s": start_s, **shrink,
            "shrink_ratio": shrink["shrink_s"] / start_s,
            "recomputed_at_grow": max(recomputed - shrink["recomputed_at_shrink"], 0), **grow,
            "goodput": status.get("goodput", {}).get("summary"),
            "resizes": status.get("elastic", {}).get("resizes"),
            "restarts": status.get("restarts"), "counted": status.get("restartsCounted")}


def report(result: dict, args: argparse.Namespace) -> None:
    print(f"  job: {result['phase']}, {result['resizes']} resizes, {result['restarts']} "
          f"restarts ({result['counted']} counted), goodput {result['goodput']}")
    print(f"  start (apply -> first step):                          {result['start_s']:.1f}s")
    print(f"  replacement unschedulable after the kill:             "
          f"{result['unschedulable_after_kill_s']:.1f}s")
    print(f"  shrink (unschedulable + {args.shrink_after}s -> first step on 1 node):    "
          f"{result['shrink_s']:.1f}s = {result['shrink_ratio']:.2f} x start (target <= 1.5)")
    print(f"  steps computed twice at the shrink:                   "
          f"{result['recomputed_at_shrink']} (target <= {CHECKPOINT_EVERY}, the checkpoint "
          f"interval; step {result['steps_before_kill']} seen before the kill, resumed from "
          f"{result['resumed_at_step']})")
    print(f"  node back -> the operator sees the placeholder placed: "
          f"{result['placeholder_after_restore_s']:.1f}s")
    print(f"  grow (placeholder placed -> first step on 2 nodes):   {result['grow_s']:.1f}s, "
          f"steps computed twice {result['recomputed_at_grow']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fault-step", type=int, default=15)
    parser.add_argument("--max-steps", type=int, default=120)
    # Long enough that the group is still reduced when the node is back (a minute or two).
    parser.add_argument("--sleep-per-step", type=float, default=2.0)
    parser.add_argument("--shrink-after", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    cluster = Cluster()
    print(f"elastic: 2 nodes x 1 process (1 node reduced), {args.max_steps} steps, a checkpoint "
          f"every {CHECKPOINT_EVERY}, node lost at step {args.fault_step}, shrinkAfterSeconds "
          f"{args.shrink_after}; {machine_line()}", flush=True)
    result = run(cluster, args)
    report(result, args)
    emit_result("elastic", result, args.json)
    return 0 if result["phase"] == "Succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
