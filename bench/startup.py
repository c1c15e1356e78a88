"""Startup latency of the CPU example (examples/cpu-ddp.yaml), stage by stage.

Each run creates the job in a fresh namespace and times, from just before the create call:
  children   the ConfigMap, the Service and every pod exist (watch ADDED events)
  scheduled  every pod is bound to a node
  running    every pod is in phase Running
  launch     every pod's accelerate-trainer logged its `accelerate launch` line (config checked,
             master reachable: it execs accelerate launch next)
  ranks      every rank printed RANK_INFO (its process group is up; world size ranks in total)
  step1      rank 0 printed `STEP step=1`: the first optimizer step is done on EVERY rank, since
             that line follows a collective (accelerator.reduce) all ranks take part in
Stages are reported as increments (children, scheduled-children, ...) with their share of the
total, median and worst over the runs. The example's --max-steps is lowered to 1 (the first step
is what is timed). The pods run the trainer image on the cluster's nodes; their logs are read
from the nodes' kubelet log files (common.LogFollower). Usage: python bench/startup.py [--runs 5]
[--json results.jsonl]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import threading
import time

import yaml
from common import (
    ROOT,
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

EXAMPLE = ROOT / "examples" / "cpu-ddp.yaml"
STAGES = ("children", "scheduled", "running", "launch", "ranks", "step1")


def example_job(namespace: str, name: str, max_steps: int | None, extra_args: list[str]) -> dict:
    body = yaml.safe_load(EXAMPLE.read_text())
    body = copy.deepcopy(body)
    body["metadata"] = {"name": name, "namespace": namespace}
    container = body["spec"]["template"]["spec"]["containers"][0]
    args = list(container.get("args") or [])
    if max_steps is not None:
        args = [a for a in args if not a.startswith("--max-steps")] + [f"--max-steps={max_steps}"]
    container["args"] = args + list(extra_args)
    return body


class StartupRun:
    """Collects the arrival time of every milestone of one job."""

    def __init__(self, cluster: Cluster, namespace: str, job: dict):
        self.cluster, self.namespace, self.job = cluster, namespace, job
        self.name = job["metadata"]["name"]
        spec = job["spec"]
        self.num_nodes = int(spec["numNodes"])
        self.world_size = self.num_nodes * int(spec["numProcPerNode"])
        self.pods = {f"{self.name}-{i}" for i in range(self.num_nodes)}
        self.seen: dict[str, float] = {}  # "configmap", "service", "pod/<name>", ...
        self.rank_lines: dict[str, float] = {}
        self.launch_lines: dict[str, float] = {}
        self.master_wait_s = 0.0  # how long node 1+ waited for the master's port (its own log)
        self.step1: float | None = None
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.followers: dict[str, LogFollower] = {}

    def on_event(self, t: float, kind: str, typ: str, obj: dict) -> None:
        if typ == "DELETED":
            return
        name = obj["metadata"]["name"]
        with self.lock:
            if kind == "configmaps" and name.startswith(self.name):
                self.seen.setdefault("configmap", t)
            elif kind == "services" and name == self.name:
                self.seen.setdefault("service", t)
            elif kind == "pods" and name in self.pods:
                self.seen.setdefault(f"pod/{name}", t)
                if (obj.get("spec") or {}).get("nodeName"):
                    self.seen.setdefault(f"scheduled/{name}", t)
                if (obj.get("status") or {}).get("phase") == "Running":
                    self.seen.setdefault(f"running/{name}", t)
                if name not in self.followers:
                    follower = LogFollower(self.cluster, self.namespace, name, "trainer",
                                           lambda t, line, pod=name: self.on_line(pod, t, line))
                    self.followers[name] = follower
                    follower.start()

    def on_line(self, pod: str, t: float, line: str) -> None:
        with self.lock:
            if line.startswith("accelerate-trainer: node "):
                self.launch_lines.setdefault(pod, t)
            elif "to accept connections: ok after " in line:
                waited = float(line.rsplit("ok after ", 1)[1].rstrip("s"))
                self.master_wait_s = max(self.master_wait_s, waited)
            elif line.startswith("RANK_INFO "):
                rank = line.split("rank=", 1)[1].split()[0]
                self.rank_lines.setdefault(rank, t)
            elif line.startswith("STEP step=1 ") and self.step1 is None:
                self.step1 = t
                self.done.set()
            elif line.startswith("Traceback") or "Error" in line[:40]:
                sys.stderr.write(f"  [{self.name}] {line}\n")

    def milestones(self, t0: float) -> dict[str, float]:
        with self.lock:
            def latest(prefix: str) -> float:
                return max(self.seen[f"{prefix}/{pod}"] for pod in self.pods) - t0

            children = max([self.seen["configmap"], self.seen["service"]] +
                           [self.seen[f"pod/{pod}"] for pod in self.pods]) - t0
            return {
                "children": children,
                "scheduled": latest("scheduled"),
                "running": latest("running"),
                "launch": max(self.launch_lines.values()) - t0,
                "ranks": max(self.rank_lines.values()) - t0,
                "step1": self.step1 - t0,
                "master_wait": self.master_wait_s,
            }

    def stop(self) -> None:
        for follower in self.followers.values():
            follower.stop()


def run_once(cluster: Cluster, index: int, args: argparse.Namespace) -> dict[str, float]:
    namespace = cluster.create_namespace("bench-startup")
    job = example_job(namespace, "cpu-ddp", args.max_steps, args.extra_arg)
    run = StartupRun(cluster, namespace, job)
    watchers = start_watchers(cluster, namespace, run.on_event,
                              kinds=("configmaps", "services", "pods"))
    try:
        t0 = time.monotonic()
        cluster.create_job(job)
        if not run.done.wait(args.timeout):
            raise TimeoutError(f"run {index}: no `STEP step=1` within {args.timeout}s; "
                               f"milestones so far: {sorted(run.seen)}, ranks {run.rank_lines}")
        # RANK_INFO lines of the other node may still be in flight: a short grace.
        deadline = time.monotonic() + 5
        while len(run.rank_lines) < run.world_size and time.monotonic() < deadline:
            time.sleep(0.05)
        if len(run.rank_lines) < run.world_size:
            raise RuntimeError(f"run {index}: only ranks {sorted(run.rank_lines)} logged RANK_INFO")
        result = run.milestones(t0)
    finally:
        run.stop()
        stop_watchers(watchers)
        if not args.keep:
            cluster.delete_namespace(namespace, wait=True, timeout=120)
    return result


def summarise(runs: list[dict[str, float]]) -> dict:
    increments = []
    for run in runs:
        previous, inc = 0.0, {}
        for stage in STAGES:
            inc[stage] = run[stage] - previous
            previous = run[stage]
        increments.append(inc)
    totals = [run["step1"] for run in runs]
    total_median = median(totals)
    stages = {}
    for stage in STAGES:
        values = [inc[stage] for inc in increments]
        stages[stage] = {"median_s": median(values), "worst_s": max(values),
                         "share_of_median_total": median(values) / total_median}
    return {"runs": len(runs), "total_median_s": total_median, "total_worst_s": max(totals),
            "children_median_ms": median(r["children"] for r in runs) * 1000,
            "master_wait_median_s": median(r["master_wait"] for r in runs),
            "stages": stages, "raw": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=1,
                        help="override the example's --max-steps (default 1: only step 1 is timed)")
    parser.add_argument("--extra-arg", action="append", default=[],
                        help="another argument for train.py (repeatable)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--keep", action="store_true", help="keep the namespaces")
    parser.add_argument("--json", default=os.environ.get("BENCH_JSON"),
                        help="append the result as a JSON line to this file")
    args = parser.parse_args(argv)

    cluster = Cluster()
    print(f"startup: {args.runs} runs of {EXAMPLE.relative_to(ROOT)} (--max-steps={args.max_steps})"
          f"; {machine_line()}", flush=True)
    runs = []
    wait_for_cluster(cluster)
    delete_leftovers(cluster)
    for i in range(args.runs):
        result = resilient(cluster, f"run {i + 1}", lambda i=i: run_once(cluster, i, args))
        runs.append(result)
        print(f"  run {i + 1}: " + "  ".join(f"{s}={result[s]:.2f}s" for s in STAGES)
              + f"  (node 1 waited {result['master_wait']:.1f}s for the master's port)",
              flush=True)

    summary = summarise(runs)
    print(f"startup: create -> first step on every rank: median {summary['total_median_s']:.2f}s, "
          f"worst {summary['total_worst_s']:.2f}s; create -> all children: median "
          f"{summary['children_median_ms']:.0f} ms")
    print(f"  {'stage':<24} {'median':>8} {'worst':>8} {'share':>7}")
    labels = {"children": "create -> children", "scheduled": "children -> scheduled",
              "running": "scheduled -> Running", "launch": "Running -> launch exec",
              "ranks": "launch -> all RANK_INFO",
              "step1": "RANK_INFO -> STEP 1"}
    for stage in STAGES:
        s = summary["stages"][stage]
        print(f"  {labels[stage]:<24} {s['median_s']:7.2f}s {s['worst_s']:7.2f}s "
              f"{s['share_of_median_total'] * 100:6.1f}%")
    print(f"  within 'launch': non-master nodes wait for the master's port (it opens once node 0's "
          f"accelerate launch is up): median {summary['master_wait_median_s']:.1f}s")
    print(f"  {machine_line()}")
    emit_result("startup", summary, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
