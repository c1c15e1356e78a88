"""Print the benchmarks' headline numbers against the targets of docs/performance.md, from the JSON
lines the benchmarks append to $BENCH_JSON. Usage: python bench/summary.py RESULTS.jsonl"""

from __future__ import annotations

import json
import os
import statistics
import sys

TARGETS = {  # name: (unit, target, higher is better); issue 17's and issue 15's among them
    "jobs/s reconciled (500 two-node jobs)": ("jobs/s", 55.0, True),
    "operator CPU per job (500 two-node jobs)": ("ms", 10.0, False),
    "single job create -> children (median)": ("ms", 150.0, False),
    "operator peak RSS with the jobs": ("MiB", 100.0, False),
    "training steps/s, operator / bare": ("ratio", 0.98, True),
    "pod created -> step 1, operator / bare": ("ratio", 1.1, False),
    # The end of a job, plain `accelerate launch` in both: what the operator adds to the pods'.
    "last step -> job Succeeded, operator - bare (median)": ("s", 1.0, False),
    "reporting adds, control plane CPU per running job": ("ms/s", 1.5, False),
    "pod log requests with jobs running": ("/s", 0.0, False),
    "recovery: crash, no step running": ("s", 8.0, False),
    "recovery: delete, no step running": ("s", 17.6, False),
    "recovery: node, no step running": ("s", 90.0, False),
    **{f"recovery: {fault}, ours / PyTorchJob": ("ratio", 1.0, False)
       for fault in ("crash", "delete", "node")},
    **{f"recovery: {fault}, goodput status vs timings": ("points", 2.0, False)
       for fault in ("crash", "delete", "node")},
    "kubeflow: jobs/s, ours / Go tuned": ("ratio", 0.8, True),  # issue 36's bounds
    "kubeflow: peak RSS, ours / Go tuned": ("ratio", 2.0, False),
}


def rows(results: list[dict]) -> list[tuple[str, float | None, str]]:
    out: list[tuple[str, float | None, str]] = []
    for r in results:
        if r["benchmark"] == "startup":
            out.append(("startup: create -> step 1 on every rank (median)", r["total_median_s"],
                        "s"))
            out.append(("startup: create -> step 1 (worst)", r["total_worst_s"], "s"))
            out.append(("startup: create -> children (median)", r["children_median_ms"], "ms"))
        elif r["benchmark"] == "throughput":
            for mode in ("pending", "running"):
                if mode in r:
                    m = r[mode]
                    label = f"[{mode}, {m['jobs']} jobs]"
                    if m["jobs"] == 500 and mode == "pending":
                        out.append(("jobs/s reconciled (500 two-node jobs)", m["jobs_per_s"], ""))
                    out.append((f"jobs/s {label}", m["jobs_per_s"], "jobs/s"))
                    out.append((f"pods/s {label}", m["pods_per_s"], "pods/s"))
                    out.append((f"API requests per job {label}", m["requests_per_job"], ""))
                    out.append((f"control plane CPU per job {label}", control_plane_ms(m),
                                "ms"))
                    if "operator_peak_rss_mib" in m:
                        out.append((f"operator CPU per job {label}", m["operator_cpu_ms_per_job"],
                                    "ms"))
                        if m["jobs"] == 500 and mode == "pending":
                            out.append(("operator CPU per job (500 two-node jobs)",
                                        m["operator_cpu_ms_per_job"], ""))
                            out.append(("operator peak RSS with the jobs",
                                        m["operator_peak_rss_mib"], ""))
                        out.append((f"operator peak RSS {label}", m["operator_peak_rss_mib"],
                                    "MiB"))
            if r.get("idle_rss_mib") is not None:
                out.append(("operator RSS idle", r["idle_rss_mib"], "MiB"))
            if "single" in r:
                out.append(("single job create -> children (median)", r["single"]["median_ms"],
                            ""))
        elif r["benchmark"] == "kubeflow":
            for profile in ("defaults", "tuned"):
                if profile in r:
                    m = r[profile]
                    label = f"[Go {r['version']} {profile}, {m['jobs']} jobs]"
                    out.append((f"jobs/s {label}", m["jobs_per_s"], "jobs/s"))
                    out.append((f"API requests per job {label}", m["requests_per_job"], ""))
                    out.append((f"CPU per job {label}", m["operator_cpu_ms_per_job"], "ms"))
                    out.append((f"control plane CPU per job {label}", control_plane_ms(m),
                                "ms"))
                    out.append((f"idle RSS {label}", m["idle_rss_mib"], "MiB"))
                    out.append((f"peak RSS {label}", m["operator_peak_rss_mib"], "MiB"))
                    out.append((f"RSS after cleanup {label}", m["operator_rss_after_cleanup_mib"],
                                "MiB"))
        elif r["benchmark"] == "running":
            if "adds_sum_per_job_ms" in r:
                out.append(("reporting adds, control plane CPU per running job",
                            r["adds_sum_per_job_ms"], ""))
            out.append(("pod log requests with jobs running", r["pod_log_loaded_per_s"], ""))
            label = f"[{r['jobs']} jobs{'' if r['supervise'] else ', bare'}]"
            for name in ("kube_apiserver", "kubelets", "operator", "etcd"):
                if f"{name}_per_job_ms" in r:
                    out.append((f"{name.replace('_', '-')} CPU per running job {label}",
                                r[f"{name}_per_job_ms"], "ms/s"))
            if r.get("progress_age_max_s") is not None:
                out.append((f"status.progress age, max {label}", r["progress_age_max_s"], "s"))
        elif r["benchmark"] == "status_write":
            out.append(("API server CPU per progress write", r["rules_ms"], "ms"))
            out.append(("of which the CRD's CEL rules", r["rules_ms"] - r["no_rules_ms"], "ms"))
        elif r["benchmark"] == "overhead":
            out.append(("training steps/s, operator / bare", r["steps_ratio_median"], ""))
            out.append(("wall time, operator / bare", r["wall_ratio_median"], "ratio"))
            if "pod_step1_ratio_median" in r:
                out.append(("pod created -> step 1, operator / bare",
                            r["pod_step1_ratio_median"], ""))
            fast_exit = " (fast_exit)" if r.get("fast_exit") else ""
            out.append((f"last step -> job Succeeded{fast_exit} (median)",
                        r["operator_last_step_to_succeeded_median_s"], "s"))
            if "end_added_median_s" in r and not fast_exit:
                out.append(("last step -> job Succeeded, operator - bare (median)",
                            r["end_added_median_s"], ""))
            out.append(("bare: last step -> pods ended (median)",
                        r["bare_last_step_to_pods_done_median_s"], "s"))
            if "crash_to_restarting_median_s" in r:
                out.append(("crash -> job Restarting (median)",
                            r["crash_to_restarting_median_s"], "s"))
        elif r["benchmark"] == "recovery":
            out += recovery_rows(r["runs"])
    return out + kubeflow_ratio_rows(results)


def control_plane_ms(result: dict) -> float:
    """The control plane's CPU per job of a burst (API server, etcd, scheduler, controller-
    manager: burst.CONTROL_PLANE), summed."""
    return sum(v for k, v in result.items()
               if k.endswith("_cpu_ms_per_job") and not k.startswith("operator"))


def kubeflow_ratio_rows(results: list[dict]) -> list[tuple[str, float | None, str]]:
    """Ours against the tuned Go operator on the same burst size, where both ran: jobs/s
    (the median of our bursts against theirs) and peak RSS (our highest against theirs)."""
    ours = [r for r in results if r["benchmark"] == "throughput" and "pending" in r]
    theirs = [r["tuned"] for r in results if r["benchmark"] == "kubeflow" and "tuned" in r]
    if not ours or not theirs or ours[-1]["pending"]["jobs"] != theirs[-1]["jobs"]:
        return []
    go = theirs[-1]
    bursts = ours[-1].get("pending_bursts") or [ours[-1]["pending"]]
    rows = [("kubeflow: jobs/s, ours / Go tuned",
             statistics.median(b["jobs_per_s"] for b in bursts) / go["jobs_per_s"], "ratio")]
    if all("operator_peak_rss_mib" in b for b in bursts):
        rows.append(("kubeflow: peak RSS, ours / Go tuned",
                     max(b["operator_peak_rss_mib"] for b in bursts)
                     / go["operator_peak_rss_mib"], "ratio"))
    return rows


def recovery_rows(runs: list[dict]) -> list[tuple[str, float | None, str]]:
    """Per fault: our time with no step running, its ratio to the PyTorchJob's (a PyTorchJob
    that never trained again counts as infinitely slow), and how far the status's goodput is
    from the one the timings give."""
    out: list[tuple[str, float | None, str]] = []
    by = {(run["system"], run["fault"]): run for run in runs}
    for fault in ("crash", "delete", "node"):
        ours, theirs = by.get(("ours", fault)), by.get(("kubeflow", fault))
        if ours is None or ours.get("no_step_s") is None:
            continue
        out.append((f"recovery: {fault}, no step running", ours["no_step_s"], "s"))
        if theirs is not None:
            slower = theirs.get("no_step_s") or float("inf")
            out.append((f"recovery: {fault}, ours / PyTorchJob", ours["no_step_s"] / slower,
                        "ratio"))
        if ours.get("bench_goodput") is not None:
            out.append((f"recovery: {fault}, goodput status vs timings",
                        abs(ours["status_goodput"] - ours["bench_goodput"]), "points"))
    return out


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else os.environ.get("BENCH_JSON")
    if not path or not os.path.exists(path):
        print("no results (pass the JSON lines file the benchmarks wrote)")
        return 1
    with open(path) as f:
        results = [json.loads(line) for line in f if line.strip()]
    print("summary" + " " * 50 + "value      target")
    for name, value, unit in rows(results):
        if name in TARGETS:
            unit, target, higher = TARGETS[name]
            ok = value >= target if higher else value <= target
            verdict = f"{'>=' if higher else '<='} {target:g}  {'MET' if ok else 'MISSED'}"
        else:
            verdict = ""
        print(f"  {name:<54} {value:9.2f} {unit:<6} {verdict}")
    print(f"  load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} cores, shared)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
