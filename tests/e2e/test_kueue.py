"""Queueing with a real Kueue (hack/install-kueue.sh: built from the Go module proxy, installed on
the cluster with its webhooks) and the operator the chart deployed with kueue.enabled: a
ClusterQueue with quota for one two-node job admits a second job only when the first has
finished; beside it, in a namespace and ClusterQueue of its own, a low-priority job is preempted by
a high-priority one, waits, is admitted again and finishes from its checkpoint, every step after
it trained once; a group that cannot fit never starts a pod (queued from the module's start to its
end). Real CPU training on the local nodes, as in test_resume_after_rank_failure.py.

Kueue is installed for this module and removed after it, so no other test runs under its
webhooks; `make test` builds it before the first test (hack/build-kueue.sh). Where it cannot be
built the module fails: it is never skipped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime

import pytest
from accelerate_operator.kueue import choose_kueue_version

from devtools.cluster import ROOT, create_namespace, delete_namespace, kubectl, wait_for
from tests.helpers.jobs import (
    JobBuilder,
    apply_job,
    condition,
    get_job,
    phase_is,
    wait_for_job,
)
from tests.helpers.shared_volume import shared_dir

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
# One two-node job of the example (500m CPU and 1Gi per pod) fits, not two, nor three nodes.
QUOTA = {"cpu": "1", "memory": "2Gi"}
MAX_STEPS, CHECKPOINT_EVERY, PREEMPT_AFTER = 40, 5, 12


def run_hack(kubeconfig: str, script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "hack" / script), *args], capture_output=True, text=True,
                          env={**os.environ, "KUBECONFIG": kubeconfig})


def deploy_operator(kubeconfig: str) -> None:
    """The chart turns the Kueue integration on where the cluster serves Workloads."""
    deployed = run_hack(kubeconfig, "deploy-operator.sh")
    assert deployed.returncode == 0, f"hack/deploy-operator.sh failed:\n{deployed.stderr[-4000:]}"


@pytest.fixture(scope="module")
def kueue(kubeconfig: str) -> Iterator[str]:
    done = run_hack(kubeconfig, "install-kueue.sh")
    assert done.returncode == 0, f"hack/install-kueue.sh failed:\n{done.stderr[-4000:]}"
    deploy_operator(kubeconfig)
    yield kubeconfig
    # Leave the cluster as the other tests expect it: Kueue's webhooks fail closed on every pod,
    # so a Kueue whose controller restarts (an API server restart makes it lose its lease)
    # would block the pods of jobs that never asked for Kueue. Then deploy without it again.
    removed = run_hack(kubeconfig, "install-kueue.sh", "--uninstall")
    assert removed.returncode == 0, f"uninstalling Kueue failed:\n{removed.stderr[-4000:]}"
    deploy_operator(kubeconfig)


def kueue_api(kubeconfig: str) -> str:
    """The apiVersion Kueue serves here, chosen as the operator chooses it (v1beta2 from
    Kueue v0.15, the only one in v0.20; v1beta1 before)."""
    group = json.loads(kubectl("get", "--raw", "/apis/kueue.x-k8s.io",
                               kubeconfig=kubeconfig).stdout)
    return f"kueue.x-k8s.io/{choose_kueue_version(group)}"


def apply(kubeconfig: str, *objects: dict) -> None:
    kubectl("apply", "--server-side", "-f", "-", kubeconfig=kubeconfig,
            input="\n---\n".join(json.dumps(o) for o in objects))


@contextmanager
def local_queue(kueue: str, namespace: str) -> Iterator[str]:
    """A ResourceFlavor, a ClusterQueue (QUOTA, preemption of lower priorities) for `namespace`
    only, a LocalQueue in it, and two WorkloadPriorityClasses. Yields the LocalQueue."""
    name = f"kueue-h-{namespace}"[:63]
    api = kueue_api(kueue)
    cluster_objects = [
        {"apiVersion": api, "kind": "ResourceFlavor",
         "metadata": {"name": name}},
        {"apiVersion": api, "kind": "ClusterQueue",
         "metadata": {"name": name},
         "spec": {
             "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
             "preemption": {"withinClusterQueue": "LowerPriority"},
             "resourceGroups": [{"coveredResources": sorted(QUOTA), "flavors": [{
                 "name": name, "resources": [{"name": resource, "nominalQuota": quantity}
                                             for resource, quantity in sorted(QUOTA.items())]}]}],
         }},
        *({"apiVersion": api, "kind": "WorkloadPriorityClass",
           "metadata": {"name": f"{name}-{level}"}, "value": value}
          for level, value in (("low", 100), ("high", 1000))),
    ]
    apply(kueue, *cluster_objects)
    apply(kueue, {"apiVersion": api, "kind": "LocalQueue",
                  "metadata": {"name": "team", "namespace": namespace},
                  "spec": {"clusterQueue": name}})
    yield "team"
    kubectl("-n", namespace, "delete", "acceleratejobs,localqueues", "--all", "--wait=true",
            "--timeout=120s", kubeconfig=kueue, check=False)
    for obj in reversed(cluster_objects):
        kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], "--ignore-not-found",
                "--timeout=120s", kubeconfig=kueue, check=False)


@pytest.fixture(scope="module", autouse=True)
def too_big(kueue: str) -> Iterator[tuple[str, str]]:
    """A three-node job in a queue of its own, applied as the module starts: it waits through
    every test of the module, and the last checks that it never got a pod. Yields its namespace
    and queue."""
    namespace = create_namespace(kueue, prefix="kueue-too-big")
    try:
        with local_queue(kueue, namespace) as name:
            apply_job(kueue, namespace, queued_job("toobig", name, nodes=3))
            yield namespace, name
    finally:
        delete_namespace(kueue, namespace)


def queued_job(name: str, queue: str, *, nodes: int = 2, steps: int = 20,
               priority: str | None = None, checkpoint_dir: str | None = None,
               sleep_per_step: float = 0.0, sleep_until_attempt: int | None = None) -> dict:
    job = (JobBuilder.from_example(name).queue(queue).nodes(nodes).procs(1)
           .run_policy(backoffLimit=0, cleanPodPolicy="None"))
    if priority:
        job.labels(**{PRIORITY_LABEL: priority})
    args = ["/opt/accelerate/examples/train.py", f"--max-steps={steps}", "--log-every=1",
            f"--sleep-per-step={sleep_per_step}"]
    if sleep_until_attempt is not None:
        args.append(f"--sleep-until-attempt={sleep_until_attempt}")
    if checkpoint_dir:
        job.checkpoint("checkpoints", "/checkpoints").volume(
            name="checkpoints", hostPath={"path": checkpoint_dir, "type": "DirectoryOrCreate"})
        args.append(f"--checkpoint-every={CHECKPOINT_EVERY}")
    return job.args(*args).build()


def pods_of(kubeconfig: str, namespace: str, job: str) -> list[str]:
    out = kubectl("-n", namespace, "get", "pods", "-l", f"accelerate-operator.io/job-name={job}",
                  "-o", "name", kubeconfig=kubeconfig)
    return out.stdout.split()


def workload_of(kubeconfig: str, namespace: str, job: str) -> dict:
    out = kubectl("-n", namespace, "get", "workloads.kueue.x-k8s.io", "-l",
                  f"accelerate-operator.io/job-name={job}", "-o", "json", kubeconfig=kubeconfig)
    items = json.loads(out.stdout)["items"]
    return items[0] if items else {}


def workload_condition(workload: dict, type_: str) -> dict:
    return next((c for c in (workload.get("status") or {}).get("conditions") or []
                 if c["type"] == type_), {})


def stamp(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def first_step_at(kubeconfig: str, namespace: str, pod: str) -> datetime:
    """When rank 0 printed its first STEP line (kubectl's own timestamps)."""
    log = kubectl("-n", namespace, "logs", pod, "--timestamps", kubeconfig=kubeconfig).stdout
    line = next(line for line in log.splitlines() if "STEP step=" in line)
    return stamp(line.split()[0].split(".")[0].rstrip("Z") + "Z")  # RFC 3339, nanoseconds


def steps_in(kubeconfig: str, namespace: str, pod: str) -> tuple[str, list[int]]:
    log = kubectl("-n", namespace, "logs", pod, kubeconfig=kubeconfig).stdout
    return log, [int(s) for s in re.findall(r"STEP step=(\d+)", log)]


def a_second_job_gets_no_pod_until_the_first_finishes(kueue: str, namespace: str,
                                                       queue: str) -> None:
    apply_job(kueue, namespace, queued_job("first", queue))
    wait_for(lambda: len(pods_of(kueue, namespace, "first")) == 2, timeout=120,
             description="the first job's two pods")
    apply_job(kueue, namespace, queued_job("second", queue))
    wait_for_job(kueue, namespace, "second", phase_is("Queued"), timeout=60)
    row = kubectl("-n", namespace, "get", "ajob", "second", kubeconfig=kueue).stdout
    # NAME PHASE REASON QUEUE: Kueue's reason for waiting, then the queue.
    assert re.search(r"second\s+Queued\s+[A-Za-z]+\s+team\b", row), row
    while get_job(kueue, namespace, "first")["status"]["phase"] not in ("Succeeded", "Failed"):
        assert pods_of(kueue, namespace, "second") == [], "the second job started early"
        time.sleep(1)
    assert get_job(kueue, namespace, "first")["status"]["phase"] == "Succeeded"
    freed = workload_condition(workload_of(kueue, namespace, "first"), "Finished")
    assert freed.get("status") == "True", freed

    done = wait_for_job(kueue, namespace, "second", phase_is("Succeeded", "Failed"),
                        timeout=600, description="the second job to finish")
    assert done["status"]["phase"] == "Succeeded", done["status"]
    events = kubectl("-n", namespace, "get", "events", "--field-selector",
                     "involvedObject.name=second", "-o", "json", kubeconfig=kueue).stdout
    assert "Admitted" in {e["reason"] for e in json.loads(events)["items"]}
    waited = (first_step_at(kueue, namespace, "second-0")
              - stamp(freed["lastTransitionTime"])).total_seconds()
    print(f"\nkueue: quota freed (first job's Workload Finished) to the queued job's first "
          f"step: {waited:.0f}s")


def a_low_priority_job_is_preempted(kueue: str, namespace: str, queue: str) -> None:
    """The low-priority job trains past PREEMPT_AFTER, a high-priority one takes its quota:
    the low one is Queued (Preempted, a Warning), and none of its pods runs beside the high
    one's, which succeeds."""
    host_dir = shared_dir(kueue, namespace)
    priority = f"kueue-h-{namespace}"[:63]
    apply_job(kueue, namespace, queued_job(
        "low", queue, steps=MAX_STEPS, priority=f"{priority}-low", checkpoint_dir=host_dir.path,
        sleep_per_step=1.0, sleep_until_attempt=1))  # resumed, it trains at full speed
    wait_for(lambda: (get_job(kueue, namespace, "low").get("status", {}).get("progress", {})
                      .get("step", 0) >= PREEMPT_AFTER), timeout=300,
             description=f"the low-priority job past step {PREEMPT_AFTER}")
    apply_job(kueue, namespace, queued_job("high", queue, steps=10,
                                           priority=f"{priority}-high"))

    preempted = wait_for_job(kueue, namespace, "low", phase_is("Queued"), timeout=120,
                             description="the low-priority job to be evicted")
    queued = condition(preempted, "Queued")
    assert queued["status"] == "True" and "Preempted" in queued["reason"], queued
    events = kubectl("-n", namespace, "get", "events", "--field-selector",
                     "involvedObject.name=low", "-o", "json", kubeconfig=kueue).stdout
    assert any(e["type"] == "Warning" and "Preempted" in e["reason"]
               for e in json.loads(events)["items"])
    while get_job(kueue, namespace, "high")["status"].get("phase") not in ("Succeeded",
                                                                           "Failed"):
        low = get_job(kueue, namespace, "low")["status"]
        if low["phase"] == "Queued" and len(pods_of(kueue, namespace, "high")) == 2:
            assert pods_of(kueue, namespace, "low") == [], "the evicted group still runs"
        time.sleep(1)
    assert get_job(kueue, namespace, "high")["status"]["phase"] == "Succeeded"


def the_preempted_job_resumes_every_step_once(kueue: str, namespace: str) -> None:
    done = wait_for_job(kueue, namespace, "low", phase_is("Succeeded", "Failed"), timeout=900,
                        description="the resumed low-priority job to finish")
    status = done["status"]
    assert status["phase"] == "Succeeded", status
    assert status["restarts"] == 0  # an eviction is no failure (backoffLimit 0)
    assert status["queue"]["evictions"] == 1 and status["attempt"] == 1
    log, steps = steps_in(kueue, namespace, "low-0")
    resumed = re.search(r"RESUMED from=(\S+) step=(\d+)", log)
    assert resumed, log[-3000:]
    resumed_step = int(resumed.group(2))
    # The checkpoint the trainer saved when the eviction stopped it (checkpoint on SIGTERM,
    # past step PREEMPT_AFTER), or a periodic one if the stop came between two steps' saves.
    assert resumed_step >= CHECKPOINT_EVERY, resumed_step
    assert steps == list(range(resumed_step + 1, MAX_STEPS + 1))
    assert re.search(rf"TRAINING_DONE steps={MAX_STEPS} ", log), log[-2000:]
    finished = workload_condition(workload_of(kueue, namespace, "low"), "Finished")
    assert finished.get("status") == "True", finished
    print(f"\nkueue preemption: low-priority job resumed from step {resumed_step} of "
          f"{MAX_STEPS} after the high-priority job finished")


def preemption_story(kueue: str, namespace: str) -> None:
    with local_queue(kueue, namespace) as queue:
        a_low_priority_job_is_preempted(kueue, namespace, queue)
        the_preempted_job_resumes_every_step_once(kueue, namespace)


def quota_story(kueue: str, namespace: str) -> None:
    with local_queue(kueue, namespace) as queue:
        a_second_job_gets_no_pod_until_the_first_finishes(kueue, namespace, queue)


@pytest.fixture
def other_namespace(kueue: str) -> Iterator[str]:
    name = create_namespace(kueue, prefix="kueue-preempted")
    yield name
    delete_namespace(kueue, name)


def test_a_job_waits_for_quota_and_a_preempted_one_resumes_from_its_checkpoint_every_step_once(
        kueue, namespace, other_namespace):
    """Two stories side by side, each in a namespace whose ClusterQueue has quota for one
    two-node job: a second job gets no pod until the first finishes, then succeeds; a
    low-priority job preempted by a high-priority one waits, is admitted again and finishes
    from its checkpoint, every step after it trained once."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        stories = [pool.submit(quota_story, kueue, namespace),
                   pool.submit(preemption_story, kueue, other_namespace)]
    for story in stories:
        story.result()  # each story's own assertion, if it failed


def test_a_group_that_cannot_fit_never_starts_a_pod(kueue, too_big):
    # Queued since the module started: the test above ran meanwhile.
    namespace, queue = too_big
    wait_for(lambda: workload_condition(workload_of(kueue, namespace, "toobig"),
                                        "QuotaReserved").get("status") == "False",
             timeout=60, description="Kueue to find no quota for three nodes")
    assert pods_of(kueue, namespace, "toobig") == []
    # None ever existed: a pod made and deleted would have left its events (kept an hour).
    events = json.loads(kubectl("-n", namespace, "get", "events", "-o", "json",
                                kubeconfig=kueue).stdout)["items"]
    assert not [e for e in events if e["involvedObject"]["kind"] == "Pod"], events
    job = get_job(kueue, namespace, "toobig")
    assert job["status"]["phase"] == "Queued"
    assert job["status"]["queue"]["name"] == queue
    assert "waiting for Kueue" in condition(job, "Queued")["message"]
