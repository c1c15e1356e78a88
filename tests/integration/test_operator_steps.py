"""The operator's handlers run by kopf's own test runner (`kopf.testing.KopfRunner`, as
`kopf run -m accelerate_operator.handlers --standalone`) against the real API server, driven by
step tables (tests/helpers/steps.py): each step acts on the cluster as a user, a kubelet, a drain
or the clock would, then says what the job's status and children must show.

The pods never run: no scheduler places them and the test sets their state through their
`status` subresource, as jobset's integration tests do under envtest, so a scenario takes
seconds. One runner serves the module (one start-up); each scenario is a job of its own. The
chart's operator is scaled to zero meanwhile and restored at the end."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from kopf.testing import KopfRunner

from devtools.cluster import create_namespace, delete_namespace
from tests.helpers.jobs import JobBuilder
from tests.helpers.steps import (
    Cluster,
    Expect,
    bind,
    create,
    delete_configmap,
    delete_job,
    delete_pod,
    disrupt,
    evict,
    ghost_node,
    launch_fails,
    node_lost,
    nothing,
    pod_exits,
    pod_unschedulable,
    pod_waits,
    pod_webhook_back,
    pod_webhook_down,
    pods_running,
    pods_succeed,
    remove_pod_webhook,
    run_steps,
    suspend,
)
from tests.integration.test_operator_in_process import free_port


@pytest.fixture(scope="module")
def cluster(kubeconfig: str, deployed_operator_stopped: None) -> Iterator[Cluster]:
    namespace = create_namespace(kubeconfig, prefix="steps")
    args = ["run", "-m", "accelerate_operator.handlers", "--standalone", "-n", namespace]
    port = free_port()  # the in-process operator's report endpoint (launch_fails posts there)
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("ACCELERATE_OPERATOR_REPORT_PORT", str(port))
            with KopfRunner(args, timeout=60) as runner:
                yield Cluster(kubeconfig, namespace, report_port=port)
    finally:
        delete_namespace(kubeconfig, namespace)
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output


def job(nodes: int = 2) -> JobBuilder:
    """Two nodes of one process each, whose pods no node runs."""
    return JobBuilder().nodes(nodes).procs(1).command("pass").grace(1).unscheduled()


def test_a_job_gets_its_children_runs_and_succeeds_and_its_deletion_takes_them(cluster):
    run_steps(cluster, "simple", [
        ("the job is created", create(job()),
         Expect(phase="Pending", attempt=0, restarts=0, pods=2,
                reasons={"Created": "PodsCreated"}, events=["PodsCreated"],
                children=["configmap/simple-accelerate-config", "service/simple"])),
        ("its rendered ConfigMap is deleted by hand: it comes back", delete_configmap(),
         Expect(phase="Pending", pods=2, children=["configmap/simple-accelerate-config"])),
        ("both pods run", pods_running(0, 1),
         Expect(phase="Running", reasons={"Running": "AllNodesRunning"}, pods=2)),
        ("both pods succeed", pods_succeed(0, 1),
         Expect(phase="Succeeded", restarts=0, reasons={"Succeeded": "AllNodesSucceeded"},
                pods=2)),
    ])
    done = cluster.job("simple")
    assert done["status"]["completionTime"] and done["status"]["readyNodes"] == "0/2"
    # kopf writes nothing on a job: no finalizer (a job could not be deleted while the
    # operator is down), no annotation of its own.
    assert not done["metadata"].get("finalizers"), done["metadata"]
    assert not [a for a in done["metadata"].get("annotations") or {} if "kopf" in a]
    run_steps(cluster, "simple", [
        ("the job is deleted: its children go with it", delete_job(), Expect(gone=True)),
    ])


def test_a_failed_pod_restarts_the_whole_group_until_backoff_limit_fails_the_job(cluster):
    run_steps(cluster, "flaky", [
        ("created with backoffLimit 1", create(job().run_policy(backoffLimit=1)),
         Expect(phase="Pending", pods=2)),
        ("both pods run", pods_running(0, 1), Expect(phase="Running", pods=2)),
        ("rank 1 exits with 3: the whole group restarts, counted",
         pod_exits(1, 3, "rank 1 lost its GPU"),
         Expect(phase="Restarting", attempt=1, restarts=1, counted=1, pods=2,
                reasons={"Restarting": "PodFailed"}, events=["PodFailed"])),
        ("the new group runs", pods_running(0, 1), Expect(phase="Running", attempt=1, pods=2)),
        ("rank 0 exits with 3: no restart left, the job fails and its running pod stops",
         pod_exits(0, 3),
         Expect(phase="Failed", attempt=1, restarts=1, counted=1, pods=1,
                reasons={"Failed": "BackoffLimitExceeded"}, events=["BackoffLimitExceeded"])),
    ])
    status = cluster.job("flaky")["status"]
    assert status["lastFailure"].startswith("pod flaky-0 failed with exit code 3"), status
    assert status["lastFailureReason"] == "Error", status  # kept by the CRD's schema


def test_a_failed_launch_restarts_the_processes_in_the_same_pods_until_backoff_limit(cluster):
    run_steps(cluster, "inplace", [
        ("created with backoffLimit 1", create(job().run_policy(backoffLimit=1)),
         Expect(phase="Pending", attempt=0, pods=2, told=0)),
        ("both pods run", pods_running(0, 1), Expect(phase="Running", pods=2)),
    ])
    uids = {p["metadata"]["uid"] for p in cluster.pods("inplace")}
    run_steps(cluster, "inplace", [
        ("rank 1's launch ends with 1 and its pod waits: both pods are told attempt 1, counted",
         launch_fails(1, 1, "RuntimeError: boom"),
         Expect(phase="Running", attempt=1, restarts=1, counted=1, pods=2, told=1,
                events=["ProcessFailed"])),
    ])
    assert {p["metadata"]["uid"] for p in cluster.pods("inplace")} == uids  # the same pods
    status = cluster.job("inplace")["status"]
    assert status["groupAttempt"] == 0 and status["lastFailure"] == (
        "pod inplace-1 ended its training processes with exit code 1: RuntimeError: boom")
    run_steps(cluster, "inplace", [
        ("rank 0's launch of attempt 1 ends with 1: no restart left, the job fails",
         launch_fails(0, 1),
         Expect(phase="Failed", attempt=1, restarts=1, counted=1,
                reasons={"Failed": "BackoffLimitExceeded"})),
    ])


def test_a_drained_preempted_or_deleted_pod_restarts_the_group_without_counting(cluster):
    """backoffLimit 0: a counted restart would fail the job."""
    disrupted = Expect(phase="Restarting", counted=0, pods=2,
                       reasons={"Restarting": "Disrupted"})
    run_steps(cluster, "drain", [
        ("created with backoffLimit 0", create(job().run_policy(backoffLimit=0)),
         Expect(phase="Pending", pods=2)),
        ("both pods run", pods_running(0, 1), Expect(phase="Running")),
        ("a drain evicts pod 1 (the Eviction API)", evict(1),
         replace(disrupted, attempt=1, restarts=1)),
        ("the new group runs", pods_running(0, 1), Expect(phase="Running", attempt=1)),
        ("the scheduler preempts pod 0 (DisruptionTarget)", disrupt(0),
         replace(disrupted, attempt=2, restarts=2)),
        ("the new group runs", pods_running(0, 1), Expect(phase="Running", attempt=2)),
        ("someone deletes pod 1", delete_pod(1),
         replace(disrupted, attempt=3, restarts=3)),
    ])
    assert cluster.job("drain")["status"]["lastFailureReason"] == "PodDeleted"


@pytest.fixture
def ghost(cluster: Cluster) -> Iterator[str]:
    """A node no kubelet runs (a Node object only): what a lost node looks like to the API."""
    name = f"ghost-{cluster.namespace}"
    ghost_node(cluster, name)
    try:
        yield name
    finally:
        cluster.core.delete_node(name)


def test_a_lost_node_restarts_the_group_and_frees_the_names_its_pods_held(cluster, ghost):
    """backoffLimit 0: a counted restart would fail the job. No kubelet would ever confirm a
    graceful deletion of a pod on the ghost node: only a deletion with no grace period lets the
    new group take the names (Expect.pods counts the live pods of the new attempt)."""
    run_steps(cluster, "ghosted", [
        ("created with backoffLimit 0", create(job().run_policy(backoffLimit=0)),
         Expect(phase="Pending", pods=2)),
        ("both pods are placed on the node and run", bind(ghost, 0, 1),
         Expect(phase="Pending", pods=2)),
        ("they run", pods_running(0, 1), Expect(phase="Running", pods=2)),
        ("the node stopped reporting 30 s ago (nodeLostTimeoutSeconds is 10)",
         node_lost(ghost, 30),
         Expect(phase="Restarting", attempt=1, restarts=1, counted=0, pods=2,
                reasons={"Restarting": "Disrupted"}, events=["Disrupted"])),
    ])
    status = cluster.job("ghosted")["status"]
    assert f"was lost with its node: node {ghost} has been unreachable" in status["lastFailure"]
    assert status["goodput"]["interruptions"] == 1, status["goodput"]


def test_a_pod_stuck_terminating_on_a_lost_node_is_freed_once_the_node_is_lost(cluster, ghost):
    run_steps(cluster, "stuck", [
        ("created", create(job()), Expect(phase="Pending", pods=2)),
        ("both pods are placed on the node and run", bind(ghost, 0, 1),
         Expect(phase="Pending", pods=2)),
        ("they run", pods_running(0, 1), Expect(phase="Running", pods=2)),
        ("someone deletes pod 1: the group restarts, but no kubelet ends the old pods",
         delete_pod(1), Expect(phase="Restarting", attempt=1, restarts=1, pods=0)),
        ("the node is found lost: the old pods go, the new group comes", node_lost(ghost, 30),
         Expect(phase="Restarting", attempt=1, restarts=1, pods=2)),
    ])


def test_a_config_error_or_a_permanent_exit_code_fails_the_job_without_restarting(cluster):
    run_steps(cluster, "badcfg", [
        ("created", create(job()), Expect(phase="Pending", pods=2)),
        ("both pods run", pods_running(0, 1), Expect(phase="Running")),
        ("the trainer refuses its config (exit 78)",
         pod_exits(0, 78, "invalid configuration: unknown accelerate config key(s) num_gpus"),
         Expect(phase="Failed", restarts=0, attempt=0, reasons={"Failed": "InvalidConfig"})),
    ])
    assert "num_gpus" in cluster.job("badcfg")["status"]["lastFailure"]
    run_steps(cluster, "permanent", [
        ("created with permanentExitCodes [42]",
         create(job().run_policy(permanentExitCodes=[42])), Expect(phase="Pending", pods=2)),
        ("both pods run", pods_running(0, 1), Expect(phase="Running")),
        ("rank 1 exits with 42", pod_exits(1, 42),
         Expect(phase="Failed", restarts=0, reasons={"Failed": "PermanentFailure"})),
    ])


def test_the_active_deadline_fails_the_job_and_stops_its_pods(cluster):
    run_steps(cluster, "deadline", [
        ("created with activeDeadlineSeconds 4",
         create(job().run_policy(activeDeadlineSeconds=4)), Expect(phase="Pending", pods=2)),
        ("both pods run", pods_running(0, 1), Expect(phase="Running")),
        ("the deadline passes", nothing(),
         Expect(phase="Failed", pods=0, reasons={"Failed": "DeadlineExceeded"},
                events=["DeadlineExceeded"])),
    ])


def test_a_finished_job_is_deleted_with_its_children_when_its_ttl_passes(cluster):
    run_steps(cluster, "ttl", [
        ("created with ttlSecondsAfterFinished 3",
         create(job().run_policy(ttlSecondsAfterFinished=3)), Expect(phase="Pending", pods=2)),
        ("both pods run", pods_running(0, 1), Expect(phase="Running")),
        ("both pods succeed", pods_succeed(0, 1), Expect(phase="Succeeded")),
        ("the TTL passes", nothing(), Expect(gone=True)),
    ])


def test_suspend_deletes_the_pods_and_resume_starts_a_fresh_group_without_a_restart(cluster):
    run_steps(cluster, "pause", [
        ("created", create(job()), Expect(phase="Pending", pods=2)),
        ("both pods run", pods_running(0, 1), Expect(phase="Running")),
        ("suspended", suspend(True),
         Expect(phase="Suspended", attempt=0, pods=0, reasons={"Suspended": "Suspended"})),
        ("resumed: a fresh group", suspend(False),
         Expect(phase="Pending", attempt=1, restarts=0, counted=0, pods=2,
                events=["Resumed"])),
        ("the fresh group runs", pods_running(0, 1),
         Expect(phase="Running", attempt=1, restarts=0)),
    ])


def test_a_job_whose_pods_cannot_be_created_says_why_and_starts_when_they_can(cluster):
    try:
        run_steps(cluster, "blocked", [
            ("a webhook on pods is down", pod_webhook_down(), Expect(gone=True)),
            ("created: the pods are refused, a Warning says why", create(job()),
             Expect(pods=0, events=["ReconcileFailing"])),
            ("the webhook is gone: the pods are created", pod_webhook_back(),
             Expect(phase="Pending", attempt=0, restarts=0, pods=2)),
        ])
    finally:
        remove_pod_webhook(cluster)


def test_a_pod_that_cannot_start_says_why_until_the_waiting_timeout_fails_the_job(cluster):
    unschedulable = "0/2 nodes are available: 2 Insufficient cpu."
    run_steps(cluster, "nostart", [
        ("created with a 20 s waiting timeout", create(job().run_policy(waitingTimeoutSeconds=20)),
         Expect(phase="Pending", pods=2)),
        ("pod 1 cannot pull its image", pod_waits(1, "ErrImagePull", "not found"),
         Expect(phase="Pending", reasons={"Waiting": "ErrImagePull"}, events=["ErrImagePull"])),
        ("the kubelet backs off: the same cause", pod_waits(1, "ImagePullBackOff", "Back-off"),
         Expect(phase="Pending", reasons={"Waiting": "ImagePullBackOff"})),
        ("pod 0 is unschedulable: a cause of its own, named first",
         pod_unschedulable(0, unschedulable),
         Expect(phase="Pending", reasons={"Waiting": "Unschedulable"},
                events=["Unschedulable"])),
    ])
    waiting = cluster.job("nostart")
    assert waiting["status"]["reason"] == "Unschedulable"  # kept by the CRD's schema
    events = cluster.core.list_namespaced_event(
        cluster.namespace, field_selector="involvedObject.name=nostart").items
    pulls = [e for e in events if e.reason in ("ErrImagePull", "ImagePullBackOff")]
    assert len(pulls) == 1 and pulls[0].message.startswith("pod nostart-1 cannot start"), pulls
    run_steps(cluster, "nostart", [
        ("20 s after the pods were created the job fails", nothing(),
         Expect(phase="Failed", reasons={"Failed": "WaitingTimeoutExceeded"},
                events=["WaitingTimeoutExceeded"])),
    ])
