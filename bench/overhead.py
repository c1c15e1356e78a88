"""Overhead of the operator on training: the same run of examples/train.py (world size 4 on CPU)
through an AccelerateJob (2 nodes x 2 processes) and as two bare `accelerate launch` processes on
this machine (machine_rank 0 and 1, master 127.0.0.1), alternated pair by pair in one session.

The bare launches use exactly what the operator's pods use: the accelerate config rendered by the
operator's own builder (the ConfigMap's content), the argv from accelerate_trainer's
build_launch_plan (ACCELERATE_USE_CPU=1 plus --multi_gpu for MULTI_CPU), the topology env of
build_topology_env, and the example container's env (OMP_NUM_THREADS=1, offline HF).

Per leg: steps/s between `STEP step=1` and the last STEP line (rank 0's log, timed on arrival;
pod logs are read from the local node agent's files every 20 ms, bare stdout through a pipe),
time to step 1, and wall time: create -> job Succeeded for the operator, spawn -> both launchers
exited for bare. Ratios operator/bare are per pair, then the median over pairs.

Usage: python bench/overhead.py [--pairs 3] [--max-steps 200] [--json results.jsonl]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from accelerate_operator.api import parse_job
from accelerate_operator.resources.configmap import render_accelerate_config
from accelerate_operator.resources.pods import build_topology_env
from accelerate_trainer.command import build_launch_plan
from accelerate_trainer.topology import Topology
from common import (
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
from startup import ensure_training_script, example_job


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

    def figures(self, t0: float, end: float, max_steps: int) -> dict:
        with self.lock:
            first, last = self.steps[1], self.steps[max(self.steps)]
            if max(self.steps) != max_steps:
                raise RuntimeError(f"the last STEP line is step {max(self.steps)}, not {max_steps}")
            return {
                "steps_per_s": (max_steps - 1) / (last - first),
                "to_step1_s": first - t0,
                "wall_s": end - t0,
                "ranks": len(self.ranks),
            }


def operator_leg(cluster: Cluster, args: argparse.Namespace) -> dict:
    namespace = cluster.create_namespace("bench-overhead")
    job = example_job(namespace, "cpu-ddp", args.max_steps, [f"--log-every={args.log_every}"])
    leg = Leg()
    finished = threading.Event()
    phase: dict[str, float | str] = {}
    followers: dict[str, LogFollower] = {}

    def on_event(t: float, kind: str, typ: str, obj: dict) -> None:
        name = obj["metadata"]["name"]
        if kind == "pods" and name == "cpu-ddp-0" and name not in followers:
            followers[name] = LogFollower(cluster, namespace, name, "trainer", leg.on_line)
            followers[name].start()
        if kind == "acceleratejobs" and typ != "DELETED":
            current = (obj.get("status") or {}).get("phase")
            if current in ("Succeeded", "Failed") and "end" not in phase:
                phase.update(end=t, phase=current)
                finished.set()

    watchers = start_watchers(cluster, namespace, on_event, kinds=("acceleratejobs", "pods"))
    try:
        t0 = time.monotonic()
        cluster.create_job(job)
        if not finished.wait(args.timeout):
            raise TimeoutError(f"operator leg: no Succeeded within {args.timeout}s; "
                               f"log tail: {leg.tail}")
        if phase["phase"] != "Succeeded":
            raise RuntimeError(f"operator leg: the job {phase['phase']}; log tail: {leg.tail}")
        time.sleep(0.2)  # the last log lines
        return leg.figures(t0, float(phase["end"]), args.max_steps)
    finally:
        for follower in followers.values():
            follower.stop()
        stop_watchers(watchers)
        cluster.delete_namespace(namespace, wait=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bare_leg(args: argparse.Namespace, workdir: Path) -> dict:
    """Two `accelerate launch` processes, built exactly as the pods build theirs."""
    body = example_job("bare", "cpu-ddp", args.max_steps, [f"--log-every={args.log_every}"])
    job = parse_job(body)
    config = render_accelerate_config(job, dict(job.accelerate_config or {}))
    config["main_process_port"] = port = free_port()
    config_file = workdir / "accelerate-config.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    container = job.template["spec"]["containers"][0]
    script = list(container["args"])  # /opt/accelerate/examples/train.py and its flags
    container_env = {e["name"]: e["value"] for e in container.get("env") or []}

    leg = Leg()
    procs = []
    t0 = time.monotonic()
    for rank in range(job.num_nodes):
        topology = Topology(master_addr="127.0.0.1", master_port=port, node_rank=rank,
                            num_nodes=job.num_nodes, nproc_per_node=job.nproc_per_node,
                            world_size=job.world_size, config_file=str(config_file))
        plan = build_launch_plan(topology, config, script)
        env = {**os.environ, **container_env,
               **{e["name"]: e["value"] for e in build_topology_env(job, rank)},
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "ACCELERATE_CONFIG_FILE": str(config_file), **plan.env,
               # The node agent puts the venv first on the pods' PATH: `accelerate` is there.
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        proc = subprocess.Popen(list(plan.argv), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, cwd=workdir)
        procs.append(proc)

    def read(proc: subprocess.Popen) -> None:
        for raw in proc.stdout:
            leg.on_line(time.monotonic(), raw.decode(errors="replace").rstrip("\n"))

    readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in procs]
    for reader in readers:
        reader.start()
    try:
        codes = [p.wait(timeout=args.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    end = time.monotonic()
    for reader in readers:
        reader.join(timeout=5)
    if any(codes):
        raise RuntimeError(f"bare leg: exit codes {codes}; log tail: {leg.tail}")
    return leg.figures(t0, end, args.max_steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=200,
                        help="optimizer steps per leg (the tiny model does ~15/s on 2 cores)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", default=os.environ.get("BENCH_JSON"))
    args = parser.parse_args(argv)

    ensure_training_script()
    cluster = Cluster()
    wait_for_cluster(cluster)
    delete_leftovers(cluster)
    print(f"overhead: {args.pairs} pairs (operator, then bare) of train.py --max-steps="
          f"{args.max_steps}, world size 4 on CPU; {machine_line()}", flush=True)
    pairs = []
    with tempfile.TemporaryDirectory(prefix="bench-bare-") as tmp:
        for i in range(args.pairs):
            op = resilient(cluster, f"pair {i + 1} operator leg",
                           lambda: operator_leg(cluster, args))
            print(f"  pair {i + 1} operator: {op['steps_per_s']:.3f} steps/s, step 1 after "
                  f"{op['to_step1_s']:.1f}s, wall {op['wall_s']:.1f}s; {machine_line()}",
                  flush=True)
            bare = bare_leg(args, Path(tmp))
            print(f"  pair {i + 1} bare:     {bare['steps_per_s']:.3f} steps/s, step 1 after "
                  f"{bare['to_step1_s']:.1f}s, wall {bare['wall_s']:.1f}s; {machine_line()}",
                  flush=True)
            pairs.append({"operator": op, "bare": bare,
                          "steps_ratio": op["steps_per_s"] / bare["steps_per_s"],
                          "wall_ratio": op["wall_s"] / bare["wall_s"],
                          "step1_ratio": op["to_step1_s"] / bare["to_step1_s"]})
    summary = {
        "pairs": pairs,
        "steps_ratio_median": median(p["steps_ratio"] for p in pairs),
        "wall_ratio_median": median(p["wall_ratio"] for p in pairs),
        "step1_ratio_median": median(p["step1_ratio"] for p in pairs),
        "operator_steps_per_s_median": median(p["operator"]["steps_per_s"] for p in pairs),
        "bare_steps_per_s_median": median(p["bare"]["steps_per_s"] for p in pairs),
        "operator_wall_median_s": median(p["operator"]["wall_s"] for p in pairs),
        "bare_wall_median_s": median(p["bare"]["wall_s"] for p in pairs),
    }
    per_pair = ", ".join(f"{p['steps_ratio']:.3f}" for p in pairs)
    print(f"overhead: steps/s operator/bare = {summary['steps_ratio_median']:.3f} (median of "
          f"pairs {per_pair}; target >= 0.98); "
          f"wall operator/bare = {summary['wall_ratio_median']:.2f} "
          f"({summary['operator_wall_median_s']:.1f}s vs {summary['bare_wall_median_s']:.1f}s); "
          f"time to step 1 operator/bare = {summary['step1_ratio_median']:.2f}")
    print(f"  {machine_line()}")
    emit_result("overhead", summary, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
