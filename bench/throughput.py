"""Reconcile throughput, API cost and memory: N two-node AccelerateJobs created at once.

All jobs go into one fresh namespace. A job counts as reconciled once its ConfigMap, its Service
and both pods exist and its status is right: phase Pending or Running, readyNodes equal to
"<pods Running and Ready>/2", observedGeneration equal to its generation. Reported: time until
every job is reconciled, jobs/s and pods/s, per-job latency (p50/p99), the operator's API
requests per job counted exactly (FlowSchemas matching only its ServiceAccount, see
common.install_flow_schemas), its CPU time, and its RSS idle, at peak and after cleanup.

Modes (--mode):
  pending   pods carry a nodeSelector no node matches: they stay Pending, so only the operator,
            the API server and the scheduler work (the default; isolates the operator)
  running   pods run `sleep 3600` in the operator's image (present on every local node, never
            pulled) on the cluster's nodes; also reports the time until every job is Running
            with readyNodes 2/2. The nodes hold at most their `pods` capacity (the kubelet's
            maxPods, 110 each by default): --jobs is lowered to what fits, and said so

Then the single-job latency: --single runs, one job at a time (pending template), create ->
ConfigMap, Service and both pods exist.

Memory over time: --bursts K repeats the pending burst K times and reports the RSS after each
cleanup (the operator hands freed memory back within its trim period, clock.py: the RSS is
polled for up to 20 s after the namespace is gone). The scale curve: --curve 100,500,2000,5000
runs one pending burst of each size and prints a row per size, with the CPU the API server and
etcd (processes of this host) spent per job beside the operator's, so a limit of the control
plane shows as such.

Usage: python bench/throughput.py [--jobs 500] [--mode pending|running|both] [--single 10]
       [--bursts 1] [--curve 100,500,2000,5000]
       [--profile DIR]   (py-spy record of the operator during the burst; needs root)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from burst import (
    BurstTracker,
    add_burst_arguments,
    control_plane_cpu,
    control_plane_processes,
    diff_counts,
    install_flow_schemas,
    operator_request_counts,
    print_control_plane,
    timed_burst,
)
from common import (
    OPERATOR_NAMESPACE,
    Cluster,
    OperatorProcess,
    RssSampler,
    delete_leftovers,
    emit_result,
    job_of,
    machine_line,
    median,
    resilient,
    start_watchers,
    stop_watchers,
    wait_for_cluster,
)

NODES = 2
NO_SUCH_NODE = {"accelerate-operator.io/benchmark-node": "none"}
# Running mode's container: an image every local node has (hack/load-images.sh) and that is
# never pulled; `sleep` is coreutils' (the image is Debian). Override with BENCH_RUNNING_IMAGE.
RUNNING_IMAGE = os.environ.get("BENCH_RUNNING_IMAGE", "ghcr.io/accelerate-operator/operator:0.1.0")


OPERATOR_METRICS_PORT = 9090  # the chart's metrics.port


def operator_passes(cluster: Cluster) -> float | None:
    """The passes the active operator replica has run on jobs it found (the count of its
    accelerate_operator_pass_duration_seconds histogram, read from its metrics port), or None
    where its pod's address cannot be reached from here (kind: pod IPs are inside docker)."""
    try:
        pods = cluster.core.list_namespaced_pod(
            OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/name=accelerate-operator")
        running = {p.metadata.name: p for p in pods.items
                   if p.status and p.status.phase == "Running" and p.status.pod_ip
                   and not p.metadata.deletion_timestamp}
        active = OperatorProcess._active_replica(
            cluster, {name: pod.metadata.uid for name, pod in running.items()})
        if active is None and len(running) == 1:
            active = next(iter(running))
        if active is None:
            return None
        url = f"http://{running[active].status.pod_ip}:{OPERATOR_METRICS_PORT}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except Exception:  # noqa: BLE001 (unreachable: the figure is left out)
        return None
    for line in text.splitlines():
        if line.startswith("accelerate_operator_pass_duration_seconds_count"):
            return float(line.rsplit(" ", 1)[1])
    return None


def job_body(namespace: str, name: str, mode: str) -> dict:
    pod_spec: dict = {"containers": [{
        "name": "trainer", "image": RUNNING_IMAGE, "imagePullPolicy": "IfNotPresent",
        "command": ["sleep", "3600"],
        "resources": {"requests": {"cpu": "1m", "memory": "1Mi"}},
    }], "terminationGracePeriodSeconds": 1}
    if mode == "pending":
        pod_spec["nodeSelector"] = dict(NO_SUCH_NODE)
    return {
        "apiVersion": "accelerate-operator.io/v1alpha1", "kind": "AccelerateJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "numNodes": NODES, "numProcPerNode": 1,
            "accelerateConfig": {"distributed_type": "MULTI_CPU", "use_cpu": True,
                                 "mixed_precision": "no"},
            "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None"},
            "template": {"spec": pod_spec},
        },
    }


class Tracker(BurstTracker):
    """Per-job state fed by the watches; records when each job first becomes reconciled."""

    def __init__(self, names: list[str]):
        super().__init__(names)
        self.configmaps: set[str] = set()
        self.services: set[str] = set()
        self.pods: dict[str, dict[str, bool]] = {n: {} for n in names}  # job -> pod -> ready
        self.status: dict[str, dict] = {}
        self.generation: dict[str, int] = {}
        self.running_at: dict[str, float] = {}
        self.all_running = threading.Event()

    def on_event(self, t: float, kind: str, typ: str, obj: dict) -> None:
        meta = obj["metadata"]
        name = meta["name"]
        with self.lock:
            if kind == "acceleratejobs":
                job = name
                if typ == "DELETED":
                    return
                self.status[job] = obj.get("status") or {}
                self.generation[job] = int(meta.get("generation") or 1)
            elif kind == "configmaps":
                job = job_of(obj)
                if job is None:
                    return
                self.configmaps.add(job)
            elif kind == "services":
                job = job_of(obj)
                if job is None:
                    return
                self.services.add(job)
            else:
                job = job_of(obj)
                if job is None or job not in self.pods:
                    return
                if typ == "DELETED":
                    self.pods[job].pop(name, None)
                    return
                self.pod_seen.setdefault(name, t)
                status = obj.get("status") or {}
                ready = status.get("phase") == "Running" and any(
                    c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions") or [])
                self.pods[job][name] = ready
            if job in self.names:
                self._check(t, job)

    def _check(self, t: float, job: str) -> None:
        pods = self.pods[job]
        status = self.status.get(job)
        if status is None or job not in self.configmaps or job not in self.services:
            return
        if len(pods) < NODES:
            return
        ready = sum(pods.values())
        consistent = (status.get("phase") in ("Pending", "Running")
                      and status.get("readyNodes") == f"{ready}/{NODES}"
                      and int(status.get("observedGeneration") or 0) == self.generation[job])
        if consistent:
            self.mark_reconciled(t, job)
        if consistent and ready == NODES and status.get("phase") == "Running" \
                and job not in self.running_at:
            self.running_at[job] = t
            if len(self.running_at) == len(self.names):
                self.all_running.set()

    def describe(self, job: str) -> str:
        status = self.status.get(job, {})
        return (f"configmap={job in self.configmaps} service={job in self.services} "
                f"pods={self.pods[job]} phase={status.get('phase')} "
                f"readyNodes={status.get('readyNodes')}")


def burst(cluster: Cluster, args: argparse.Namespace, mode: str, jobs: int | None = None,
          idle_rss_mib: float | None = None) -> dict:
    install_flow_schemas(cluster)  # again: a restarted cluster may have lost them
    operator = OperatorProcess.find(cluster)  # again: the operator may have been restarted
    control_plane = control_plane_processes()
    jobs = jobs or args.jobs
    if mode == "running":
        free = free_pod_slots(cluster)
        if NODES * jobs > free:
            jobs = max(1, free // NODES)
            print(f"  [running] the nodes have room for {free} more pods: {jobs} jobs instead "
                  f"of {args.jobs}", flush=True)
    namespace = cluster.create_namespace(f"bench-{mode}")
    names = [f"job-{i:04d}" for i in range(jobs)]
    tracker = Tracker(names)
    watchers = start_watchers(cluster, namespace, tracker.on_event)
    result: dict = {"mode": mode, "jobs": jobs, "namespace": namespace}
    if operator:
        result["operator_pid"] = operator.pid
        result["operator_age_s"] = operator.age_seconds()
        operator.reset_peak()
        result["operator_rss_before_mib"] = operator.rss_mib()
        cpu_before = operator.cpu_seconds()
        sampler = RssSampler(operator)
        sampler.start()
    requests_before = operator_request_counts(cluster)
    passes_before = operator_passes(cluster)
    control_plane_before = {name: proc.cpu_seconds() for name, proc in control_plane.items()}
    profiler = start_profiler(operator, args.profile, mode, args.timeout) if args.profile else None
    bodies = [job_body(namespace, name, mode) for name in names]
    try:
        t0, timings = timed_burst(tracker, cluster.create_job, bodies, args.clients, args.timeout,
                                  NODES)
        result.update(timings)
        if operator:
            result["operator_cpu_s"] = operator.cpu_seconds() - cpu_before
        requests = diff_counts(operator_request_counts(cluster), requests_before)
        result["requests_at_reconciled"] = requests
        if mode == "running":
            if not tracker.all_running.wait(args.timeout):
                raise TimeoutError("not every job reached Running 2/2 within "
                                   f"{args.timeout}s ({len(tracker.running_at)} did)")
            with tracker.lock:
                result["all_running_s"] = max(tracker.running_at.values()) - t0
        # Late writes (a second status patch, pod status events) still belong to these jobs.
        time.sleep(args.settle)
        requests = diff_counts(operator_request_counts(cluster), requests_before)
        result["requests_settled"] = requests
        result["requests_per_job"] = sum(requests.values()) / jobs
        passes_after = operator_passes(cluster)
        if passes_before is not None and passes_after is not None:
            result["passes_per_job"] = (passes_after - passes_before) / jobs
        result.update(control_plane_cpu(control_plane_before, control_plane, jobs))
        if operator:
            result["operator_cpu_settled_s"] = operator.cpu_seconds() - cpu_before
            result["operator_cpu_ms_per_job"] = result["operator_cpu_settled_s"] * 1000 / jobs
            result["operator_peak_rss_mib"] = max(sampler.stop(), operator.peak_rss_mib())
            result["operator_rss_with_jobs_mib"] = operator.rss_mib()
    finally:
        if profiler:
            stop_profiler(profiler, result)
        stop_watchers(watchers)
        t_delete = time.monotonic()
        requests_before_cleanup = operator_request_counts(cluster)
        cluster.delete_namespace(namespace, wait=True)
        result["cleanup_s"] = time.monotonic() - t_delete
        # What the namespace's deletion cost the operator: nothing can be created there any
        # more, so any request but the grace check's reads is waste (controller.py).
        result["cleanup_requests"] = diff_counts(operator_request_counts(cluster),
                                                 requests_before_cleanup)
        if operator:
            result["operator_rss_after_cleanup_mib"] = settled_rss(
                operator, idle_rss_mib if idle_rss_mib is not None
                else result["operator_rss_before_mib"])
    return result


def settled_rss(operator: OperatorProcess, idle_mib: float, within_mib: float = 10.0,
                wait_s: float = 75.0) -> float:
    """The RSS once the operator has let go of what the deleted jobs used: polled until it is
    within `within_mib` of idle, for at most `wait_s` (kopf's workers and the deletions' last
    events end a while after the jobs)."""
    deadline = time.monotonic() + wait_s
    rss = operator.rss_mib()
    while rss > idle_mib + within_mib and time.monotonic() < deadline:
        time.sleep(1.0)
        rss = operator.rss_mib()
    return rss


def free_pod_slots(cluster: Cluster) -> int:
    """Pods the schedulable, Ready nodes can still take: their `pods` allocatable (the
    kubelet's maxPods) minus the pods bound to them that have not finished."""
    capacity, used = 0, 0
    ready = set()
    for node in cluster.core.list_node().items:
        if node.spec.unschedulable or not any(
                c.type == "Ready" and c.status == "True" for c in node.status.conditions or []):
            continue
        ready.add(node.metadata.name)
        capacity += int((node.status.allocatable or {}).get("pods", "110"))
    for pod in cluster.core.list_pod_for_all_namespaces(
            field_selector="status.phase!=Succeeded,status.phase!=Failed").items:
        if pod.spec.node_name in ready:
            used += 1
    return capacity - used


def start_profiler(operator: OperatorProcess | None, directory: str, mode: str, timeout: float):
    if operator is None:
        return None
    Path(directory).mkdir(parents=True, exist_ok=True)
    out = Path(directory) / f"operator-{mode}.txt"
    py_spy = Path(sys.executable).parent / "py-spy"
    proc = subprocess.Popen([str(py_spy), "record", "--pid", str(operator.pid), "--format", "raw",
                             "--rate", "100", "--duration", str(int(timeout)), "--nonblocking",
                             "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    return proc, out


def stop_profiler(profiler, result: dict) -> None:
    proc, out = profiler
    proc.send_signal(2)  # SIGINT: py-spy writes what it has
    proc.wait(timeout=60)
    result["profile"] = str(out)


def single_job_latency(cluster: Cluster, runs: int) -> dict:
    namespace = cluster.create_namespace("bench-single")
    seen: dict[str, dict[str, float]] = {}
    lock = threading.Lock()

    def on_event(t: float, kind: str, typ: str, obj: dict) -> None:
        job = job_of(obj) if kind != "acceleratejobs" else None
        if job is None or typ == "DELETED":
            return
        with lock:
            seen.setdefault(job, {}).setdefault(f"{kind}/{obj['metadata']['name']}", t)

    watchers = start_watchers(cluster, namespace, on_event, kinds=("configmaps", "services",
                                                                   "pods"))
    latencies = []
    try:
        for i in range(runs):
            name = f"single-{i:02d}"
            t0 = time.monotonic()
            cluster.create_job(job_body(namespace, name, "pending"))
            deadline = t0 + 30
            while time.monotonic() < deadline:
                with lock:
                    children = dict(seen.get(name, {}))
                if len(children) == 2 + NODES:
                    break
                time.sleep(0.002)
            else:
                raise TimeoutError(f"{name}: children after 30 s: {sorted(children)}")
            latencies.append((max(children.values()) - t0) * 1000)
            time.sleep(0.5)  # one job at a time: let the operator go idle
    finally:
        stop_watchers(watchers)
        cluster.delete_namespace(namespace, wait=False)
    return {"runs": runs, "median_ms": median(latencies), "worst_ms": max(latencies),
            "best_ms": min(latencies), "raw_ms": latencies}


TARGET_JOBS_PER_S = 55.0
TARGET_CPU_MS_PER_JOB = 10.0
TARGET_PEAK_RSS_MIB = 100.0


def print_burst(label: str, r: dict, args: argparse.Namespace, idle: float | None) -> None:
    print(f"  [{label}] all {r['jobs']} jobs reconciled in {r['reconciled_s']:.2f}s: "
          f"{r['jobs_per_s']:.1f} jobs/s, {r['pods_per_s']:.1f} pods/s "
          f"(target >= {TARGET_JOBS_PER_S:.0f} jobs/s: "
          f"{r['jobs_per_s'] / TARGET_JOBS_PER_S:.2f}x); submit took "
          f"{r['submit_s']:.2f}s; per-job latency p50 {r['job_latency_p50_s']:.2f}s "
          f"p99 {r['job_latency_p99_s']:.2f}s", flush=True)
    if "all_running_s" in r:
        print(f"  [{label}] all jobs Running 2/2 after {r['all_running_s']:.1f}s")
    passes = (f", {r['passes_per_job']:.2f} passes per job" if "passes_per_job" in r else "")
    print(f"  [{label}] operator API requests: {r['requests_per_job']:.2f} per job "
          f"(after {args.settle:.0f}s settle): {r['requests_settled']}{passes}")
    if "operator_cpu_ms_per_job" in r:
        print(f"  [{label}] operator CPU {r['operator_cpu_settled_s']:.1f}s "
              f"({r['operator_cpu_ms_per_job']:.1f} ms/job, target <= "
              f"{TARGET_CPU_MS_PER_JOB:.0f}), peak RSS {r['operator_peak_rss_mib']:.1f} MiB "
              f"(target <= {TARGET_PEAK_RSS_MIB:.0f}), RSS after cleanup "
              f"{r['operator_rss_after_cleanup_mib']:.1f} MiB (idle {idle:.1f}, target within "
              f"10); cleanup {r['cleanup_s']:.1f}s", flush=True)
    if "cleanup_requests" in r:
        print(f"  [{label}] operator API requests during cleanup: "
              f"{sum(r['cleanup_requests'].values()) / r['jobs']:.2f} per job "
              f"{r['cleanup_requests']}", flush=True)
    print_control_plane(label, r)


def scale_curve(cluster: Cluster, args: argparse.Namespace, sizes: list[int]) -> list[dict]:
    """One pending burst per size; a row each, and the memory per 1,000 jobs the peak implies."""
    rows = []
    for jobs in sizes:
        operator = OperatorProcess.find(cluster)
        idle = operator.rss_mib() if operator else None
        timeout = max(args.timeout, jobs / 5)  # 5,000 jobs at a few jobs/s still finish
        curve_args = argparse.Namespace(**{**vars(args), "timeout": timeout})
        r = resilient(cluster, f"curve {jobs}",
                      lambda j=jobs, a=curve_args, i=idle: burst(cluster, a, "pending", j, i))
        r["idle_rss_mib"] = idle
        if operator and idle is not None:
            r["mib_per_1000_jobs"] = (r["operator_peak_rss_mib"] - idle) * 1000 / jobs
        rows.append(r)
        print_burst(f"curve {jobs}", r, args, idle)
    print("  scale curve (pending pods):")
    print(f"  {'jobs':>6} {'jobs/s':>7} {'p99 s':>7} {'req/job':>8} {'op ms/job':>10} "
          f"{'apisrv ms/job':>14} {'etcd ms/job':>12} {'peak MiB':>9} {'MiB/1k jobs':>12}")
    for r in rows:
        print(f"  {r['jobs']:>6} {r['jobs_per_s']:>7.1f} {r['job_latency_p99_s']:>7.1f} "
              f"{r['requests_per_job']:>8.2f} {r.get('operator_cpu_ms_per_job', 0):>10.1f} "
              f"{r.get('kube-apiserver_cpu_ms_per_job', 0):>14.1f} "
              f"{r.get('etcd_cpu_ms_per_job', 0):>12.1f} "
              f"{r.get('operator_peak_rss_mib', 0):>9.1f} {r.get('mib_per_1000_jobs', 0):>12.1f}",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_burst_arguments(parser, timeout=300)
    parser.add_argument("--mode", choices=("pending", "running", "both"), default="pending")
    parser.add_argument("--single", type=int, default=10, help="single-job runs (0: skip)")
    parser.add_argument("--bursts", type=int, default=1,
                        help="pending bursts in a row, for the RSS after each cleanup")
    parser.add_argument("--curve", default=None,
                        help="comma-separated job counts: one pending burst each (scale curve)")
    parser.add_argument("--profile", default=None, help="write py-spy raw profiles here")
    args = parser.parse_args(argv)

    cluster = Cluster()
    wait_for_cluster(cluster)
    delete_leftovers(cluster)
    install_flow_schemas(cluster)
    operator = OperatorProcess.find(cluster)
    if operator is None:
        print("  (no accelerate-operator process on this host: no RSS/CPU figures)")
    print(f"throughput: {args.jobs} two-node jobs at once ({args.clients} client threads); "
          f"{machine_line()}", flush=True)
    if operator:
        idle = operator.rss_mib()
        print(f"  operator pid {operator.pid}, up {operator.age_seconds():.0f}s, "
              f"idle RSS {idle:.1f} MiB", flush=True)

    idle = operator.rss_mib() if operator else None
    results: dict = {"idle_rss_mib": idle}
    modes = ("pending", "running") if args.mode == "both" else (args.mode,)
    for mode in modes:
        runs = args.bursts if mode == "pending" else 1
        for index in range(runs):
            r = resilient(cluster, f"{mode} burst",
                          lambda mode=mode: burst(cluster, args, mode, idle_rss_mib=idle))
            results.setdefault(f"{mode}_bursts", []).append(r)
            results[mode] = results[f"{mode}_bursts"][0]
            print_burst(mode if runs == 1 else f"{mode} {index + 1}/{runs}", r, args, idle)
        if runs > 1 and operator:
            after = [r["operator_rss_after_cleanup_mib"] for r in results[f"{mode}_bursts"]]
            results[f"{mode}_rss_growth_mib"] = after[-1] - after[0]
            print(f"  [{mode}] RSS after each cleanup: "
                  f"{', '.join(f'{a:.1f}' for a in after)} MiB (idle before {idle:.1f}); growth "
                  f"over {runs} bursts {after[-1] - after[0]:+.1f} MiB", flush=True)
    if args.curve:
        results["curve"] = scale_curve(cluster, args, [int(n) for n in args.curve.split(",")])
    if args.single:
        s = resilient(cluster, "single-job latency",
                      lambda: single_job_latency(cluster, args.single))
        results["single"] = s
        print(f"  single job create -> all children: median {s['median_ms']:.0f} ms, best "
              f"{s['best_ms']:.0f}, worst {s['worst_ms']:.0f} over {s['runs']} runs "
              f"(target < 150 ms: {s['median_ms'] / 150:.2f}x)")
    print(f"  {machine_line()}")
    emit_result("throughput", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
