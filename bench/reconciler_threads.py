"""Experiment behind finding 1 of docs/benchmarks.md: how many threads the operator's API calls
get decides its throughput.

Drives the operator's own Reconciler and Kube (the code kopf calls, without kopf) over N job
bodies at once, in this process, against the cluster: each pass creates the job's ConfigMap,
Service and pods, patches its status and posts an event, exactly as in the operator. Once with
asyncio's default executor (min(32, cores + 4) threads), once with --threads threads.

The bodies are not stored as AccelerateJobs, so the deployed operator does not act on them; the
status patch gets a 404 (still one request, as in the operator); the children's owner does not
exist, so the garbage collector removes them, and the namespace is deleted at the end. Pods
stay Pending (a nodeSelector no node has).

Usage: python bench/reconciler_threads.py [--jobs 200] [--threads 32]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import sys
import time
import uuid

from accelerate_operator.kube import Kube
from accelerate_operator.reconciler import Reconciler
from common import Cluster, emit_result, machine_line, wait_for_cluster
from throughput import job_body


async def reconcile_all(kube: Kube, namespace: str, jobs: int, threads: int | None) -> float:
    loop = asyncio.get_running_loop()
    if threads:
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(threads))
    reconciler = Reconciler(kube)
    tag = uuid.uuid4().hex[:4]
    bodies = []
    for i in range(jobs):
        body = job_body(namespace, f"exp-{tag}-{i:04d}", "pending")
        body["metadata"].update(uid=str(uuid.uuid4()), generation=1)
        bodies.append(body)
    started = time.monotonic()
    await asyncio.gather(*(reconciler.reconcile(body, []) for body in bodies))
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--json", default=os.environ.get("BENCH_JSON"))
    args = parser.parse_args(argv)

    cluster = Cluster()
    wait_for_cluster(cluster)
    default_threads = min(32, (os.cpu_count() or 1) + 4)
    print(f"reconciler threads: {args.jobs} job passes through the operator's Reconciler; "
          f"{machine_line()}", flush=True)
    result = {"jobs": args.jobs}
    for label, threads in (("default", None), ("threads", args.threads)):
        namespace = cluster.create_namespace("bench-threads")
        try:
            kube = Kube(cluster.api)
            elapsed = asyncio.run(reconcile_all(kube, namespace, args.jobs, threads))
        finally:
            cluster.delete_namespace(namespace, wait=False)
        count = threads or default_threads
        result[label] = {"threads": count, "seconds": elapsed, "jobs_per_s": args.jobs / elapsed}
        print(f"  {count:2d} threads ({label}): {args.jobs} jobs in {elapsed:.2f}s = "
              f"{args.jobs / elapsed:.1f} jobs/s; {machine_line()}", flush=True)
    ratio = result["threads"]["jobs_per_s"] / result["default"]["jobs_per_s"]
    result["speedup"] = ratio
    print(f"reconciler threads: {result['threads']['threads']} threads vs "
          f"{result['default']['threads']}: {ratio:.2f}x jobs/s")
    emit_result("reconciler_threads", result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
