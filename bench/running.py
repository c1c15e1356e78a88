"""The control plane's cost of running jobs: CPU per second of the API server, the kubelets, the
operator and etcd while N single-node AccelerateJobs train, against the same cluster idle.

A running job costs the control plane little by itself; what it costs is how its progress
reaches status.progress. Rank 0's supervisor (`python -m accelerate_trainer.supervise -- ARGV`)
POSTs its progress to the operator's report endpoint (HTTPS, a projected token the operator
checks against the API server's published keys), and the operator writes status.progress at most
once per job every decide.PROGRESS_WRITE_SECONDS: no log is read and no pod is written. Target:
what reporting adds (this run against the same jobs with --no-supervise) at most 1 ms/s per
running job for the four together, 0 log requests/s.

Every job's container runs a stdlib printer (PRINTER): a tqdm-like line --lines-per-second times
a second and an `ACCELERATE_PROGRESS {json}` line every 2 s, forever. Measured over --window
seconds each: the cluster idle (a fresh namespace, no jobs); the N jobs with the printer bare
(the pods alone, nothing reported), every pod Running; then N new jobs under the supervisor,
every job showing status.progress; each after --settle seconds. What reporting adds per running
job is the second's cost minus the first's. CPU is utime + stime of the host processes
(/proc/<pid>/stat: the local cluster runs the control plane and the kubelets as host processes,
and the operator's container is a process of this host); kube-controller-manager and
kube-scheduler are shown apart (they watch pods too). Request rates come from the API server's
apiserver_request_total (every client); status.progress.updateTime is sampled a few times during
each loaded window for the progress's freshness.

Usage: python bench/running.py [--jobs 100] [--lines-per-second 20] [--window 45] [--settle 15]
       [--mode both|bare|supervised] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

from common import (
    CACHE,
    GROUP,
    PLURAL,
    VERSION,
    Cluster,
    ClusterDisturbed,
    OperatorProcess,
    delete_leftovers,
    emit_result,
    host_processes,
    job_of,
    machine_line,
    median,
    read_metrics,
    wait_for_cluster,
)
from kubernetes.client.rest import ApiException
from throughput import free_pod_slots

from devtools.images import TRAINER_CPU_IMAGE

IMAGE = os.environ.get("BENCH_TRAINER_IMAGE", TRAINER_CPU_IMAGE)
SUPERVISOR = ["python", "-m", "accelerate_trainer.supervise", "--"]
TARGET_MS_PER_JOB = 1.0
FRESHNESS_SAMPLES = 4
# The host processes of the local cluster (hack/cluster-up.sh), by argv[0]'s basename; only those
# whose command line names the cluster's folder, so nothing else of that name is counted.
HOST_COMPONENTS = {"kube-apiserver": "kube-apiserver", "kubelets": "kubelet", "etcd": "etcd",
                   "kube-controller-manager": "kube-controller-manager",
                   "kube-scheduler": "kube-scheduler"}
SUMMED = ("kube-apiserver", "kubelets", "operator", "etcd")
APART = ("kube-controller-manager", "kube-scheduler")

# Rank 0 of a training job, minus the training: a tqdm bar line LPS times a second (argv[1]; 0:
# none) and a progress report every 2 s. Stdlib only; python -u, so every line is one write.
PRINTER = r"""
import json, sys, time
lps = float(sys.argv[1]); period = 1 / lps if lps > 0 else 2.0
start = tick = time.monotonic(); report = start + 2.0; step = 0
while True:
    now = time.monotonic(); step += 1
    if lps > 0:
        n, t = step % 1000, int(now - start)
        bar = ("\u2588" * (n // 100) + "\u258b").ljust(10)[:10]
        sys.stdout.write("\r%3d%%|%s| %d/1000 [%02d:%02d<00:31, %.1fit/s]\n"
                         % (n // 10, bar, n, t // 60, t % 60, lps))
    if now >= report:
        report += 2.0
        sys.stdout.write("ACCELERATE_PROGRESS " + json.dumps(
            {"step": step, "total_steps": 100000, "loss": round(1 + 1 / step, 4)}) + "\n")
    tick += period
    time.sleep(max(0.0, tick - time.monotonic()))
"""


def job_body(namespace: str, name: str, lines_per_second: float, supervise: bool) -> dict:
    printer = ["python", "-u", "-c", PRINTER, str(lines_per_second)]
    container = {
        "name": "trainer", "image": IMAGE, "imagePullPolicy": "IfNotPresent",
        "command": SUPERVISOR + printer if supervise else printer,
        "resources": {"requests": {"cpu": "5m", "memory": "32Mi"}},
        # The printer is no transformers script: its Kubeflow callback stays off.
        "env": [{"name": "DISABLE_KUBEFLOW_INTEGRATION", "value": "TRUE"}],
    }
    return {
        "apiVersion": "accelerate-operator.io/v1alpha1", "kind": "AccelerateJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "numNodes": 1, "numProcPerNode": 1,
            "accelerateConfig": {"distributed_type": "NO", "use_cpu": True,
                                 "mixed_precision": "no"},
            "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None"},
            "template": {"spec": {"containers": [container],
                                  "terminationGracePeriodSeconds": 1}},
        },
    }


# ------------------------------------------------------------------ CPU of the components
def host_pids() -> dict[str, list[int]]:
    """The pids of each HOST_COMPONENTS component (two kubelets: one per node)."""
    found = host_processes(HOST_COMPONENTS.values(), marker=str(CACHE / "cluster").encode())
    return {name: found[argv0] for name, argv0 in HOST_COMPONENTS.items()}


def components(cluster: Cluster) -> dict[str, list[OperatorProcess]]:
    """Each component's processes; a component with none is left out (and said so)."""
    pids = host_pids()
    operator = OperatorProcess.find(cluster)
    pids["operator"] = [operator.pid] if operator else []
    missing = [name for name, found in pids.items() if not found]
    if missing:
        print(f"  (no process found for {', '.join(missing)}: left out)", flush=True)
    return {name: [OperatorProcess(pid) for pid in found] for name, found in pids.items()
            if found}


def cpu_snapshot(procs: dict[str, list[OperatorProcess]]) -> dict[str, tuple[float, list]]:
    """Per component: its CPU seconds so far, and its processes' identities (pid, start)."""
    snapshot = {}
    try:
        for name, group in procs.items():
            snapshot[name] = (sum(p.cpu_seconds() for p in group),
                              [(p.pid, p.start_ticks()) for p in group])
    except OSError as error:
        raise ClusterDisturbed(f"a {name} process is gone ({error}): restarted?") from None
    return snapshot


# ------------------------------------------------------------------ API server request rates
LABEL = re.compile(r'(\w+)="([^"]*)"')
COUNTERS: dict[str, Callable[[dict], bool]] = {
    "pod_log": lambda m: m["resource"] == "pods" and m["subresource"] == "log",
    "job_status_patch": lambda m: (m["resource"] == "acceleratejobs"
                                   and m["subresource"] == "status" and m["verb"] == "PATCH"),
    "pod_patch": lambda m: (m["resource"] == "pods" and m["subresource"] == ""
                            and m["verb"] == "PATCH"),
    "pod_status_patch": lambda m: (m["resource"] == "pods" and m["subresource"] == "status"
                                   and m["verb"] == "PATCH"),
    "all": lambda m: True,
}


def request_counts(cluster: Cluster) -> tuple[float, dict[str, float]]:
    """When (monotonic, the middle of the read) and the apiserver_request_total sums COUNTERS
    names, over every client."""
    started = time.monotonic()
    text = read_metrics(cluster)
    at = (started + time.monotonic()) / 2
    counts = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels, value = line.rsplit(" ", 1)
        fields = dict(LABEL.findall(labels))
        fields.setdefault("subresource", "")
        for name, matches in COUNTERS.items():
            if matches(fields):
                counts[name] += float(value)
    return at, counts


# ------------------------------------------------------------------ progress freshness
def progress_ages(cluster: Cluster, namespace: str) -> tuple[list[float], int]:
    """now - status.progress.updateTime of every job that has one (s), and how many have none."""
    jobs = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
    now = datetime.now(timezone.utc)
    ages, missing = [], 0
    for job in jobs.get("items") or []:
        stamp = ((job.get("status") or {}).get("progress") or {}).get("updateTime")
        if not stamp:
            missing += 1
            continue
        ages.append((now - datetime.fromisoformat(stamp.replace("Z", "+00:00"))).total_seconds())
    return ages, missing


# ------------------------------------------------------------------ one window
def measure_window(cluster: Cluster, procs: dict[str, list[OperatorProcess]], seconds: float,
                   sample: Callable[[], None]) -> dict:
    """CPU ms per second of each component and API requests per second over `seconds`, calling
    `sample` FRESHNESS_SAMPLES times, evenly spread (in every window alike: same cost)."""
    t_before, requests_before = request_counts(cluster)
    cpu_before, started = cpu_snapshot(procs), time.monotonic()
    for index in range(FRESHNESS_SAMPLES):
        time.sleep(max(0.0, started + seconds * (index + 0.5) / FRESHNESS_SAMPLES
                       - time.monotonic()))
        sample()
    time.sleep(max(0.0, started + seconds - time.monotonic()))
    cpu_after, elapsed = cpu_snapshot(procs), time.monotonic() - started
    t_after, requests_after = request_counts(cluster)
    for name, (_, identities) in cpu_after.items():
        if identities != cpu_before[name][1]:
            raise ClusterDisturbed(f"{name} restarted during the window")
    if any(requests_after[k] < requests_before[k] for k in requests_before):
        raise ClusterDisturbed("the API server's counters went back: it restarted")
    return {
        "seconds": elapsed,
        "cpu_ms": {name: (cpu_after[name][0] - cpu_before[name][0]) * 1000 / elapsed
                   for name in cpu_after},
        "per_s": {k: (requests_after[k] - requests_before[k]) / (t_after - t_before)
                  for k in requests_before},
    }


# ------------------------------------------------------------------ the jobs
def create_jobs(cluster: Cluster, namespace: str, args: argparse.Namespace,
                supervise: bool) -> list[str]:
    names = [f"run-{i:04d}" for i in range(args.jobs)]
    bodies = [job_body(namespace, n, args.lines_per_second, supervise) for n in names]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(cluster.create_job, bodies))
    return names


def running_state(cluster: Cluster, namespace: str) -> tuple[set[str], set[str], list[str]]:
    """The jobs whose pods all run, those that show status.progress, and what failed."""
    pods = json.loads(cluster.core.list_namespaced_pod(namespace, _preload_content=False).data)
    by_job: dict[str, list[str]] = {}
    for pod in pods.get("items") or []:
        job = job_of(pod)
        if job:
            by_job.setdefault(job, []).append((pod.get("status") or {}).get("phase", ""))
    running = {job for job, phases in by_job.items() if all(p == "Running" for p in phases)}
    jobs = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
    progressing, failed = set(), []
    for job in jobs.get("items") or []:
        status = job.get("status") or {}
        if (status.get("progress") or {}).get("updateTime"):
            progressing.add(job["metadata"]["name"])
        if status.get("phase") == "Failed":
            failed.append(f"{job['metadata']['name']}: {json.dumps(status)[:600]}")
    return running, progressing, failed


def wait_until_running(cluster: Cluster, namespace: str, names: list[str],
                       timeout: float, progress: bool = True) -> float:
    """Block until every job's pod runs and (with `progress`) every job shows progress; how
    long that took. Bare printers (--no-supervise) report nothing: their jobs never do."""
    started = time.monotonic()
    next_note = started + 15
    while True:
        try:
            running, progressing, failed = running_state(cluster, namespace)
        except ApiException as error:  # an API server busy starting hundreds of pods: 504
            print(f"  ... listing failed ({error.status}); trying again", flush=True)
            time.sleep(5)
            continue
        if failed:
            raise RuntimeError(f"{len(failed)} jobs failed, e.g. {failed[0]}")
        if len(running & set(names)) == len(names) and (
                not progress or len(progressing) == len(names)):
            return time.monotonic() - started
        now = time.monotonic()
        if now - started > timeout:
            raise TimeoutError(f"after {timeout:.0f}s: {len(running)}/{len(names)} jobs with "
                               f"their pod Running, {len(progressing)} with status.progress")
        if now >= next_note:
            next_note = now + 15
            print(f"  ... {len(running)}/{len(names)} Running, {len(progressing)} with "
                  f"progress ({now - started:.0f}s)", flush=True)
        time.sleep(2.0)


# ------------------------------------------------------------------ the measurement
def idle_window(cluster: Cluster, procs: dict[str, list[OperatorProcess]],
                args: argparse.Namespace) -> dict:
    """The cluster with no job: a fresh, empty namespace (sampled like a loaded one)."""
    namespace = cluster.create_namespace("bench-running-idle")
    try:
        print(f"  idle window ({args.window:.0f}s, no jobs)", flush=True)
        return measure_window(cluster, procs, args.window,
                              lambda: progress_ages(cluster, namespace))
    finally:
        cluster.delete_namespace(namespace, wait=True)


def loaded_window(cluster: Cluster, procs: dict[str, list[OperatorProcess]],
                  args: argparse.Namespace, supervise: bool) -> dict:
    """The jobs (under the supervisor, or bare), then the loaded window; their namespace goes
    at the end (unless --keep)."""
    namespace = cluster.create_namespace("bench-running")
    ages: list[float] = []
    no_progress: list[int] = []

    def sample() -> None:
        found, missing = progress_ages(cluster, namespace)
        ages.extend(found)
        no_progress.append(missing)

    try:
        names = create_jobs(cluster, namespace, args, supervise)
        ready_s = wait_until_running(cluster, namespace, names, max(240.0, 3.0 * args.jobs),
                                     progress=supervise)
        print(f"  {args.jobs} jobs Running{' with status.progress' if supervise else ''} after "
              f"{ready_s:.0f}s; settle {args.settle:.0f}s, then the loaded window "
              f"({args.window:.0f}s)", flush=True)
        time.sleep(args.settle)
        ages.clear()
        no_progress.clear()
        loaded = measure_window(cluster, procs, args.window, sample)
    finally:
        if not args.keep:
            cluster.delete_namespace(namespace, wait=True)
    return {"namespace": namespace, "ready_s": ready_s, "loaded": loaded,
            "progress_age_max_s": max(ages) if ages else None,
            "progress_age_median_s": median(ages) if ages else None,
            "jobs_without_progress_max": max(no_progress) if no_progress else 0}


def measure(cluster: Cluster, args: argparse.Namespace) -> dict[str, dict]:
    """The idle window, then each mode's jobs: {"idle": window, "bare": run, "supervised":
    run} (the modes asked for)."""
    procs = components(cluster)
    out: dict[str, dict] = {"idle": idle_window(cluster, procs, args)}
    for mode in modes(args):
        print(f"  {args.jobs} jobs, {mode}", flush=True)
        out[mode] = loaded_window(cluster, procs, args, mode == "supervised")
    return out


def modes(args: argparse.Namespace) -> tuple[str, ...]:
    return {"both": ("bare", "supervised"), "bare": ("bare",),
            "supervised": ("supervised",)}[args.mode]


# ------------------------------------------------------------------ the report
def figures(idle: dict, run: dict, jobs: int) -> dict:
    """The flat numbers of one mode (ms per second, requests per second) for the JSON line."""
    out: dict = {key: run[key] for key in ("namespace", "ready_s", "progress_age_max_s",
                                            "progress_age_median_s", "jobs_without_progress_max")}
    loaded = run["loaded"]
    for name in loaded["cpu_ms"]:
        key = name.replace("-", "_")
        out[f"{key}_idle_ms"] = idle["cpu_ms"][name]
        out[f"{key}_loaded_ms"] = loaded["cpu_ms"][name]
        out[f"{key}_per_job_ms"] = (loaded["cpu_ms"][name] - idle["cpu_ms"][name]) / jobs
    for name in loaded["per_s"]:
        out[f"{name}_idle_per_s"] = idle["per_s"][name]
        out[f"{name}_loaded_per_s"] = loaded["per_s"][name]
        out[f"{name}_per_job_per_s"] = (loaded["per_s"][name] - idle["per_s"][name]) / jobs
    summed = [n.replace("-", "_") for n in SUMMED if n in loaded["cpu_ms"]]
    for column in ("idle_ms", "loaded_ms", "per_job_ms"):
        out[f"sum_{column}"] = sum(out[f"{n}_{column}"] for n in summed)
    out["summed"] = [n for n in SUMMED if n in loaded["cpu_ms"]]
    return out


def combine(m: dict[str, dict], jobs: int) -> dict:
    """The supervised run's figures (or the bare one's alone), the bare run's as `bare_*`, and
    what reporting adds per running job (`adds_*`: supervised - bare) with both."""
    runs = {mode: figures(m["idle"], m[mode], jobs) for mode in ("bare", "supervised")
            if mode in m}
    out = dict(runs.get("supervised") or runs["bare"])
    if "bare" in runs and "supervised" in runs:
        bare = runs["bare"]
        out.update({f"bare_{key}": value for key, value in bare.items()})
        for key in [k for k in out if k.endswith("_per_job_ms") and not k.startswith("bare_")]:
            out[f"adds_{key}"] = out[key] - bare.get(key, 0.0)
        out["target_met"] = (out["adds_sum_per_job_ms"] <= TARGET_MS_PER_JOB
                             and out["pod_log_loaded_per_s"] == 0)
    return out


def print_table(r: dict, jobs: int) -> None:
    both = "adds_sum_per_job_ms" in r
    head = (f"{'bare':>10} {'supervised':>11} {'reporting adds':>15}" if both
            else f"{'idle':>9} {f'{jobs} running jobs':>17} {'per running job':>16}")
    print(f"  {'CPU per second, per running job' if both else 'CPU per second':<32} {head}")
    for label in (*SUMMED, "sum", *APART):
        key = label.replace("-", "_")
        if f"{key}_idle_ms" not in r:
            continue
        name = {"sum": "sum of the four"}.get(label, label) + (" (apart)" if label in APART
                                                             else "")
        if both:
            print(f"  {name:<32} {r[f'bare_{key}_per_job_ms']:>+7.2f} ms "
                  f"{r[f'{key}_per_job_ms']:>+8.2f} ms {r[f'adds_{key}_per_job_ms']:>+12.2f} ms")
        else:
            print(f"  {name:<32} {r[f'{key}_idle_ms']:>6.1f} ms {r[f'{key}_loaded_ms']:>14.1f} "
                  f"ms {r[f'{key}_per_job_ms']:>+13.2f} ms")
    for name, label in (("pod_log", "pod log requests"), ("job_status_patch", "job status PATCH"),
                        ("pod_patch", "pod PATCH"), ("pod_status_patch", "pod status PATCH"),
                        ("all", "all API requests")):
        print(f"  {label:<32} {r[f'{name}_idle_per_s']:>7.2f}/s idle "
              f"{r[f'{name}_loaded_per_s']:>9.2f}/s loaded {r[f'{name}_per_job_per_s']:>8.3f}/s "
              "per job")


def print_report(r: dict, args: argparse.Namespace) -> None:
    print_table(r, args.jobs)
    if r["progress_age_max_s"] is not None:
        print(f"  status.progress age during the loaded window ({FRESHNESS_SAMPLES} samples of "
              f"every job): median {r['progress_age_median_s']:.1f}s, max "
              f"{r['progress_age_max_s']:.1f}s (updateTime has 1 s resolution); jobs without "
              f"progress at a sample: at most {r['jobs_without_progress_max']}")
    if "adds_sum_per_job_ms" not in r:
        return
    sum_ok = r["adds_sum_per_job_ms"] <= TARGET_MS_PER_JOB
    logs_ok = r["pod_log_loaded_per_s"] == 0
    print(f"  target: reporting adds {' + '.join(r['summed'])} {r['adds_sum_per_job_ms']:.2f} "
          f"ms/s per running job (<= {TARGET_MS_PER_JOB:g}: {'MET' if sum_ok else 'MISSED'}); "
          f"pod log requests {r['pod_log_loaded_per_s']:.2f}/s "
          f"(== 0: {'MET' if logs_ok else 'MISSED'})", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cluster = Cluster()
    wait_for_cluster(cluster)
    delete_leftovers(cluster)
    free = free_pod_slots(cluster)
    if args.jobs > free:
        print(f"error: {args.jobs} jobs need {args.jobs} pods, and the nodes have room for "
              f"{free} more (allocatable pods, the kubelets' maxPods): use --jobs {free} or "
              "fewer", file=sys.stderr)
        return 2
    print(f"running: {args.jobs} single-node jobs, rank 0 printing {args.lines_per_second:g} "
          f"lines/s and a progress report every 2 s, {' then '.join(modes(args))}; "
          f"{machine_line()}", flush=True)
    try:
        m = measure(cluster, args)
    except ClusterDisturbed as error:
        print(f"  ! {error}; waiting for the cluster and measuring again", flush=True)
        wait_for_cluster(cluster)
        delete_leftovers(cluster)
        m = measure(cluster, args)
    result = {"jobs": args.jobs, "lines_per_second": args.lines_per_second,
              "window_s": args.window, "supervise": "supervised" in m, "mode": args.mode,
              **combine(m, args.jobs)}
    print_report(result, args)
    print(f"  {machine_line()}")
    emit_result("running", result, args.json)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--lines-per-second", type=float, default=20.0,
                        help="tqdm-like lines rank 0 prints per second")
    parser.add_argument("--window", type=float, default=45.0, help="seconds per window")
    parser.add_argument("--settle", type=float, default=15.0,
                        help="seconds between every job showing progress and the loaded window")
    parser.add_argument("--mode", choices=("both", "bare", "supervised"), default="both",
                        help="both: the same jobs bare, then under the supervisor, and what "
                             "reporting adds; or one of them alone")
    parser.add_argument("--keep", action="store_true", help="keep the namespace and its jobs")
    parser.add_argument("--json", default=os.environ.get("BENCH_JSON"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
