"""The control plane's cost of running jobs: CPU per second of the API server, the kubelets, the
operator and etcd while N single-node AccelerateJobs train, against the same cluster idle.

A running job costs the control plane little by itself; what it costs is how its progress
reaches status.progress. Rank 0's supervisor (`python -m accelerate_trainer.supervise -- ARGV`)
POSTs its progress to the operator's report endpoint (HTTPS, a projected token the operator
checks against the API server's published keys) at the pace the operator's answers set (when the
job's next progress write falls due); a report runs the job's pass only when it changes a
decision, and progress is written at most once per job every reports.progressWriteSeconds (12 s
as shipped; the deployed value is printed): no log is read
and no pod is written. Target: what reporting adds (supervised against the same pods bare) at
most 1.5 ms/s per running job for the four together, 0 log requests/s, and status.progress never
more than 15 s old.

Every job's container runs a stdlib printer (PRINTER): a tqdm-like line --lines-per-second times
a second and an `ACCELERATE_PROGRESS {json}` line every 2 s, forever. Measured over --window
seconds each: the cluster idle (a fresh namespace, no jobs); then, each with N new jobs and
every pod Running, each after --settle seconds: `bare`, the printer alone (nothing reported);
`synthetic`, the same bare pods and one reporter pod for all of them (reporter.py: the same
reports and writes, one reporting process instead of N: the control run); `supervised`, the
printer under the supervisor, every job showing status.progress. What reporting adds per running
job is the supervised run's cost minus the bare one's; the synthetic run's minus the bare one's
is what the reports and writes cost by themselves, and the rest, what N reporting processes cost
the machine. CPU is utime + stime of the host processes (/proc/<pid>/stat: the local cluster
runs the control plane and the kubelets as host processes, and the operator's container is a
process of this host); kube-controller-manager and kube-scheduler are shown apart (they watch
pods too). Request rates come from the API server's apiserver_request_total (every client);
status.progress.updateTime is sampled a few times during each loaded window for the progress's
freshness.

Usage: python bench/running.py [--jobs 100] [--lines-per-second 20] [--window 45] [--settle 15]
       [--mode all|both|bare|synthetic|supervised] [--keep]
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
    OPERATOR_NAMESPACE,
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
from reporter import reporter_answers, start_reporter
from throughput import free_pod_slots

from devtools.images import TRAINER_CPU_IMAGE

IMAGE = os.environ.get("BENCH_TRAINER_IMAGE", TRAINER_CPU_IMAGE)
SUPERVISOR = ["python", "-m", "accelerate_trainer.supervise", "--"]
TARGET_MS_PER_JOB = 1.5
TARGET_AGE_S = 15.0
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
                  args: argparse.Namespace, mode: str) -> dict:
    """The jobs (bare, bare with the synthetic reporter, or under the supervisor), then the
    loaded window; their namespace goes at the end (unless --keep)."""
    namespace = cluster.create_namespace("bench-running")
    ages: list[float] = []
    no_progress: list[int] = []

    def sample() -> None:
        found, missing = progress_ages(cluster, namespace)
        ages.extend(found)
        no_progress.append(missing)

    timeout, answers = max(240.0, 3.0 * args.jobs), None
    try:
        names = create_jobs(cluster, namespace, args, mode == "supervised")
        if mode == "synthetic":
            wait_until_running(cluster, namespace, names, timeout, progress=False)
            start_reporter(cluster, namespace, names, IMAGE)
        ready_s = wait_until_running(cluster, namespace, names, timeout,
                                     progress=mode != "bare")
        print(f"  {args.jobs} jobs Running{'' if mode == 'bare' else ' with status.progress'} "
              f"after {ready_s:.0f}s; settle {args.settle:.0f}s, then the loaded window "
              f"({args.window:.0f}s)", flush=True)
        time.sleep(args.settle)
        ages.clear()
        no_progress.clear()
        loaded = measure_window(cluster, procs, args.window, sample)
        if mode == "synthetic":
            answers = reporter_answers(cluster, namespace)
    finally:
        if not args.keep:
            cluster.delete_namespace(namespace, wait=True)
    return {"namespace": namespace, "ready_s": ready_s, "loaded": loaded,
            "progress_age_max_s": max(ages) if ages else None,
            "progress_age_median_s": median(ages) if ages else None,
            "jobs_without_progress_max": max(no_progress) if no_progress else 0,
            "reporter_answers": answers}


def measure(cluster: Cluster, args: argparse.Namespace) -> dict[str, dict]:
    """The idle window, then each mode's jobs: {"idle": window, "bare": run, "supervised":
    run} (the modes asked for)."""
    procs = components(cluster)
    out: dict[str, dict] = {"idle": idle_window(cluster, procs, args)}
    for mode in modes(args):
        print(f"  {args.jobs} jobs, {mode}", flush=True)
        out[mode] = loaded_window(cluster, procs, args, mode)
    return out


MODES = ("bare", "synthetic", "supervised")


def modes(args: argparse.Namespace) -> tuple[str, ...]:
    return {"all": MODES, "both": ("bare", "supervised")}.get(args.mode, (args.mode,))


# ------------------------------------------------------------------ the report
def figures(idle: dict, run: dict, jobs: int) -> dict:
    """The flat numbers of one mode (ms per second, requests per second) for the JSON line."""
    out: dict = {key: run[key] for key in ("namespace", "ready_s", "progress_age_max_s",
                                            "progress_age_median_s", "jobs_without_progress_max",
                                            "reporter_answers")}
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
    """The run of the last mode measured (supervised, else synthetic, else bare) unprefixed, each
    other as `bare_*` and `synthetic_*`, and with the bare run: what reporting adds per running
    job (`adds_*`: supervised - bare) and what the reports and writes add by themselves
    (`synthetic_adds_*`: synthetic - bare)."""
    runs = {mode: figures(m["idle"], m[mode], jobs) for mode in MODES if mode in m}
    last = next(mode for mode in reversed(MODES) if mode in runs)
    out = dict(runs[last])
    out["progress_write_seconds"] = m.get("progress_write_seconds")
    for mode in (mode for mode in MODES if mode in runs and mode != last):
        out.update({f"{mode}_{key}": value for key, value in runs[mode].items()})
    if "bare" not in runs or last == "bare":
        return out
    bare = runs["bare"]
    per_job = [k for k in bare if k.endswith("_per_job_ms")]
    for mode, prefix in (("supervised", "adds_"), ("synthetic", "synthetic_adds_")):
        if mode in runs:
            out.update({f"{prefix}{k}": runs[mode][k] - bare[k] for k in per_job})
    if "adds_sum_per_job_ms" in out:
        age = out["progress_age_max_s"]
        out["target_met"] = (out["adds_sum_per_job_ms"] <= TARGET_MS_PER_JOB
                             and out["pod_log_loaded_per_s"] == 0
                             and age is not None and age <= TARGET_AGE_S)
    return out


def print_table(r: dict, jobs: int) -> None:
    """Per running job: each mode's CPU per second above idle, and what reporting adds."""
    shown = [mode for mode in MODES if f"{mode}_sum_per_job_ms" in r
             or (mode == r["last_mode"])]
    deltas = [(label, prefix) for label, prefix in (("writes alone", "synthetic_adds_"),
                                                    ("reporting adds", "adds_"))
              if f"{prefix}sum_per_job_ms" in r]
    head = " ".join(f"{name:>11}" for name in [*shown, *(label for label, _ in deltas)])
    print(f"  {'CPU per second, per running job':<32} {head}")
    for label in (*SUMMED, "sum", *APART):
        key = label.replace("-", "_")
        if f"{key}_per_job_ms" not in r:
            continue
        name = {"sum": "sum of the four"}.get(label, label) + (" (apart)" if label in APART
                                                             else "")
        cells = [r[f"{'' if mode == r['last_mode'] else mode + '_'}{key}_per_job_ms"]
                 for mode in shown] + [r.get(f"{prefix}{key}_per_job_ms", 0.0)
                                       for _, prefix in deltas]
        print(f"  {name:<32} " + " ".join(f"{value:>+8.2f} ms" for value in cells))
    for name, label in (("pod_log", "pod log requests"), ("job_status_patch", "job status PATCH"),
                        ("pod_patch", "pod PATCH"), ("pod_status_patch", "pod status PATCH"),
                        ("all", "all API requests")):
        rates = " ".join(f"{r[f'{prefix}{name}_per_job_per_s']:>9.3f}/s" for prefix in
                         (("" if mode == r["last_mode"] else f"{mode}_") for mode in shown))
        print(f"  {label + ' per job':<32} {rates}")


def print_report(r: dict, args: argparse.Namespace) -> None:
    print(f"  the operator writes status.progress at most every "
          f"{r['progress_write_seconds'] or '?'} s (reports.progressWriteSeconds as deployed)")
    print_table(r, args.jobs)
    for mode in (mode for mode in MODES if mode != "bare"):
        prefix = "" if mode == r["last_mode"] else f"{mode}_"
        if r.get(f"{prefix}progress_age_max_s") is not None:
            print(f"  {mode}: status.progress age during the loaded window ({FRESHNESS_SAMPLES} "
                  f"samples of every job): median {r[f'{prefix}progress_age_median_s']:.1f}s, "
                  f"max {r[f'{prefix}progress_age_max_s']:.1f}s (updateTime has 1 s "
                  f"resolution); jobs without progress at a sample: at most "
                  f"{r[f'{prefix}jobs_without_progress_max']}")
    answers = r.get("synthetic_reporter_answers") or r.get("reporter_answers")
    if answers:
        print(f"  synthetic reporter's answers so far: {answers}")
    if "adds_sum_per_job_ms" not in r:
        return
    sum_ok = r["adds_sum_per_job_ms"] <= TARGET_MS_PER_JOB
    logs_ok = r["pod_log_loaded_per_s"] == 0
    age = r["progress_age_max_s"]
    age_ok = age is not None and age <= TARGET_AGE_S
    print(f"  target: reporting adds {' + '.join(r['summed'])} {r['adds_sum_per_job_ms']:.2f} "
          f"ms/s per running job (<= {TARGET_MS_PER_JOB:g}: {'MET' if sum_ok else 'MISSED'}); "
          f"pod log requests {r['pod_log_loaded_per_s']:.2f}/s "
          f"(== 0: {'MET' if logs_ok else 'MISSED'}); status.progress at most "
          f"{age if age is not None else '?'} s old (<= {TARGET_AGE_S:g}: "
          f"{'MET' if age_ok else 'MISSED'})", flush=True)


def progress_write_seconds(cluster: Cluster) -> str | None:
    """The deployed operator's ACCELERATE_OPERATOR_PROGRESS_WRITE_SECONDS (None: not set)."""
    deployments = cluster.kubectl("-n", OPERATOR_NAMESPACE, "get", "deployment", "-l",
                                  "app.kubernetes.io/name=accelerate-operator", "-o", "json")
    for deployment in json.loads(deployments.stdout)["items"]:
        for env in deployment["spec"]["template"]["spec"]["containers"][0].get("env") or []:
            if env["name"] == "ACCELERATE_OPERATOR_PROGRESS_WRITE_SECONDS":
                return env.get("value")
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cluster = Cluster()
    wait_for_cluster(cluster)
    delete_leftovers(cluster)
    free, pods = free_pod_slots(cluster), args.jobs + ("synthetic" in modes(args))
    if pods > free:
        print(f"error: {args.jobs} jobs need {pods} pods, and the nodes have room for "
              f"{free} more (allocatable pods, the kubelets' maxPods): use --jobs "
              f"{free - pods + args.jobs} or fewer", file=sys.stderr)
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
    m["progress_write_seconds"] = progress_write_seconds(cluster)
    result = {"jobs": args.jobs, "lines_per_second": args.lines_per_second,
              "window_s": args.window, "supervise": "supervised" in m, "mode": args.mode,
              "last_mode": next(mode for mode in reversed(MODES) if mode in m),
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
    parser.add_argument("--mode", choices=("all", "both", *MODES), default="all",
                        help="all: the jobs bare, with the synthetic reporter, then under the "
                             "supervisor, and what reporting adds; both: bare and supervised; "
                             "or one of them alone")
    parser.add_argument("--keep", action="store_true", help="keep the namespace and its jobs")
    parser.add_argument("--json", default=os.environ.get("BENCH_JSON"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
