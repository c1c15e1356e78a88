"""What a fault costs a training job, side by side: the same image, script and world size (the CPU
example, 2 nodes x 2 processes, a checkpoint every 10 steps, --sleep-per-step so a step takes
about 0.2 s) on our two nodes, as an AccelerateJob and as a Kubeflow PyTorchJob run by the Go
training-operator (v1.9.4, built and run as bench/kubeflow_compare.py does) in its best documented
setup for this: torchrun with elasticPolicy (c10d rendezvous, maxRestarts), restartPolicy
OnFailure, ACCELERATE_USE_CPU=1 so that accelerate really distributes on CPU, and `--resume-from
latest` so each restarted process resumes from the newest complete checkpoint.

Faults (--faults; one job at a time, ours first):
  crash   rank 3 exits 1 once, at step --fault-step (the example's --fail-at-step)
  delete  the pod of node 1 is deleted once step --fault-step is seen (its grace period as set)
  node    the last node by name (with a CoreDNS replica) loses power once step --fault-step is seen
          (hack/local-cluster.sh node-kill: link down, every process killed), restored after

Measured from the kubelets' own log files (the CRI timestamp of every line, read while written,
so the lines of a pod deleted later are kept): apply -> rank 0's first STEP line; the longest
time between two consecutive STEP lines (the time with no step running); the STEP lines of a
step already trained (steps computed twice). For our job also the status's goodput, beside the
same figure computed from these timings. A run with no step --give-up seconds after the fault
says so.

Usage: python bench/recovery.py [--faults crash,delete,node] [--systems ours,kubeflow]
       [--fault-step 30] [--max-steps 80] [--give-up 240] [--logs DIR]
"""

from __future__ import annotations

import argparse
import copy
import glob
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import yaml
from common import NODES_DIR, ROOT, Cluster, emit_result, machine_line, parse_cri_line, wait_until
from kubeflow_compare import GoOperator, Setup, build
from kubernetes.client.rest import ApiException
from startup import EXAMPLE

LOCAL_CLUSTER = str(ROOT / "hack" / "local-cluster.sh")
SCRIPT = "/opt/accelerate/examples/train.py"
STEP_LINE = re.compile(r"^STEP step=(\d+)\b")
KF_GROUP, KF_VERSION, KF_PLURAL = "kubeflow.org", "v1", "pytorchjobs"
OPERATOR_NAMESPACE = "accelerate-system"


# ------------------------------------------------------------------ what the logs say
@dataclass
class Timeline:
    """Every STEP line of the job's containers, with the kubelet's time for it."""

    steps: list[tuple[float, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, when: float, step: int) -> None:
        with self.lock:
            self.steps.append((when, step))

    def sorted(self) -> list[tuple[float, int]]:
        with self.lock:
            return sorted(self.steps)

    def highest(self) -> int:
        with self.lock:
            return max((s for _, s in self.steps), default=0)

    def figures(self, applied: float) -> dict:
        """First step after `applied`, the longest time with no step, the steps trained twice."""
        steps = self.sorted()
        if not steps:
            return {"first_step_s": None, "no_step_s": None, "recomputed_steps": 0}
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(steps)]
        seen: set[int] = set()
        recomputed = 0
        for _, step in steps:
            recomputed += step in seen
            seen.add(step)
        return {"first_step_s": steps[0][0] - applied, "no_step_s": max(gaps, default=0.0),
                "recomputed_steps": recomputed, "last_step_at": steps[-1][0],
                "step_s": sorted(gaps)[len(gaps) // 2] if gaps else 0.0}


def _stamp(text: str) -> float:
    """A CRI timestamp (RFC 3339 with nanoseconds) as a Unix time."""
    head, _, frac = text.rstrip("Z").partition(".")
    return datetime.fromisoformat(head + "+00:00").timestamp() + float(f"0.{frac or 0}")


class LogCollector(threading.Thread):
    """Reads every container log file of one namespace on the local nodes as it grows."""

    def __init__(self, namespace: str, timeline: Timeline, poll: float = 0.1):
        super().__init__(daemon=True, name=f"logs-{namespace}")
        self.pattern = str(NODES_DIR / "*" / "log" / "pods" / f"{namespace}_*" / "*" / "*.log")
        self.timeline, self.poll = timeline, poll
        self.offsets: dict[str, int] = {}
        self.partial: dict[str, bytes] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for path in glob.glob(self.pattern):
                self._read(path)
            self.done.wait(self.poll)

    def _read(self, path: str) -> None:
        try:
            with open(path, "rb") as file:
                file.seek(self.offsets.get(path, 0))
                chunk = file.read()
        except OSError:
            return
        self.offsets[path] = self.offsets.get(path, 0) + len(chunk)
        *lines, self.partial[path] = (self.partial.get(path, b"") + chunk).split(b"\n")
        for raw in lines:
            text, _ = parse_cri_line(raw)
            match = STEP_LINE.match(text)
            if match:
                self.timeline.add(_stamp(raw.split(b" ", 1)[0].decode()), int(match.group(1)))


# ------------------------------------------------------------------ the two jobs
def _template(host_dir: str, job_label: str, name: str) -> dict:
    """The example's pod template, with the shared checkpoint folder and one pod per node where
    it can (a preference: after a node is lost, the job fits on the node left)."""
    body = yaml.safe_load(EXAMPLE.read_text())
    template = copy.deepcopy(body["spec"]["template"])
    spec = template["spec"]
    spec["volumes"].append({"name": "checkpoints",
                            "hostPath": {"path": host_dir, "type": "DirectoryOrCreate"}})
    spec["containers"][0]["volumeMounts"].append({"name": "checkpoints",
                                                  "mountPath": "/checkpoints"})
    spec["containers"][0]["env"].append({"name": "ACCELERATE_FAIL_ONCE_MARKER",
                                         "value": "/checkpoints/failed-once"})
    spec["affinity"] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                            "labelSelector": {"matchLabels": {job_label: name}}}}]}}
    return template


def script_args(args: argparse.Namespace, fault: str) -> list[str]:
    crash = [f"--fail-at-step={args.fault_step}", "--fail-rank=3"] if fault == "crash" else []
    return [f"--max-steps={args.max_steps}", "--log-every=1", "--checkpoint-every=10",
            f"--sleep-per-step={args.sleep_per_step}", *crash]


def our_job(namespace: str, name: str, host_dir: str, args: argparse.Namespace,
            fault: str) -> dict:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"] = {"name": name, "namespace": namespace}
    body["spec"]["template"] = _template(host_dir, "accelerate-operator.io/job-name", name)
    body["spec"]["template"]["spec"]["containers"][0]["args"] = [SCRIPT,
                                                                 *script_args(args, fault)]
    body["spec"]["checkpoint"] = {"volumeName": "checkpoints", "mountPath": "/checkpoints"}
    body["spec"]["runPolicy"] = {"backoffLimit": 3, "cleanPodPolicy": "None"}
    return body


def kubeflow_job(namespace: str, name: str, host_dir: str, args: argparse.Namespace,
                 fault: str) -> dict:
    template = _template(host_dir, "training.kubeflow.org/job-name", name)
    container = template["spec"]["containers"][0]
    container["name"] = "pytorch"  # the training-operator's container
    container["command"] = ["torchrun", SCRIPT]
    container["args"] = [*script_args(args, fault), "--resume-from=latest"]
    container["env"] += [{"name": "ACCELERATE_USE_CPU", "value": "1"},
                         {"name": "ACCELERATE_CHECKPOINT_DIR", "value": "/checkpoints"}]
    container["ports"] = [{"name": "pytorchjob-port", "containerPort": 29400}]
    return {
        "apiVersion": f"{KF_GROUP}/{KF_VERSION}", "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nprocPerNode": "2",
            "elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 2,
                              "maxRestarts": 3},
            "runPolicy": {"backoffLimit": 3, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": {"Worker": {"replicas": 2, "restartPolicy": "OnFailure",
                                               "template": template}},
        },
    }


@dataclass
class System:
    """How the bench drives one operator's job."""

    name: str
    build: object  # (namespace, name, host_dir, args, fault) -> dict
    victim_pod: str  # the pod of node 1, by job name
    label: str

    def create(self, cluster: Cluster, body: dict) -> None:
        if body["kind"] == "AccelerateJob":
            cluster.create_job(body)
        else:
            cluster.create_custom(body, KF_GROUP, KF_VERSION, KF_PLURAL)

    def read(self, cluster: Cluster, namespace: str, name: str) -> dict:
        if self.name == "ours":
            return cluster.job(namespace, name)
        return cluster.custom.get_namespaced_custom_object(KF_GROUP, KF_VERSION, namespace,
                                                           KF_PLURAL, name)

    def finished(self, job: dict) -> str | None:
        """Succeeded or Failed once the job says so, else None."""
        status = job.get("status") or {}
        if self.name == "ours":
            return status.get("phase") if status.get("phase") in ("Succeeded", "Failed") \
                else None
        for condition in status.get("conditions") or []:
            if condition["type"] in ("Succeeded", "Failed") and condition["status"] == "True":
                return condition["type"]
        return None


SYSTEMS = {
    "ours": System("ours", our_job, "{name}-1", "accelerate-operator.io/job-name"),
    "kubeflow": System("kubeflow", kubeflow_job, "{name}-worker-1",
                       "training.kubeflow.org/job-name"),
}


# ------------------------------------------------------------------ faults
def victim_node(cluster: Cluster) -> str:
    """The node a node fault takes: the last by name. CoreDNS runs a replica on each node, so
    the lost node takes one with it, as a real node loss would (the operator reaches the API
    server by address, not through DNS)."""
    return sorted(n.metadata.name for n in cluster.core.list_node().items)[-1]


def operator_off(cluster: Cluster, node: str) -> None:
    """Our operator's replicas leave `node` (the node fault is the job's, not the operator's;
    failover is measured elsewhere): cordon, delete them, wait for the replacements, uncordon."""
    cluster.kubectl("cordon", node)
    try:
        pods = cluster.core.list_namespaced_pod(OPERATOR_NAMESPACE).items
        for pod in pods:
            if pod.spec.node_name == node:
                cluster.core.delete_namespaced_pod(pod.metadata.name, OPERATOR_NAMESPACE)
        cluster.kubectl("-n", OPERATOR_NAMESPACE, "rollout", "status", "deployment",
                        "--timeout=300s", timeout=320)
    finally:
        cluster.kubectl("uncordon", node)


def restore_node(cluster: Cluster) -> None:
    subprocess.run([LOCAL_CLUSTER, "up"], check=True, capture_output=True, timeout=600)
    cluster.kubectl("-n", OPERATOR_NAMESPACE, "rollout", "status", "deployment",
                    "--timeout=300s", timeout=320)


def inflict(cluster: Cluster, fault: str, namespace: str, pod: str, node: str) -> None:
    if fault == "delete":
        cluster.core.delete_namespaced_pod(pod, namespace)
    elif fault == "node":
        subprocess.run([LOCAL_CLUSTER, "node-kill", node], check=True, capture_output=True,
                       timeout=120)


# ------------------------------------------------------------------ one run
def shared_dir() -> str:
    """A fresh host folder both local nodes mount (they share the host's disk, as pods share an
    NFS volume), writable by the image's non-root user."""
    path = Path(tempfile.gettempdir()) / f"accelerate-operator-recovery-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    path.chmod(0o777)
    return str(path)


def run_one(cluster: Cluster, args: argparse.Namespace, system: System, fault: str,
            node: str) -> dict:
    namespace = cluster.create_namespace(f"recovery-{system.name}-{fault}")
    name = "recovery"
    timeline = Timeline()
    collector = LogCollector(namespace, timeline)
    collector.start()
    body = system.build(namespace, name, shared_dir(), args, fault)
    applied = time.time()
    system.create(cluster, body)
    node_down = False
    try:
        wait_until(lambda: timeline.highest() >= args.fault_step, args.timeout,
                   f"{system.name}: step {args.fault_step}", interval=0.1)
        faulted = time.time()
        if fault == "node":
            node_down = True
        inflict(cluster, fault, namespace, system.victim_pod.format(name=name), node)
        outcome, job = _outcome(cluster, args, system, namespace, name, timeline, faulted)
    finally:
        if node_down:
            restore_node(cluster)
        collector.done.set()
        collector.join()
    result = {"system": system.name, "fault": fault, "outcome": outcome,
              **timeline.figures(applied)}
    if outcome.startswith("no step"):  # the gaps before the fault say nothing
        result["no_step_s"] = None
    if system.name == "ours":
        result.update(_goodput(job, result))
    if args.logs:
        save_logs(cluster, namespace, Path(args.logs) / f"{system.name}-{fault}")
    cluster.delete_namespace(namespace, wait=False)
    return result


def save_logs(cluster: Cluster, namespace: str, folder: Path) -> None:
    """Every pod's log as it is now, with the kubelet's timestamps, one file per pod, and the
    log of its container's previous run (`.previous.log`) when the kubelet restarted it."""
    folder.mkdir(parents=True, exist_ok=True)
    for pod in cluster.core.list_namespaced_pod(namespace).items:
        for previous, suffix in ((False, ".log"), (True, ".previous.log")):
            try:
                text = cluster.core.read_namespaced_pod_log(
                    pod.metadata.name, namespace, timestamps=True, previous=previous)
            except ApiException as error:
                text = f"(no log: {error.reason})"
            (folder / f"{pod.metadata.name}{suffix}").write_text(text)


def _outcome(cluster: Cluster, args: argparse.Namespace, system: System, namespace: str,
             name: str, timeline: Timeline, faulted: float) -> tuple[str, dict]:
    """Until the job finishes, or has shown no step for --give-up seconds after the fault."""
    while True:
        job = system.read(cluster, namespace, name)
        finished = system.finished(job)
        if finished:
            return finished, job
        last = timeline.sorted()[-1][0]
        if last < faulted and time.time() - faulted > args.give_up:
            return f"no step within {args.give_up:.0f}s of the fault", job
        if time.time() - faulted > args.timeout:
            return "timed out", job
        time.sleep(1.0)


def _goodput(job: dict, figures: dict) -> dict:
    """The status's goodput, and the same figure from the bench's timings: wall time from the
    job's creation to its completion, less the time to the first step, the time with no step
    and the steps trained twice."""
    status = job.get("status") or {}
    goodput = status.get("goodput") or {}
    created = datetime.fromisoformat(job["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    completed = status.get("completionTime")
    if not completed or figures["no_step_s"] is None:
        return {"status_goodput": goodput.get("percent")}
    wall = datetime.fromisoformat(completed.replace("Z", "+00:00")) - created
    wall_s = wall.total_seconds()
    lost = figures["first_step_s"] + figures["no_step_s"] \
        + figures["recomputed_steps"] * figures["step_s"]
    return {"status_goodput": goodput.get("percent"),
            "bench_goodput": round(100.0 * max(wall_s - lost, 0.0) / wall_s, 1),
            "status_lost_s": goodput.get("lostSeconds"), "wall_s": wall_s,
            "bench_lost_s": round(lost, 1)}


# ------------------------------------------------------------------ main
def _row(result: dict) -> str:
    seconds = lambda v: "-" if v is None else f"{v:.1f}s"  # noqa: E731
    goodput = ""
    if result.get("status_goodput") is not None:
        goodput = f"; goodput in its status {result['status_goodput']}%"
        if result.get("bench_goodput") is not None:
            goodput += f", from these timings {result['bench_goodput']}%"
    no_step = seconds(result["no_step_s"]) if result["no_step_s"] is not None \
        or result["outcome"] == "Succeeded" else result["outcome"]
    return (f"  {result['fault']:<6} {result['system']:<8} {result['outcome'][:9]:<10} "
            f"apply->first step {seconds(result['first_step_s'])}, no step running "
            f"{no_step}, steps computed twice {result['recomputed_steps']}{goodput}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default="crash,delete,node")
    parser.add_argument("--systems", default="ours,kubeflow")
    parser.add_argument("--fault-step", type=int, default=30)
    parser.add_argument("--max-steps", type=int, default=80)
    parser.add_argument("--sleep-per-step", type=float, default=0.15)
    parser.add_argument("--give-up", type=float, default=240.0,
                        help="seconds after the fault with no step before a run is given up")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--version", default=os.environ.get("TRAINING_OPERATOR_VERSION",
                                                            "v1.9.4"))
    parser.add_argument("--logs", help="save every pod's log of each run under this folder")
    parser.add_argument("--json", default=os.environ.get("BENCH_JSON"))
    args = parser.parse_args(argv)
    faults, systems = args.faults.split(","), [SYSTEMS[s] for s in args.systems.split(",")]
    # Stopped (`timeout`, a CI job's end): still stop the Go operator and take its setup back.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cluster = Cluster()
    print(f"recovery: the CPU example, 2 nodes x 2 processes, {args.max_steps} steps, a "
          f"checkpoint every 10, fault at step {args.fault_step}; {machine_line()}", flush=True)
    node = victim_node(cluster)
    go = setup = None
    results = []
    try:
        if any(s.name == "kubeflow" for s in systems):
            manifests, binary = build(args.version)
            setup = Setup(cluster, manifests, keep_crd=False)
            setup.install()
            go = GoOperator(binary, setup, None, None, None,
                            Path(tempfile.gettempdir()) / "training-operator-recovery.log")
            go.start()
        for fault in faults:
            if fault == "node":
                operator_off(cluster, node)
            for system in systems:
                result = run_one(cluster, args, system, fault, node)
                results.append(result)
                print(_row(result), flush=True)
    finally:
        if go is not None:
            go.stop()
        if setup is not None:
            setup.remove()
    print(f"  {machine_line()}")
    emit_result("recovery", {"runs": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
