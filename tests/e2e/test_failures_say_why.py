"""Ordinary mistakes on the real nodes, read only from what the job itself says (its status, its
conditions, its Warning events, `kubectl get ajob`), as a user does before opening pods: an image
tag that does not exist, a CPU request no node meets, a pod over its memory limit (the kernel's
OOM killer, then a whole-group restart), a rank over its memory limit inside a pod that lives on,
a typo in the script path.

Every job starts at once, when the module starts, and each test waits for its own: the module
costs the slowest job, not their sum."""

from __future__ import annotations

import json
import re

import pytest

from devtools.cluster import create_namespace, delete_namespace, kubectl, wait_for
from devtools.images import TRAINER_CPU_IMAGE
from tests.helpers.jobs import JobBuilder, apply_jobs, command_job, condition, wait_for_job

pytestmark = pytest.mark.timeout(600)

PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull"}
SLEEP = "import time; time.sleep(600)"
CPU = {"distributed_type": "MULTI_CPU", "use_cpu": True}
TYPO = "/opt/accelerate/examples/trian.py"
# Rank 1 (pod oom-1) allocates until the kernel kills it at its 256Mi limit; pod oom-0 waits.
GREEDY = ("import os, time\n"
          "if os.environ.get('NODE_RANK') == '1':\n"
          "    print('allocating', flush=True)\n"
          "    blocks = []\n"
          "    while True:\n"
          "        blocks.append(bytearray(64 * 2**20))\n"
          "time.sleep(600)\n")
# Inside one pod of two processes, rank 1 writes 3 GiB under a 1500Mi limit: the kernel ends that
# process, the container lives on, and the trainer reads the cgroup's counter.
RANK_OOM = """
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    hog = b"x" * (3 * 2**30)  # written, so every page is really used
dist.barrier()
"""


def launch_job(name: str, *args: str) -> JobBuilder:
    """One pod x 2 processes, no restart of any kind: the pod ends with the root cause first in
    its termination message."""
    return (JobBuilder(name).for_server().nodes(1).procs(2).config(**CPU)
            .run_policy(backoffLimit=0, restartInPlace=False, cleanPodPolicy="None").grace(1)
            .image(TRAINER_CPU_IMAGE).args(*args).env(OMP_NUM_THREADS="1")
            .container(resources={"requests": {"cpu": "10m", "memory": "64Mi"},
                                  "limits": {"memory": "1500Mi"}}))


def jobs() -> list[dict]:
    pull = command_job("pull", SLEEP).image(TRAINER_CPU_IMAGE.rsplit(":", 1)[0] + ":no-such-tag")
    cpu = command_job("cpu", SLEEP).container(resources={"requests": {"cpu": "64"}})
    oom = command_job("oom", GREEDY).run_policy(backoffLimit=1).container(
        resources={"limits": {"memory": "256Mi"}, "requests": {"memory": "64Mi"}})
    # Python's own line comes from python running the script itself; under fast_exit (opt-in)
    # runpy reports the same failure as FileNotFoundError instead.
    typo = launch_job("typo", TYPO).env(ACCELERATE_TRAINER_FAST_EXIT="0")
    rank_oom = (launch_job("rank-oom", "/scripts/oom.py")
                .volume(name="scripts", configMap={"name": "scripts"})
                .container(volumeMounts=[{"name": "scripts", "mountPath": "/scripts"}]))
    # A Secret volume that does not exist: the kubelet says so only in the pod's events.
    mount = (command_job("mount", SLEEP).nodes(1)
             .volume(name="data", secret={"secretName": "no-such-secret"})
             .container(volumeMounts=[{"name": "data", "mountPath": "/data"}]))
    return [job.for_server().build() for job in (pull, cpu, oom, typo, rank_oom, mount)]


@pytest.fixture(scope="module")
def ns(kubeconfig: str):
    namespace = create_namespace(kubeconfig, prefix="says-why")
    kubectl("-n", namespace, "create", "configmap", "scripts",
            f"--from-literal=oom.py={RANK_OOM}", kubeconfig=kubeconfig)
    apply_jobs(kubeconfig, namespace, jobs())
    yield namespace
    delete_namespace(kubeconfig, namespace)


def warnings(kubeconfig: str, namespace: str, name: str) -> list[dict]:
    """The Warning events of the AccelerateJob itself, oldest first."""
    out = kubectl("-n", namespace, "get", "events", "-o", "json", "--field-selector",
                  f"involvedObject.kind=AccelerateJob,involvedObject.name={name},type=Warning",
                  kubeconfig=kubeconfig).stdout
    return sorted(json.loads(out)["items"], key=lambda e: e.get("lastTimestamp") or "")


def waits_for(reasons: set[str]):
    return lambda job: condition(job, "Waiting").get("status") == "True" \
        and condition(job, "Waiting").get("reason") in reasons


def reason_column(kubeconfig: str, namespace: str, name: str) -> str:
    """The REASON column of `kubectl get ajob`, as a user reads it."""
    header, row = kubectl("-n", namespace, "get", "acceleratejob", name,
                          kubeconfig=kubeconfig).stdout.splitlines()[:2]
    return row[header.index("REASON"):].split()[0]  # columns are aligned


def said(kubeconfig: str, namespace: str, name: str) -> str:
    """Everything the job itself says: its phase, lastFailure, conditions and Warning events."""
    status = json.loads(kubectl("-n", namespace, "get", "acceleratejob", name, "-o", "json",
                                kubeconfig=kubeconfig).stdout).get("status") or {}
    return "\n".join([status.get("phase", ""), status.get("lastFailure") or "",
                      *[c.get("message", "") for c in status.get("conditions", [])],
                      *[e["message"] for e in warnings(kubeconfig, namespace, name)]])


def failed(name: str):
    return lambda job: job.get("status", {}).get("phase") == "Failed"


def test_an_image_that_cannot_be_pulled_is_named_once(kubeconfig, ns):
    job = wait_for_job(kubeconfig, ns, "pull", waits_for(PULL_REASONS), timeout=60,
                       description="the Waiting condition to name the pull error")
    message = condition(job, "Waiting")["message"]
    assert message.startswith("pod pull-") and "container trainer" in message, message
    assert "no-such-tag" in message, message
    assert job["status"]["phase"] == "Pending" and job["status"]["reason"] in PULL_REASONS
    assert reason_column(kubeconfig, ns, "pull") in PULL_REASONS

    # One Warning per cause, however often the kubelet retries the pull: once it has failed
    # the pull twice (its own events count the retries), still one.
    def retried() -> bool:
        events = json.loads(kubectl("-n", ns, "get", "events", "-o", "json", "--field-selector",
                                    "involvedObject.kind=Pod", kubeconfig=kubeconfig).stdout)
        return any((e.get("count") or 1) >= 2 for e in events["items"]
                   if e["involvedObject"]["name"].startswith("pull-")
                   and e["reason"] == "Failed")
    wait_for(retried, timeout=90, interval=2, description="the kubelet to retry the pull")
    pulls = [e for e in warnings(kubeconfig, ns, "pull") if e["reason"] in PULL_REASONS]
    assert len(pulls) == 1 and pulls[0]["message"].startswith("pod pull-"), pulls


def test_a_cpu_request_no_node_meets_says_unschedulable_with_the_schedulers_message(
        kubeconfig, ns):
    job = wait_for_job(kubeconfig, ns, "cpu", waits_for({"Unschedulable"}), timeout=60,
                       description="the Waiting condition to say Unschedulable")
    message = condition(job, "Waiting")["message"]
    # Both pods wait for the same reason: the one named is whichever the scheduler marked first.
    assert re.match(r"pod cpu-[01] cannot be scheduled: Unschedulable: 0/", message), message
    assert "Insufficient cpu" in message, message
    assert reason_column(kubeconfig, ns, "cpu") == "Unschedulable"
    events = warnings(kubeconfig, ns, "cpu")
    assert [e["reason"] for e in events] == ["Unschedulable"], events
    assert "Insufficient cpu" in events[0]["message"]


def test_a_volume_that_cannot_be_mounted_is_named_from_the_pods_events(kubeconfig, ns):
    job = wait_for_job(kubeconfig, ns, "mount", waits_for({"FailedMount"}), timeout=150,
                       description="the Waiting condition to name the mount failure")
    message = condition(job, "Waiting")["message"]
    assert message.startswith("pod mount-0 cannot start: FailedMount: "), message
    assert 'secret "no-such-secret" not found' in message, message
    assert reason_column(kubeconfig, ns, "mount") == "FailedMount"
    assert [e["reason"] for e in warnings(kubeconfig, ns, "mount")] == ["FailedMount"]


def test_a_pod_over_its_memory_limit_restarts_the_group_then_says_out_of_memory(kubeconfig, ns):
    # The job was applied with the module's others: its restart (a few seconds) is long over by
    # now, and the Restarting condition, cleared at the next phase, only names that phase. What
    # the restart said stays in its event (the Restarting phase's, reason PodFailed), below.
    job = wait_for_job(kubeconfig, ns, "oom", failed("oom"), timeout=240,
                       description="the job to fail after one counted restart")
    status = job["status"]
    expected = ("out of memory: the kernel killed container trainer of pod oom-1 at its memory "
                "limit 256Mi (OOMKilled)")
    assert condition(job, "Failed")["message"].startswith(expected), status
    assert (status["reason"], status["restartsCounted"]) == ("BackoffLimitExceeded", 1), status
    assert status["restarts"] >= 1 and condition(job, "Restarting")["status"] == "False", status
    restarted = [e for e in warnings(kubeconfig, ns, "oom") if e["reason"] == "PodFailed"]
    assert restarted and restarted[0]["message"].startswith(expected), restarted
    assert "OOMKilled" in restarted[0]["message"], restarted


def test_a_script_path_typo_names_pythons_own_message_first(kubeconfig, ns):
    job = wait_for_job(kubeconfig, ns, "typo", failed("typo"), timeout=300,
                       description="the typo job to fail")
    first = condition(job, "Failed")["message"].splitlines()[0]
    assert "can't open file" in first and "trian.py" in first, first
    # first, right after "exit code 1: ": not somewhere in torchrun's summary
    line = f": can't open file '{TYPO}': [Errno 2] No such file or directory"
    assert re.search(r"exit code 1: \S+" + re.escape(line), said(kubeconfig, ns, "typo"))


def test_a_rank_out_of_memory_in_a_pod_that_lives_on_says_so_with_the_limit(kubeconfig, ns):
    wait_for_job(kubeconfig, ns, "rank-oom", failed("rank-oom"), timeout=300,
                 description="the out-of-memory job to fail")
    memory = said(kubeconfig, ns, "rank-oom")
    assert "out of memory" in memory and "memory limit 1500Mi" in memory, memory
    assert "rank 1" in memory, memory
