"""Experiment behind finding 5 of docs/benchmarks.md: what one create costs the operator's CPU,
through the official client in threads (how kube.py made its calls until then) against aiohttp
on the event loop (how it makes them now).

N ConfigMaps are created, 16 in flight, once each way, in this process, in a fresh namespace
(deleted at the end); the process's CPU time (user + system) per create is reported, and the
ratio. Both ways skip reading the created object back.

Usage: python bench/api_writes.py [--creates 600]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import time
from concurrent.futures import ThreadPoolExecutor

import kubernetes
from accelerate_operator.handlers import kube_from_environment
from accelerate_operator.kube import Kube
from common import Cluster, emit_result, machine_line, wait_for_cluster

IN_FLIGHT = 16


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def configmap(namespace: str, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "labels": {"bench": "writes"}},
            "data": {"config.yaml": "key: value\n" * 20}}


async def through_threads(kube: Kube, namespace: str, creates: int) -> None:
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                       client_configuration=configuration)
    configuration.connection_pool_maxsize = 32
    core = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(configuration))
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(32))
    slots = asyncio.Semaphore(IN_FLIGHT)

    def create(i: int) -> None:
        response = core.create_namespaced_config_map(
            namespace, configmap(namespace, f"threads-{i}"), _preload_content=False)
        response.read()
        response.release_conn()

    async def one(i: int) -> None:
        async with slots:
            await asyncio.to_thread(create, i)

    await asyncio.gather(*(one(i) for i in range(creates)))


async def through_aiohttp(kube: Kube, namespace: str, creates: int) -> None:
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def one(i: int) -> None:
        async with slots:
            assert await kube.create_if_absent(configmap(namespace, f"aiohttp-{i}"))

    await asyncio.gather(*(one(i) for i in range(creates)))
    await kube.close()


def measure(way, namespace: str, creates: int) -> dict:
    kube = kube_from_environment()
    started, cpu = time.monotonic(), cpu_seconds()
    asyncio.run(way(kube, namespace, creates))
    wall, cpu = time.monotonic() - started, cpu_seconds() - cpu
    return {"creates": creates, "wall_s": round(wall, 2),
            "cpu_ms_per_create": round(1000 * cpu / creates, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--creates", type=int, default=600)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cluster = Cluster()
    wait_for_cluster(cluster)
    print(machine_line())
    namespace = cluster.create_namespace("bench-writes")
    try:
        result = {"threads": measure(through_threads, namespace, args.creates),
                  "aiohttp": measure(through_aiohttp, namespace, args.creates)}
    finally:
        cluster.delete_namespace(namespace)
    result["cpu_ratio"] = round(result["threads"]["cpu_ms_per_create"]
                                / result["aiohttp"]["cpu_ms_per_create"], 2)
    for way in ("threads", "aiohttp"):
        print(f"  {way:8s} {json.dumps(result[way])}")
    print(f"  CPU per create, official client in threads / aiohttp: {result['cpu_ratio']}x")
    emit_result("api_writes", result, args.json)


if __name__ == "__main__":
    main()
