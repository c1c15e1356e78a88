"""Overhead of the operator on training: the same run of examples/train.py (world size 4 on CPU,
2 nodes x 2 processes, in the trainer image on the cluster's nodes) through an AccelerateJob and
as two plain pods that run `accelerate launch` themselves, no operator and no accelerate-trainer,
alternated pair by pair in one session.

The bare pods are what the operator would create, minus the operator: the job body goes through
the operator's own builders (render_accelerate_config -> a ConfigMap, build_service -> a headless
Service with publishNotReadyAddresses, build_pod -> pods `bare-0`/`bare-1` with hostname and
subdomain, the topology env, the config mount and /dev/shm), then the container's command becomes
the argv of accelerate_trainer's build_launch_plan: `accelerate launch --config_file ...
--num_machines 2 --num_processes 4 --machine_rank N --main_process_ip bare-0.bare
--main_process_port 29500 --multi_gpu /opt/accelerate/examples/train.py <the example's flags>`,
with ACCELERATE_USE_CPU=1. Labels and owner are the benchmark's own (the operator ignores them);
each pod is pinned to its own node (nodeSelector kubernetes.io/hostname), and the nodes the
operator's pods were bound to are printed beside.

Per leg: steps/s between `STEP step=1` and the last STEP line (rank 0's log, timed on arrival;
read from the node's kubelet log file every 20 ms), time to step 1 from the create call (the
AccelerateJob; for bare, the ConfigMap, Service and pods), time to step 1 from the first pod's
creation (its watch ADDED event: the same clock for both, so the operator's own reaction time
is left out), and wall time: create -> job Succeeded for the operator, create -> both pods
Succeeded for bare. Ratios operator/bare are per pair, then the median over pairs.

The end of a job: last STEP line -> last pod Succeeded -> job Succeeded. Both legs run plain
`accelerate launch` by default (the operator's under the trainer's supervisor), so the difference
is what the operator adds. --fast-exit sets the trainer's opt-in ACCELERATE_TRAINER_FAST_EXIT=1 on
the operator's job (the bare pods stay plain), to show what ending the processes without the
interpreter's teardown saves. Then --crash-runs jobs whose rank 0 dies at a step: its `FAILING`
line -> the first pod Failed -> the job Restarting.

Usage: python bench/overhead.py [--pairs 3] [--max-steps 200] [--crash-runs 2] [--fast-exit]
       [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from accelerate_operator.api import parse_job
from accelerate_operator.naming import master_address
from accelerate_operator.pod_state import read_pod_state
from accelerate_operator.resources.configmap import build_configmap, render_accelerate_config
from accelerate_operator.resources.pods import build_pod
from accelerate_operator.resources.service import build_service
from accelerate_trainer.command import build_launch_plan
from accelerate_trainer.contract import CONFIG_FILE
from accelerate_trainer.fast_exit import ENV_FAST_EXIT
from accelerate_trainer.topology import Topology
from common import (
    BENCH_LABEL,
    Cluster,
    LogFollower,
    delete_leftovers,
    emit_result,
    machine_line,
    median,
    resilient,
    start_watchers,
    stop_watchers,
    wait_for_cluster,
)
from startup import example_job

BARE_LABEL = "accelerate-operator.io/bench-bare"


class Leg:
    """Arrival times of the training's log lines, however they are read."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: dict[int, float] = {}
        self.ranks: set[str] = set()
        self.done_line: str | None = None
        self.tail: list[str] = []

    def on_line(self, t: float, line: str) -> None:
        with self.lock:
            self.tail = (self.tail + [line])[-20:]
            if line.startswith("STEP step="):
                self.steps.setdefault(int(line.split("step=", 1)[1].split()[0]), t)
            elif line.startswith("RANK_INFO "):
                self.ranks.add(line.split("rank=", 1)[1].split()[0])
            elif line.startswith("TRAINING_DONE"):
                self.done_line = line

    def figures(self, t0: float, end: float, max_steps: int, pod_created: float,
                nodes: list[str], pods_done: float) -> dict:
        with self.lock:
            if 1 not in self.steps:
                raise RuntimeError(f"no `STEP step=1` line; log tail: {self.tail}")
            first, last = self.steps[1], self.steps[max(self.steps)]
            if max(self.steps) != max_steps:
                raise RuntimeError(f"the last STEP line is step {max(self.steps)}, not {max_steps}")
            return {
                "steps_per_s": (max_steps - 1) / (last - first),
                "to_step1_s": first - t0,
                "pod_to_step1_s": first - pod_created,
                "wall_s": end - t0,
                # The end: last STEP line -> last pod Succeeded (process teardown, the
                # trainer's exit, the kubelet) -> the job Succeeded (the operator).
                "last_step_to_end_s": end - last,
                "last_step_to_pods_done_s": pods_done - last,
                "pods_done_to_end_s": end - pods_done,
                "ranks": len(self.ranks),
                "nodes": nodes,
            }


class PodTimes:
    """First ADDED event and node of each pod of a leg, and the pods' phases."""

    def __init__(self, names: list[str]):
        self.names = names
        self.lock = threading.Lock()
        self.created: dict[str, float] = {}
        self.node: dict[str, str] = {}
        self.phase: dict[str, tuple[float, str]] = {}

    def on_pod(self, t: float, typ: str, obj: dict) -> None:
        name = obj["metadata"]["name"]
        if name not in self.names or typ == "DELETED":
            return
        with self.lock:
            self.created.setdefault(name, t)
            node = (obj.get("spec") or {}).get("nodeName")
            if node:
                self.node[name] = node
            # As the operator reads it: the kubelet's phase.
            phase = read_pod_state(obj).phase
            if self.phase.get(name, (0.0, ""))[1] != phase:
                self.phase[name] = (t, phase)

    def first_created(self) -> float:
        with self.lock:
            return min(self.created.values())

    def all_succeeded(self) -> float:
        """When the watch brought the last pod's Succeeded (its containers all exited 0)."""
        with self.lock:
            return max(t for t, phase in self.phase.values() if phase == "Succeeded")

    def nodes(self) -> list[str]:
        with self.lock:
            return [self.node.get(name, "?") for name in self.names]


def log_tails(cluster: Cluster, namespace: str, pods: list[str]) -> str:
    """The last lines of each pod's log, for an error message."""
    tails = []
    for pod in pods:
        try:
            text = cluster.core.read_namespaced_pod_log(pod, namespace, container="trainer",
                                                        tail_lines=15)
        except Exception as error:  # noqa: BLE001 (diagnostics only)
            text = f"(no log: {error})"
        tails.append(f"--- {pod}\n{text}")
    return "\n".join(tails)


@contextlib.contextmanager
def watching(cluster: Cluster, namespace: str, kinds: tuple[str, ...],
             on_event: Callable[[float, str, str, dict], None], follow_pod: str,
             on_line: Callable[[float, str], None]) -> Iterator[None]:
    """Watch the leg's namespace, follow follow_pod's trainer log from its first event on, and
    on the way out stop both and delete the namespace."""
    followers: dict[str, LogFollower] = {}

    def dispatch(t: float, kind: str, typ: str, obj: dict) -> None:
        on_event(t, kind, typ, obj)
        if kind == "pods" and obj["metadata"]["name"] == follow_pod and not followers:
            followers[follow_pod] = LogFollower(cluster, namespace, follow_pod, "trainer", on_line)
            followers[follow_pod].start()

    watchers = start_watchers(cluster, namespace, dispatch, kinds=kinds)
    try:
        yield
    finally:
        for follower in followers.values():
            follower.stop()
        stop_watchers(watchers)
        cluster.delete_namespace(namespace, wait=True)


def operator_leg(cluster: Cluster, args: argparse.Namespace) -> dict:
    namespace = cluster.create_namespace("bench-overhead")
    job = example_job(namespace, "cpu-ddp", args.max_steps, [f"--log-every={args.log_every}"])
    if args.fast_exit:
        container = job["spec"]["template"]["spec"]["containers"][0]
        container["env"] = [*container.get("env", []),
                            {"name": ENV_FAST_EXIT, "value": "1"}]
    leg = Leg()
    pods = PodTimes(["cpu-ddp-0", "cpu-ddp-1"])
    finished = threading.Event()
    phase: dict[str, float | str] = {}

    def on_event(t: float, kind: str, typ: str, obj: dict) -> None:
        if kind == "pods":
            pods.on_pod(t, typ, obj)
        if kind == "acceleratejobs" and typ != "DELETED":
            current = (obj.get("status") or {}).get("phase")
            if current in ("Succeeded", "Failed") and "end" not in phase:
                phase.update(end=t, phase=current)
                finished.set()

    with watching(cluster, namespace, ("acceleratejobs", "pods"), on_event, "cpu-ddp-0",
                  leg.on_line):
        t0 = time.monotonic()
        cluster.create_job(job)
        if not finished.wait(args.timeout):
            raise TimeoutError(f"operator leg: no Succeeded within {args.timeout}s; "
                               f"log tail: {leg.tail}")
        if phase["phase"] != "Succeeded":
            raise RuntimeError(f"operator leg: the job {phase['phase']}; "
                               f"{log_tails(cluster, namespace, pods.names)}")
        time.sleep(0.2)  # the last log lines
        return leg.figures(t0, float(phase["end"]), args.max_steps, pods.first_created(),
                           pods.nodes(), pods.all_succeeded())


def crash_leg(cluster: Cluster, args: argparse.Namespace) -> dict:
    """One job whose rank 0 dies at step --crash-at-step in its first attempt (train.py's
    --fail-at-step: os._exit(1), like a killed process): the `FAILING` line's arrival -> the
    first pod Failed (the launcher sees it, stops the other ranks and exits; the kubelet
    reports) -> the job Restarting (the operator). The job is deleted once Restarting."""
    namespace = cluster.create_namespace("bench-crash")
    job = example_job(namespace, "crash", args.crash_at_step + 20, [
        f"--log-every={args.log_every}", f"--fail-at-step={args.crash_at_step}",
        "--fail-rank=0", "--fail-attempt=0"])
    names = ["crash-0", "crash-1"]
    marks: dict[str, float] = {}
    restarting = threading.Event()

    def on_line(t: float, line: str) -> None:
        if line.startswith("FAILING on purpose"):
            marks.setdefault("crash", t)

    def on_event(t: float, kind: str, typ: str, obj: dict) -> None:
        if kind == "pods":
            # As the operator reads it: Failed once the kubelet reports the containers ended.
            if typ != "DELETED" and read_pod_state(obj).phase == "Failed":
                marks.setdefault("pod_failed", t)
        elif kind == "acceleratejobs" and typ != "DELETED":
            current = (obj.get("status") or {}).get("phase")
            if current == "Restarting":
                marks.setdefault("restarting", t)
                restarting.set()
            elif current in ("Succeeded", "Failed"):
                marks.setdefault("ended", t)
                restarting.set()

    with watching(cluster, namespace, ("acceleratejobs", "pods"), on_event, names[0], on_line):
        cluster.create_job(job)
        if not restarting.wait(args.timeout):
            raise TimeoutError(f"crash leg: not Restarting within {args.timeout}s; "
                               f"{log_tails(cluster, namespace, names)}")
        if "restarting" not in marks or "crash" not in marks or "pod_failed" not in marks:
            raise RuntimeError(f"crash leg: saw {sorted(marks)}, not FAILING -> pod Failed -> "
                               f"Restarting; {log_tails(cluster, namespace, names)}")
        return {
            "crash_to_restarting_s": marks["restarting"] - marks["crash"],
            "crash_to_pod_failed_s": marks["pod_failed"] - marks["crash"],
            "pod_failed_to_restarting_s": marks["restarting"] - marks["pod_failed"],
        }


def schedulable_nodes(cluster: Cluster) -> list[str]:
    """Ready nodes that take pods, by name."""
    names = []
    for node in cluster.core.list_node().items:
        ready = any(c.type == "Ready" and c.status == "True"
                    for c in (node.status.conditions or []))
        if ready and not node.spec.unschedulable:
            names.append(node.metadata.name)
    return sorted(names)


def bare_objects(namespace: str, args: argparse.Namespace, nodes: list[str]
                 ) -> tuple[dict, dict, list[dict]]:
    """The ConfigMap, headless Service and pods of a bare run: the operator's builders over the
    same job body, the benchmark's labels, and `accelerate launch` as the container's command."""
    body = example_job(namespace, "bare", args.max_steps, [f"--log-every={args.log_every}"])
    job = parse_job(body)
    config = render_accelerate_config(job, dict(job.accelerate_config or {}))
    labels = {BARE_LABEL: job.name, BENCH_LABEL: "true"}

    def own(obj: dict) -> dict:
        obj["metadata"]["labels"] = dict(labels)
        obj["metadata"].pop("ownerReferences", None)
        return obj

    configmap = own(build_configmap(job, config))
    service = own(build_service(job))
    service["spec"]["selector"] = {BARE_LABEL: job.name}
    pods = []
    for index in range(job.num_nodes):
        pod = own(build_pod(job, index, attempt=0))
        container = pod["spec"]["containers"][0]
        topology = Topology(master_addr=master_address(job.name), master_port=job.master_port,
                            node_rank=index, num_nodes=job.num_nodes,
                            nproc_per_node=job.nproc_per_node, world_size=job.world_size,
                            config_file=CONFIG_FILE)
        plan = build_launch_plan(topology, config, list(container.get("args") or []))
        container["command"] = list(plan.argv)
        container["args"] = []
        container["env"] = list(container.get("env") or []) + [
            {"name": name, "value": value} for name, value in plan.env.items()]
        pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": nodes[index % len(nodes)]}
        pods.append(pod)
    return configmap, service, pods


def bare_leg(cluster: Cluster, args: argparse.Namespace) -> dict:
    """Two plain pods running `accelerate launch`, one per node."""
    nodes = schedulable_nodes(cluster)
    if len(nodes) < 2:
        print(f"  (only {len(nodes)} schedulable node(s): the bare pods share one)", flush=True)
    namespace = cluster.create_namespace("bench-bare")
    configmap, service, pod_bodies = bare_objects(namespace, args, nodes)
    names = [p["metadata"]["name"] for p in pod_bodies]
    leg = Leg()
    pods = PodTimes(names)
    finished = threading.Event()
    outcome: dict[str, float | str] = {}

    def on_event(t: float, kind: str, typ: str, obj: dict) -> None:
        pods.on_pod(t, typ, obj)
        with pods.lock:
            phases = {pod: phase for pod, (_, phase) in pods.phase.items()}
            if "end" in outcome:
                return
            if "Failed" in phases.values():
                outcome.update(end=t, phase="Failed")
                finished.set()
            elif len(phases) == len(names) and set(phases.values()) == {"Succeeded"}:
                outcome.update(end=max(at for at, _ in pods.phase.values()), phase="Succeeded")
                finished.set()

    with watching(cluster, namespace, ("pods",), on_event, names[0], leg.on_line):
        t0 = time.monotonic()
        cluster.core.create_namespaced_config_map(namespace, configmap)
        cluster.core.create_namespaced_service(namespace, service)
        for pod in pod_bodies:
            cluster.core.create_namespaced_pod(namespace, pod)
        if not finished.wait(args.timeout):
            raise TimeoutError(f"bare leg: pods not Succeeded within {args.timeout}s; "
                               f"{log_tails(cluster, namespace, names)}")
        if outcome["phase"] != "Succeeded":
            raise RuntimeError(f"bare leg: a pod failed; {log_tails(cluster, namespace, names)}")
        time.sleep(0.2)  # the last log lines
        return leg.figures(t0, float(outcome["end"]), args.max_steps, pods.first_created(),
                           pods.nodes(), pods.all_succeeded())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=200,
                        help="optimizer steps per leg (the tiny model does ~15/s on 2 cores)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--crash-runs", type=int, default=2,
                        help="jobs whose rank 0 crashes, timed crash -> Restarting (0: none)")
    parser.add_argument("--crash-at-step", type=int, default=5)
    parser.add_argument("--fast-exit", action="store_true",
                        help=f"the operator's job opts into fast_exit ({ENV_FAST_EXIT}=1)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", default=os.environ.get("BENCH_JSON"))
    args = parser.parse_args(argv)

    cluster = Cluster()
    wait_for_cluster(cluster)
    delete_leftovers(cluster)
    print(f"overhead: {args.pairs} pairs (operator, then bare) of train.py --max-steps="
          f"{args.max_steps}, world size 4 on CPU, 2 pods of the trainer image; operator's job "
          f"{'with' if args.fast_exit else 'without'} fast_exit; {machine_line()}", flush=True)
    pairs = []
    for i in range(args.pairs):
        op = resilient(cluster, f"pair {i + 1} operator leg",
                       lambda: operator_leg(cluster, args))
        print(f"  pair {i + 1} operator: {op['steps_per_s']:.3f} steps/s, step 1 after "
              f"{op['to_step1_s']:.1f}s ({op['pod_to_step1_s']:.1f}s from pod created), wall "
              f"{op['wall_s']:.1f}s, nodes {','.join(op['nodes'])}; last step -> Succeeded "
              f"{op['last_step_to_end_s']:.2f}s (-> pods done {op['last_step_to_pods_done_s']:.2f}s"
              f", pods done -> job Succeeded {op['pods_done_to_end_s']:.2f}s); {machine_line()}",
              flush=True)
        bare = resilient(cluster, f"pair {i + 1} bare leg", lambda: bare_leg(cluster, args))
        print(f"  pair {i + 1} bare:     {bare['steps_per_s']:.3f} steps/s, step 1 after "
              f"{bare['to_step1_s']:.1f}s ({bare['pod_to_step1_s']:.1f}s from pod created), wall "
              f"{bare['wall_s']:.1f}s, nodes {','.join(bare['nodes'])}; last step -> pods "
              f"Succeeded {bare['last_step_to_end_s']:.2f}s; {machine_line()}",
              flush=True)
        pairs.append({"operator": op, "bare": bare,
                      "steps_ratio": op["steps_per_s"] / bare["steps_per_s"],
                      "wall_ratio": op["wall_s"] / bare["wall_s"],
                      "step1_ratio": op["to_step1_s"] / bare["to_step1_s"],
                      "pod_step1_ratio": op["pod_to_step1_s"] / bare["pod_to_step1_s"]})
    summary = {
        "fast_exit": args.fast_exit,
        "pairs": pairs,
        "steps_ratio_median": median(p["steps_ratio"] for p in pairs),
        "wall_ratio_median": median(p["wall_ratio"] for p in pairs),
        "step1_ratio_median": median(p["step1_ratio"] for p in pairs),
        "pod_step1_ratio_median": median(p["pod_step1_ratio"] for p in pairs),
        "operator_pod_to_step1_median_s": median(p["operator"]["pod_to_step1_s"] for p in pairs),
        "bare_pod_to_step1_median_s": median(p["bare"]["pod_to_step1_s"] for p in pairs),
        "operator_steps_per_s_median": median(p["operator"]["steps_per_s"] for p in pairs),
        "bare_steps_per_s_median": median(p["bare"]["steps_per_s"] for p in pairs),
        "operator_wall_median_s": median(p["operator"]["wall_s"] for p in pairs),
        "bare_wall_median_s": median(p["bare"]["wall_s"] for p in pairs),
        "operator_last_step_to_succeeded_median_s": median(
            p["operator"]["last_step_to_end_s"] for p in pairs),
        "operator_pods_done_to_succeeded_median_s": median(
            p["operator"]["pods_done_to_end_s"] for p in pairs),
        "bare_last_step_to_pods_done_median_s": median(
            p["bare"]["last_step_to_end_s"] for p in pairs),
        "end_added_median_s": median(p["operator"]["last_step_to_end_s"]
                                     - p["bare"]["last_step_to_end_s"] for p in pairs),
    }
    crashes = []
    for i in range(args.crash_runs):
        crash = resilient(cluster, f"crash {i + 1}", lambda: crash_leg(cluster, args))
        print(f"  crash {i + 1}: rank 0 FAILING -> job Restarting "
              f"{crash['crash_to_restarting_s']:.2f}s (-> first pod Failed "
              f"{crash['crash_to_pod_failed_s']:.2f}s, pod Failed -> Restarting "
              f"{crash['pod_failed_to_restarting_s']:.2f}s); {machine_line()}", flush=True)
        crashes.append(crash)
    if crashes:
        summary["crashes"] = crashes
        summary["crash_to_restarting_median_s"] = median(
            c["crash_to_restarting_s"] for c in crashes)
        summary["crash_to_pod_failed_median_s"] = median(
            c["crash_to_pod_failed_s"] for c in crashes)
    per_pair = ", ".join(f"{p['steps_ratio']:.3f}" for p in pairs)
    print(f"overhead: steps/s operator/bare = {summary['steps_ratio_median']:.3f} (median of "
          f"pairs {per_pair}; target >= 0.98); "
          f"wall operator/bare = {summary['wall_ratio_median']:.2f} "
          f"({summary['operator_wall_median_s']:.1f}s vs {summary['bare_wall_median_s']:.1f}s); "
          f"time to step 1 operator/bare = {summary['step1_ratio_median']:.2f}; "
          f"pod created -> step 1 operator/bare = {summary['pod_step1_ratio_median']:.2f} "
          f"({summary['operator_pod_to_step1_median_s']:.1f}s vs "
          f"{summary['bare_pod_to_step1_median_s']:.1f}s)")
    print(f"overhead: last step -> job Succeeded "
          f"{summary['operator_last_step_to_succeeded_median_s']:.2f}s "
          f"({'with' if args.fast_exit else 'without'} fast_exit), of which last pod Succeeded "
          f"-> job Succeeded {summary['operator_pods_done_to_succeeded_median_s']:.2f}s; bare: "
          f"last step -> pods Succeeded {summary['bare_last_step_to_pods_done_median_s']:.2f}s; "
          f"operator - bare {summary['end_added_median_s']:+.2f}s (median of pairs)")
    if crashes:
        print(f"overhead: crash -> job Restarting {summary['crash_to_restarting_median_s']:.2f}s "
              f"(median of {len(crashes)}), of which crash -> first pod Failed "
              f"{summary['crash_to_pod_failed_median_s']:.2f}s")
    print(f"  {machine_line()}")
    emit_result("overhead", summary, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
