"""What a burst of jobs costs, measured alike by throughput.py (this operator) and
kubeflow_compare.py (Kubeflow's training-operator): the burst created at once and timed until
every job is reconciled (BurstTracker, timed_burst), exact per-client API request counts
(FlowSchemas), and the CPU the control plane's processes spent per job."""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from common import (
    BENCH_LABEL,
    GROUP,
    OPERATOR_NAMESPACE,
    OPERATOR_SERVICE_ACCOUNT,
    PLURAL,
    Cluster,
    OperatorProcess,
    host_processes,
    read_metrics,
    wait_until,
)
from kubernetes.client.rest import ApiException

# ------------------------------------------------------------------ API request counting
# Exact per-client counts: FlowSchemas that match only the operator's ServiceAccount, one per
# (verb, resource) of interest, all mapped to the priority level the operator already uses
# (workload-low, through the built-in `service-accounts` schema), so its traffic is unchanged.
# apiserver_flowcontrol_dispatched_requests_total{flow_schema=...} then counts its requests.
# Another client (bench/kubeflow_compare.py's training-operator) gets its own CountedClient:
# another ServiceAccount, prefix, table and precedences.
FLOW_SCHEMA_PREFIX = "bench-accelerate-operator"
COUNTED = [  # (name, verbs, apiGroups, resources)
    ("create-pods", ["create"], [""], ["pods"]),
    ("create-configmaps", ["create"], [""], ["configmaps"]),
    ("create-services", ["create"], [""], ["services"]),
    ("create-events", ["create"], ["", "events.k8s.io"], ["events"]),
    ("patch-job-status", ["patch", "update"], [GROUP], [f"{PLURAL}/status"]),
    ("patch-job", ["patch", "update"], [GROUP], [PLURAL]),
    ("get", ["get"], ["*"], ["*"]),
    ("list-watch", ["list", "watch"], ["*"], ["*"]),
    ("delete", ["delete", "deletecollection"], ["*"], ["*"]),
    ("other", ["*"], ["*"], ["*"]),
]


@dataclass(frozen=True)
class CountedClient:
    """Whose requests the FlowSchemas count, under which names."""
    service_account: str
    namespace: str
    prefix: str
    counted: list = field(default_factory=list)  # rows like COUNTED's; "other" must be last
    first_precedence: int = 1000


ACCELERATE_OPERATOR = CountedClient(OPERATOR_SERVICE_ACCOUNT, OPERATOR_NAMESPACE,
                                    FLOW_SCHEMA_PREFIX, COUNTED)


def install_flow_schemas(cluster: Cluster, priority_level: str = "workload-low",
                         client: CountedClient = ACCELERATE_OPERATOR) -> None:
    subject = {"kind": "ServiceAccount",
               "serviceAccount": {"name": client.service_account,
                                  "namespace": client.namespace}}
    for precedence, (name, verbs, groups, resources) in enumerate(
            client.counted, start=client.first_precedence):
        rule: dict[str, Any] = {"subjects": [subject], "resourceRules": [{
            "verbs": verbs, "apiGroups": groups, "resources": resources,
            "clusterScope": True, "namespaces": ["*"]}]}
        if name == "other":
            rule["nonResourceRules"] = [{"verbs": ["*"], "nonResourceURLs": ["*"]}]
        body = {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema",
            "metadata": {"name": f"{client.prefix}-{name}", "labels": {BENCH_LABEL: "true"}},
            "spec": {"priorityLevelConfiguration": {"name": priority_level},
                     "matchingPrecedence": precedence,
                     "distinguisherMethod": {"type": "ByUser"}, "rules": [rule]},
        }
        try:
            cluster.flowcontrol.create_flow_schema(body)
        except ApiException as error:
            if error.status != 409:
                raise
    # The apiserver picks new schemas up asynchronously: wait until one has been seen.
    wait_until(lambda: all(_flow_schema_active(cluster, f"{client.prefix}-{name}")
                           for name, *_ in client.counted), 30, "the benchmark FlowSchemas")


def delete_flow_schemas(cluster: Cluster, client: CountedClient) -> None:
    for name, *_ in client.counted:
        try:
            cluster.flowcontrol.delete_flow_schema(f"{client.prefix}-{name}")
        except ApiException as error:
            if error.status != 404:
                raise


def _flow_schema_active(cluster: Cluster, name: str) -> bool:
    schema = cluster.flowcontrol.read_flow_schema(name)
    return not any(c.type == "Dangling" and c.status == "True"
                   for c in (schema.status.conditions or []) if schema.status)


def operator_request_counts(cluster: Cluster, client: CountedClient = ACCELERATE_OPERATOR
                            ) -> dict[str, float]:
    """Requests the operator's ServiceAccount made so far, by FlowSchema (name without prefix)."""
    counts = {name: 0.0 for name, *_ in client.counted}
    prefix = f'flow_schema="{client.prefix}-'
    for line in read_metrics(cluster).splitlines():
        if line.startswith("apiserver_flowcontrol_dispatched_requests_total{") and prefix in line:
            name = line.split(prefix, 1)[1].split('"', 1)[0]
            counts[name] = counts.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def diff_counts(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in after
            if after.get(k, 0) - before.get(k, 0)}


# ------------------------------------------------------------------ bursts
class BurstTracker:
    """Per-job state of a burst, fed by the watches (subclasses: on_event, which calls
    mark_reconciled, and describe): when each job was first reconciled, each pod first seen."""

    def __init__(self, names: list[str]):
        self.names = set(names)
        self.lock = threading.Lock()
        self.pod_seen: dict[str, float] = {}  # pod -> first seen
        self.reconciled_at: dict[str, float] = {}
        self.all_reconciled = threading.Event()

    def mark_reconciled(self, t: float, job: str) -> None:
        """Under self.lock."""
        if job not in self.reconciled_at:
            self.reconciled_at[job] = t
            if len(self.reconciled_at) == len(self.names):
                self.all_reconciled.set()

    def describe(self, job: str) -> str:
        """What is known of a job that is not reconciled yet (under self.lock)."""
        return ""

    def missing(self) -> str:
        with self.lock:
            left = sorted(self.names - set(self.reconciled_at))
            if not left:
                return "none"
            return f"{len(left)} jobs, e.g. {left[0]}: {self.describe(left[0])}"


def timed_burst(tracker: BurstTracker, create: Callable[[dict], None], bodies: list[dict],
                clients: int, timeout: float, pods_per_job: int) -> tuple[float, dict]:
    """Create every body at once (`clients` parallel calls) and wait until the tracker has seen
    every job reconciled. Returns the start time and the figures: submit_s, reconciled_s,
    jobs_per_s, pods_per_s, job_latency_p50_s and job_latency_p99_s."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(create, bodies))
    result = {"submit_s": time.monotonic() - t0}
    if not tracker.all_reconciled.wait(timeout):
        raise TimeoutError(f"not every job reconciled within {timeout}s; missing: "
                           f"{tracker.missing()}")
    with tracker.lock:
        done_at = max(tracker.reconciled_at.values())
        latencies = sorted(t - t0 for t in tracker.reconciled_at.values())
        pods_done_at = max(tracker.pod_seen.values())
    elapsed = done_at - t0
    result.update({
        "reconciled_s": elapsed,
        "jobs_per_s": len(bodies) / elapsed,
        "pods_per_s": pods_per_job * len(bodies) / (pods_done_at - t0),
        "job_latency_p50_s": percentile(latencies, 50),
        "job_latency_p99_s": percentile(latencies, 99),
    })
    return t0, result


def percentile(values: Iterable[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def control_plane_cpu(before: dict[str, float], processes: dict[str, OperatorProcess],
                      jobs: int) -> dict[str, float]:
    """`<process>_cpu_ms_per_job` for each control-plane process, since `before` (name -> CPU
    seconds, from the same processes)."""
    return {f"{name}_cpu_ms_per_job": (proc.cpu_seconds() - before[name]) * 1000 / jobs
            for name, proc in processes.items()}


def print_control_plane(label: str, result: dict) -> None:
    """The control plane's CPU per job of a burst's result, and their sum."""
    plane = {k.removesuffix("_cpu_ms_per_job"): v for k, v in result.items()
             if k.endswith("_cpu_ms_per_job") and not k.startswith("operator")}
    if plane:
        print(f"  [{label}] control plane CPU per job: "
              + ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(plane.items()))
              + f"; sum {sum(plane.values()):.1f} ms, with the operator "
              f"{sum(plane.values()) + result.get('operator_cpu_ms_per_job', 0):.1f} ms",
              flush=True)


def add_burst_arguments(parser: argparse.ArgumentParser, *, timeout: float) -> None:
    """The options every burst benchmark (throughput.py, kubeflow_compare.py) takes alike."""
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--clients", type=int, default=16, help="parallel create calls")
    parser.add_argument("--timeout", type=float, default=timeout)
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds after the last job is reconciled still counted")
    parser.add_argument("--json", default=os.environ.get("BENCH_JSON"))


CONTROL_PLANE = ("kube-apiserver", "etcd", "kube-scheduler", "kube-controller-manager")


def control_plane_processes() -> dict[str, OperatorProcess]:
    """The control plane's processes on this host (CONTROL_PLANE), by command name, the newest
    of each: their CPU time shows when they, not the operator, limit a burst, and what each
    operator's objects cost them. Empty on other clusters."""
    newest: dict[str, OperatorProcess] = {}
    for name, pids in host_processes(CONTROL_PLANE).items():
        started = []
        for pid in pids:
            try:
                started.append((OperatorProcess(pid).start_ticks(), pid))
            except OSError:
                continue
        if started:
            newest[name] = OperatorProcess(max(started)[1])
    return newest
