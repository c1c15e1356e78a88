"""End to end, on the CPU nodes: a failed launch says its root cause on the job, as a user reads
it in `kubectl describe ajob` (its status and Warning events), not torchrun's summary (issue 48).

- a typo in the script path: python's own line, `can't open file '...': [Errno 2] ...`;
- a rank over its container's memory limit: the kernel's OOM killer ends that one process (the
  container lives on), and the job says out of memory with the limit, from the cgroup's counter.

Both jobs run at once, one pod x 2 processes, restartInPlace off and no restart allowed, so the
pod ends with the root cause first in its termination message."""

from __future__ import annotations

import json
import re

import pytest

from devtools.cluster import kubectl, wait_for
from tests.helpers.jobs import JobBuilder

pytestmark = pytest.mark.timeout(600)

IMAGE = "ghcr.io/accelerate-operator/trainer:0.1.0-cpu"
CPU = {"distributed_type": "MULTI_CPU", "use_cpu": True}
TYPO = "/opt/accelerate/examples/trian.py"
OOM_SCRIPT = """
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    hog = b"x" * (3 * 2**30)  # written, so every page is really used
dist.barrier()
"""


def job(name: str, *args: str, memory: str = "1500Mi") -> JobBuilder:
    return (JobBuilder(name).for_server().nodes(1).procs(2).config(**CPU)
            .run_policy(backoffLimit=0, restartInPlace=False, cleanPodPolicy="None").grace(1)
            .image(IMAGE).args(*args).env(OMP_NUM_THREADS="1")
            .container(resources={"requests": {"cpu": "10m", "memory": "64Mi"},
                                  "limits": {"memory": memory}}))


def said(kubeconfig: str, namespace: str, name: str) -> str:
    """Everything the job itself says: its status and its Warning events."""
    status = json.loads(kubectl("-n", namespace, "get", "acceleratejob", name, "-o", "json",
                                kubeconfig=kubeconfig).stdout).get("status") or {}
    events = json.loads(kubectl("-n", namespace, "get", "events", "-o", "json",
                                kubeconfig=kubeconfig).stdout)["items"]
    warnings = [e["message"] for e in events
                if e["involvedObject"]["name"] == name and e["type"] == "Warning"]
    return "\n".join([status.get("phase", ""), status.get("lastFailure") or "",
                      *[c.get("message", "") for c in status.get("conditions", [])], *warnings])


def test_a_script_typo_and_a_rank_out_of_memory_say_why_on_the_job(kubeconfig, namespace):
    kubectl("-n", namespace, "create", "configmap", "scripts",
            f"--from-literal=oom.py={OOM_SCRIPT}", kubeconfig=kubeconfig)
    oom = (job("oom", "/scripts/oom.py")
           .volume(name="scripts", configMap={"name": "scripts"})
           .container(volumeMounts=[{"name": "scripts", "mountPath": "/scripts"}]).build())
    # Python's own line comes from python running the script itself; under fast_exit (opt-in)
    # runpy reports the same failure as FileNotFoundError instead.
    jobs = [job("typo", TYPO).env(ACCELERATE_TRAINER_FAST_EXIT="0").build(), oom]
    kubectl("-n", namespace, "apply", "-f", "-", kubeconfig=kubeconfig,
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": jobs}))

    def failed(name: str) -> str | None:
        text = said(kubeconfig, namespace, name)
        return text if text.startswith("Failed") else None

    typo = wait_for(lambda: failed("typo"), timeout=300, interval=2,
                    description="the typo job to fail")
    # first, right after "exit code 1: ": not somewhere in torchrun's summary
    line = f": can't open file '{TYPO}': [Errno 2] No such file or directory"
    assert re.search(r"exit code 1: \S+" + re.escape(line), typo), typo
    memory = wait_for(lambda: failed("oom"), timeout=300, interval=2,
                      description="the out-of-memory job to fail")
    assert "out of memory" in memory and "memory limit 1500Mi" in memory, memory
    assert "rank 1" in memory, memory
