"""A takeover from stale indexes, on the real API server: two replicas of the operator
(`python -m accelerate_operator --peering`, processes of this host, test_operator_cut_off.py's),
one whose watches were paused while the other restarted a job's group and deleted another job.
It takes over and restarts, remakes and says nothing (the cache sync and the index audit). A
module of its own, so that pytest-xdist runs it beside the cut-off test, not after it.

The operator the chart deployed is scaled to zero meanwhile, so that only these two act."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from devtools.cluster import kubectl, kubectl_json, wait_for
from tests.helpers.jobs import apply_job, command_job, get_job, recent_events
from tests.integration.test_operator_cut_off import Replica, created, grant, replica_kubeconfig

pytestmark = pytest.mark.cluster


def job_pods(kubeconfig: str, namespace: str, job: str) -> dict[str, str]:
    """name -> uid of the job's pods."""
    out = kubectl_json("-n", namespace, "get", "pods", "-l",
                       f"accelerate-operator.io/job-name={job}", kubeconfig=kubeconfig)
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in out["items"]}


def running(status: dict, restarts: int) -> bool:
    """Running after `restarts` restarts, from one read of the status (two reads may straddle
    a restart's write: Running from before it, its count from after)."""
    return status.get("phase") == "Running" and status.get("restarts", 0) == restarts


def events_of(kubeconfig: str, namespace: str, job: str) -> int:
    """How many events were posted about the job (repeats counted)."""
    out = kubectl_json("-n", namespace, "get", "events", "--field-selector",
                       f"involvedObject.name={job},involvedObject.kind=AccelerateJob",
                       kubeconfig=kubeconfig)
    return sum(event.get("count") or 1 for event in out["items"])


def test_a_replica_that_takes_over_with_stale_indexes_restarts_and_remakes_nothing(
        kubeconfig: str, namespace: str, tmp_path: Path, deployed_operator_stopped: None):
    """Replica b runs alone and starts two jobs; a, of higher priority, joins (kopf pauses b's
    watches: its indexes freeze), restarts one job's group once (pod 0 deleted), and the other
    job is deleted; b's indexes show none of it. a stops; b takes over. Its first passes must
    wait for its indexes (cache_sync.py) and its index audit: the job runs on with the same pods
    and one restart, not a second one for pods b would count as deleted, and the deleted job
    gets no pass (nothing made or said for it again)."""
    grant(kubeconfig, namespace, ["replica-a", "replica-b"])
    started: list[Replica] = []

    def start(account: str, priority: int) -> Replica:
        started.append(Replica(replica_kubeconfig(kubeconfig, namespace, account,
                                                  tmp_path / account),
                               namespace, priority, tmp_path / f"{account}.log"))
        return started[-1]

    def status() -> dict:
        return get_job(kubeconfig, namespace, "steady").get("status") or {}

    try:
        b = start("replica-b", 100)
        wait_for(lambda: b.probe().get("paused") is False, timeout=90, description="b active")
        for name, nodes in (("steady", 2), ("doomed", 1)):
            apply_job(kubeconfig, namespace, command_job(
                name, "import time\ntime.sleep(900)", nodes=nodes).build())
        wait_for(lambda: running(status(), 0) and created(kubeconfig, namespace, "doomed"),
                 timeout=120, description="b to run the jobs")
        a = start("replica-a", 200)
        wait_for(lambda: a.probe().get("paused") is False and b.probe().get("paused") is True,
                 timeout=90, description="a active, b paused")
        kubectl("-n", namespace, "delete", "pod", "steady-0", "--wait=false",
                kubeconfig=kubeconfig)
        kubectl("-n", namespace, "delete", "acceleratejob", "doomed", kubeconfig=kubeconfig)
        wait_for(lambda: running(status(), 1) and not created(kubeconfig, namespace, "doomed"),
                 timeout=120,
                 description="a to restart the group once and run it; doomed's children gone")
        pods, said = job_pods(kubeconfig, namespace, "steady"), events_of(kubeconfig, namespace,
                                                                        "doomed")
        a.stop()
        wait_for(lambda: b.probe().get("paused") is False, timeout=60,
                 description="b to take over")
        time.sleep(12)  # b's passes run on every job as it takes over
        assert running(status(), 1), recent_events(kubeconfig, namespace)
        assert job_pods(kubeconfig, namespace, "steady") == pods, recent_events(kubeconfig,
                                                                                namespace)
        assert created(kubeconfig, namespace, "doomed") is None
        assert events_of(kubeconfig, namespace, "doomed") == said
    finally:
        for replica in started:
            replica.stop()
