"""The pass's steps one by one, each a free function over explicit arguments (the policies of
outcome.py, group.py, startup.py, lifecycle.py and kueue/, the pieces of decide.py, the reads of
reads.py): what each decides from what it is given, with no pass around it. The whole pass is
tested in test_reconcile_steps.py, the lifecycle as a whole in test_operator_status.py."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from datetime import datetime, timedelta

import pytest
from accelerate_operator.api import parse_job
from accelerate_operator.decide import archive, build_pods, grace_ends, job_error
from accelerate_operator.group import (
    FAILED_EXIT,
    NODE_LOST,
    POD_DELETED,
    find_failures,
    launch_failures,
    restart,
    stall,
)
from accelerate_operator.kube import ApiException
from accelerate_operator.kueue.gate import queue_status, stop_group
from accelerate_operator.kueue.reads import read_kueue
from accelerate_operator.kueue.workload import KueueView, read_workload
from accelerate_operator.kueue.writes import active_write, finished_write, pods_ready_write
from accelerate_operator.lifecycle import JobError, finished, resume
from accelerate_operator.not_started import NotStarted
from accelerate_operator.outcome import (
    Activity,
    Counters,
    Ending,
    Facts,
    Outcome,
    conclude,
    node_lost,
    unreachable,
)
from accelerate_operator.pod_state import NodeState, ProcessExit
from accelerate_operator.progress import parse_report
from accelerate_operator.reads import read_config_source, read_creating_warning, read_lost_nodes
from accelerate_operator.startup import set_waiting, waiting_timeout
from accelerate_operator.state import Refusal
from accelerate_operator.status import StatusBuilder, merge_patch

from tests.helpers.fake_kube import FakeKube
from tests.helpers.jobs import JobBuilder, pod
from tests.helpers.passes import NOW, snapshot


def facts(pods=(), status=None, **policy) -> Facts:
    job = parse_job(JobBuilder("j").nodes(2).run_policy(**policy).build())
    return Facts(job, status or {}, tuple(pods), NOW)


def builder(f: Facts) -> StatusBuilder:
    return StatusBuilder(f.job, f.status, f.now)


# ---- outcome.py ----------------------------------------------------------------------------


def test_counters_read_the_status_and_a_new_group_moves_both_attempts():
    counters = Counters.of({"attempt": 3, "groupAttempt": 2, "restarts": 4})
    assert counters == Counters(attempt=3, group=2, restarts=4, counted=4)  # all counted before
    assert counters.new_group() == Counters(attempt=4, group=4, restarts=4, counted=4)


def test_a_node_counts_lost_only_after_the_timeout_and_until_then_says_when():
    since = NOW - timedelta(seconds=4)
    on_it = pod("j", 1, node="n")
    f = replace(facts([on_it], nodeLostTimeoutSeconds=10),
                lost_nodes={"n": NodeState("n", since, reporting=False)})
    assert node_lost(f, on_it) == (None, since + timedelta(seconds=10))
    assert not unreachable(f, on_it)
    later = replace(f, now=NOW + timedelta(seconds=7))
    why, due = node_lost(later, on_it)
    assert due is None and why.startswith("node n has been unreachable")
    assert unreachable(later, on_it)
    assert node_lost(f, pod("j", 0, node="ready-node")) == (None, None)


def test_conclude_writes_the_attempts_and_asks_back_at_the_earliest_due_time():
    f = facts([pod("j", 0), pod("j", 1)])
    out = builder(f)
    out.status["phase"] = "Running"
    outcome = conclude(f, out, Counters(2, 1, 1, 1), Ending(
        due=(NOW + timedelta(seconds=30), None, NOW + timedelta(seconds=5))))
    assert (outcome.status["attempt"], outcome.status["groupAttempt"]) == (2, 1)
    assert outcome.requeue_after == 5.0
    same = conclude(f, builder(f), Counters(1, 1, 0, 0))
    assert "groupAttempt" not in same.status


def test_a_restart_stops_a_formed_group_gracefully_and_one_that_never_formed_at_once():
    formed = facts([pod("j", 0), pod("j", 1, "Failed", exit_code=1)], backoffLimit=3)
    outcome = restart(formed, builder(formed), Counters(0, 0, 0, 0), "rank 1 failed",
                      "Failed", Ending(), counted=True)
    assert (outcome.delete, outcome.force_delete) == (("j-0", "j-1"), ())  # ranks may save
    # Pod 1 still pulls its image: pod 0 only waits for it, and no rank has trained a step to
    # save.
    unformed = facts([pod("j", 0, node="n1"), pod("j", 1, "Pending", node="n2")],
                     backoffLimit=3)
    outcome = restart(unformed, builder(unformed), Counters(0, 0, 0, 0), "pod j-0 evicted",
                      "Disrupted", Ending(), counted=False)
    assert (outcome.delete, outcome.force_delete) == ((), ("j-0", "j-1"))
    assert outcome.group == 1


def test_conclude_deletes_pods_of_a_silent_lost_node_with_no_grace_period():
    gone = pod("j", 1, node="n")
    f = replace(facts([pod("j", 0), gone]),
                lost_nodes={"n": NodeState("n", None, reporting=False)})
    out = builder(f)
    outcome = conclude(f, out, Counters(1, 1, 1, 0), Ending(delete=["j-0", "j-1"]))
    assert (outcome.delete, outcome.force_delete) == (("j-0",), ("j-1",))


def test_conclude_tells_the_groups_running_pods_the_attempt_they_must_run():
    told, behind = replace(pod("j", 0), run_attempt=2), replace(pod("j", 1), run_attempt=1)
    f = facts([told, behind])
    out = builder(f)
    out.status["phase"] = "Restarting"
    assert conclude(f, out, Counters(2, 0, 1, 1)).tell == ("j-1",)


# ---- group.py ------------------------------------------------------------------------------


def test_failures_are_read_disruptions_apart_from_failed_pods_and_a_missing_pod_after_running():
    f = facts()
    current = [pod("j", 0, "Failed", exit_code=1),
               replace(pod("j", 1), disruption="EvictionByEvictionAPI")]
    failures = find_failures(f.job, current, was_running=False, lost={})
    assert [(x.pod, x.reason, x.disrupted) for x in failures] == [
        ("j-0", FAILED_EXIT, False), ("j-1", "EvictionByEvictionAPI", True)]
    lost = find_failures(f.job, [pod("j", 0)], was_running=True, lost={"j-0": "node n is gone"})
    assert [(x.pod, x.reason) for x in lost] == [("j-0", NODE_LOST), ("j-1", POD_DELETED)]


def test_a_launch_failure_counts_only_for_the_attempt_now_running():
    ended = replace(pod("j", 0), exit=ProcessExit(2, 1, "boom"))
    assert [f.exit_code for f in launch_failures([ended], 2)] == [1]
    assert launch_failures([ended], 3) == []


def test_a_running_group_is_stalled_once_rank_0_is_quiet_past_the_timeout():
    status = {"phase": "Running", "conditions": [{
        "type": "Running", "status": "True", "lastTransitionTime": "2026-01-01T11:00:00Z"}]}
    quiet = replace(facts([pod("j", 0), pod("j", 1)], status, stallTimeoutSeconds=60),
                    activity=Activity(NOW - timedelta(seconds=30), 7))
    assert stall(quiet, builder(quiet), quiet.pods) == (None, NOW + timedelta(seconds=30))
    later = replace(quiet, now=NOW + timedelta(seconds=31))
    message, due = stall(later, builder(later), later.pods)
    assert due is None and "for 60s" in message and "the last step seen is 7" in message


def test_a_run_whose_rank_0_reported_its_last_step_is_not_timed_however_quiet():
    # A final save or upload, or the processes' exit on a loaded node: a restart would only
    # train again from the last checkpoint.
    status = {"phase": "Running", "conditions": [{
        "type": "Running", "status": "True", "lastTransitionTime": "2026-01-01T11:00:00Z"}]}
    done = replace(facts([pod("j", 0), pod("j", 1)], status, stallTimeoutSeconds=60),
                   activity=Activity(NOW - timedelta(seconds=3600), 80, last_step_done=True))
    assert stall(done, builder(done), done.pods) == (None, None)


@pytest.mark.parametrize(("progress", "done"), [
    ({"step": 80, "total_steps": 80}, True), ({"step": 81, "total_steps": 80}, True),
    ({"step": 79, "total_steps": 80}, False), ({"step": 80}, False),
    ({"step": 0, "total_steps": 0}, False), ({"step": 80, "total_steps": "80"}, False)])
def test_the_last_step_is_done_when_the_step_reaches_the_scripts_total(progress, done):
    report = parse_report(json.dumps({"progress": progress,
                                      "lastOutputTime": "2026-01-01T11:00:00.000Z"}))
    assert report.last_step_done is done


# ---- startup.py ----------------------------------------------------------------------------


def test_the_waiting_timeout_is_due_from_the_groups_creation_then_fails_naming_the_pod():
    waiting = [pod("j", 0, "Pending")]
    created = NOW - timedelta(seconds=50)
    assert waiting_timeout(60, created, "Pending", waiting, NOW) == (
        None, created + timedelta(seconds=60))
    failed, _ = waiting_timeout(60, created, "Pending", waiting, NOW + timedelta(seconds=10))
    assert failed.startswith("not started 60s after") and "pod j-0 is Pending" in failed
    assert waiting_timeout(0, created, "Pending", waiting, NOW) == (None, None)  # forever


def test_the_waiting_condition_gets_one_warning_per_cause():
    from accelerate_operator.not_started import NotStarted

    f = facts()
    pulling = [replace(pod("j", 0, "Pending"), not_started=NotStarted("ErrImagePull", "nope"))]
    out = builder(f)
    set_waiting(out, pulling)
    assert [e.reason for e in out.events] == ["ErrImagePull"]
    again = StatusBuilder(f.job, {"conditions": list(out.conditions.values())}, NOW)
    backoff = [replace(pulling[0], not_started=NotStarted("ImagePullBackOff", "nope"))]
    set_waiting(again, backoff)  # the same cause: no second Warning
    assert again.events == [] and again.conditions["Waiting"]["reason"] == "ImagePullBackOff"


# ---- lifecycle.py --------------------------------------------------------------------------


def test_a_finished_job_cleans_up_and_is_deleted_once_its_ttl_has_passed():
    done = {"phase": "Succeeded", "completionTime": "2026-01-01T11:59:00Z"}
    f = facts([pod("j", 0, "Running")], done, ttlSecondsAfterFinished=120)
    early = finished(f, builder(f), Counters.of(done))
    assert (early.delete, early.delete_job, early.requeue_after) == (("j-0",), False, 60.0)
    late = replace(f, now=NOW + timedelta(minutes=2))
    assert finished(late, builder(late), Counters.of(done)).delete_job


def test_a_resumed_job_starts_a_fresh_group():
    f = facts(status={"phase": "Suspended", "attempt": 1})
    out = builder(f)
    assert resume(out, Counters.of(f.status)) == Counters(2, 2, 0, 0)
    assert out.status["phase"] == "Pending" and [e.reason for e in out.events] == ["Resumed"]


# ---- kueue/ --------------------------------------------------------------------------------


def workload(*conditions, active=True, annotations=None) -> dict:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": "wl", "namespace": "ml", "annotations": annotations or {}},
            "spec": {"active": active},
            "status": {"conditions": [
                {"type": t, "status": s, "reason": r, "message": "",
                 "lastTransitionTime": "2026-01-01T00:00:00Z"} for t, s, r in conditions],
                **({"admission": {"clusterQueue": "cq", "podSetAssignments": [
                    {"name": "main", "flavors": {"cpu": "default"}}]}}
                   if ("Admitted", "True", "Admitted") in conditions else {})}}


ADMITTED = ("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted")


def test_the_queue_status_names_the_queue_workload_and_where_kueue_admitted_it():
    view = KueueView(workload(*ADMITTED), queue="team")
    assert queue_status(view, {"evictions": 2}) == {
        "name": "team", "workload": "wl", "clusterQueue": "cq", "flavors": ["default"],
        "evictions": 2}


def test_stopping_an_evicted_group_counts_the_eviction_and_releases_only_once_no_pod_holds():
    evicted = read_workload(workload(*ADMITTED, ("Evicted", "True", "Preempted")))
    running = facts([pod("j", 0), pod("j", 1)])
    out = builder(running)
    out.status["queue"] = {}
    counters, release = stop_group(running, out, Counters(0, 0, 0, 0), evicted, {})
    assert counters == Counters(1, 1, 0, 0) and out.status["queue"]["evictions"] == 1
    assert release is False  # its pods still hold the nodes
    gone = facts()
    assert stop_group(gone, builder(gone), Counters(1, 1, 0, 0), evicted, {}) == (
        Counters(1, 1, 0, 0), True)


def test_what_kueue_is_told_follows_the_users_suspend_the_group_and_the_end():
    admitted = read_workload(workload(*ADMITTED))
    assert active_write(admitted, wants_active=False) is False
    record = read_workload(workload(*ADMITTED, active=False, annotations={
        "accelerate-operator.io/requested-active": "true"}))
    assert active_write(record, wants_active=True) is None  # Kueue deactivated it: left so
    assert pods_ready_write(admitted, "Running") is True
    assert pods_ready_write(admitted, "Pending") is None  # never set, nothing to unset
    assert finished_write(admitted, {"phase": "Failed", "conditions": [
        {"type": "Failed", "message": "boom"}]}) == ("Failed", "boom")


def test_kueue_reads_the_priority_class_before_the_workload_and_the_flavors_after_admission():
    job = parse_job(JobBuilder("j").nodes(2).build())
    objects = {("workloadpriorityclasses", "high"): {"value": 100},
               ("resourceflavors", "default"): {"spec": {"nodeLabels": {"zone": "a"}}}}
    reads = []

    async def read(plural, name):
        reads.append((plural, name))
        return objects.get((plural, name))

    view, error = asyncio.run(read_kueue(KueueView(priority_class="high"), job, (), read))
    assert (view.priority, error) == (100, None)
    _, error = asyncio.run(read_kueue(KueueView(priority_class="low"), job, (), read))
    assert "WorkloadPriorityClass 'low', which does not exist" in error
    admitted = KueueView(workload(*ADMITTED))
    view, _ = asyncio.run(read_kueue(admitted, job, (), read))
    assert view.flavors == {"default": {"nodeLabels": {"zone": "a"}}}
    reads.clear()
    asyncio.run(read_kueue(admitted, job, (pod("j", 0), pod("j", 1)), read))
    assert reads == []  # the group is all there: nothing more to place


# ---- decide.py -----------------------------------------------------------------------------


def test_why_a_job_cannot_run_has_one_order_a_read_the_render_a_refusal_the_admission():
    body = JobBuilder("j").build()
    refused = Refusal("Pod", "the API server refused Pod j-0: quota")
    everything = snapshot(body, config_error="ConfigMap 'x' missing", refused=refused)
    assert job_error(everything, "bad yaml", "admission") == JobError("ConfigMap 'x' missing")
    assert job_error(snapshot(body, refused=refused), "bad yaml", None) == JobError("bad yaml")
    assert job_error(snapshot(body, refused=refused), None, "admission") == JobError(
        refused.message, "PodRejected")
    assert job_error(snapshot(body), None, "admission") == JobError(
        "admission", "AdmissionNotApplicable")
    done = snapshot(body, status={"phase": "Failed"}, refused=refused)
    assert job_error(done, None, None) is None  # a finished job fails no more


def test_a_restart_archives_the_logs_of_the_group_it_deletes():
    body = JobBuilder("j").build()
    seen = snapshot(body, status={"attempt": 1, "groupAttempt": 0},
                    pods=(pod("j", 0), pod("j", 1), pod("j", 0, attempt=7)))
    restart = Outcome(attempt=2, group=2, delete=("j-0",), force_delete=("j-1",))
    assert archive(seen, restart).pods == ("j-0", "j-1") and archive(seen, restart).attempt == 1
    assert archive(seen, replace(restart, attempt=1)) is None  # no new attempt: nothing to keep


def test_a_queued_jobs_pods_wait_for_their_placement():
    body = JobBuilder("j").build()
    job = parse_job(body)
    create = Outcome(create=(0, 1))
    assert len(build_pods(snapshot(body), job, create, None)) == 2
    queued = snapshot(body, kueue=KueueView(queue="team"))
    assert build_pods(queued, job, create, None) is None


def test_a_pass_comes_back_when_a_deleted_pods_grace_period_ends():
    going = replace(pod("j", 0, node="n"), deleting=True, gone_by=NOW + timedelta(seconds=9))
    assert grace_ends(snapshot(JobBuilder("j").build(), pods=(going,))) == 10.0
    assert grace_ends(snapshot(JobBuilder("j").build(), pods=(pod("j", 0),))) is None


# ---- reads.py ------------------------------------------------------------------------------


def test_the_users_configmap_is_read_only_while_the_pass_needs_it():
    kube = FakeKube({"mine": {"a.yaml": "use_cpu: true\n"}})
    body = JobBuilder("j").config_from("mine", "a.yaml").build()
    seen = asyncio.run(read_config_source(kube, snapshot(body)))
    assert seen.config_source.text == "use_cpu: true\n"
    rendered = snapshot(body, children=frozenset({("ConfigMap", "j-accelerate-config")}),
                        status={"topology": {"numNodes": 2, "numProcPerNode": 2,
                                             "masterPort": 29500}})
    kube.calls.clear()
    asyncio.run(read_config_source(kube, replace(rendered, job=parse_job(body,
                                                                          rendered.status))))
    assert kube.calls == []
    missing = asyncio.run(read_config_source(FakeKube(), snapshot(body)))
    assert "'mine'" in missing.config_error


def test_each_node_a_pod_may_be_lost_with_is_read_once_and_only_those_not_ready():
    kube = FakeKube()
    kube.nodes["n"] = {"status": {"conditions": [
        {"type": "Ready", "status": "Unknown", "lastTransitionTime": "2026-01-01T11:00:00Z"}]}}
    not_ready = [replace(pod("j", i, node="n"), ready=False) for i in (0, 1)]
    lost = asyncio.run(read_lost_nodes(kube, [*not_ready, pod("j", 2, node="m")], NOW))
    assert lost == {"n": NodeState("n", datetime(2026, 1, 1, 11, 0), reporting=False)}
    assert kube.calls == [("read", "Node", "n")]


def creating(index: int, scheduled_ago: int):
    """Pod `index`, scheduled `scheduled_ago` seconds ago, its container still being created."""
    since = (NOW - timedelta(seconds=scheduled_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return replace(pod("j", index, "Pending"), uid=f"uid-{index}",
                   not_started=NotStarted("ContainerCreating", container="trainer", since=since))


MOUNT_FAILED = {"type": "Warning", "reason": "FailedMount",
                "lastTimestamp": "2026-01-01T11:59:50Z",
                "message": 'MountVolume.SetUp failed for volume "data" : secret "hf-data" not '
                           'found'}


def test_a_pod_long_in_container_creating_says_why_from_its_newest_warning():
    kube = FakeKube()
    # Before the pod got its node, the scheduler's word; since, the kubelet's.
    kube.pod_events["uid-1"] = [MOUNT_FAILED, {**MOUNT_FAILED, "reason": "FailedScheduling",
                                             "lastTimestamp": "2026-01-01T11:59:20Z"}]
    body = JobBuilder("j").nodes(2).build()
    seen = snapshot(body, pods=(creating(0, 10), creating(1, 31)))
    read = asyncio.run(read_creating_warning(kube, seen))
    assert kube.calls == [("list", "Event", "uid-1")]
    warning = read.pods[1].not_started
    assert (warning.reason, warning.stuck) == ("FailedMount", True)
    assert warning.describe("j-1") == ('pod j-1 cannot start: FailedMount: MountVolume.SetUp '
                                       'failed for volume "data" : secret "hf-data" not found')
    assert read.pods[0] == seen.pods[0]
    kube.calls.clear()  # nothing long in creation, or no warning: nothing read, nothing changed
    assert asyncio.run(read_creating_warning(kube, replace(seen, pods=(creating(0, 29),)))
                       ).pods == (creating(0, 29),)
    assert kube.calls == []
    quiet = snapshot(body, pods=(creating(0, 60),))
    assert asyncio.run(read_creating_warning(FakeKube(), quiet)) == quiet
    # A pod pulling a large image after it waited for a node: its only Warning came before.
    kube.pod_events["uid-0"] = [{**MOUNT_FAILED, "reason": "FailedScheduling",
                                 "lastTimestamp": "2026-01-01T11:58:59Z"}]
    pulling = snapshot(body, pods=(creating(0, 60),))
    assert asyncio.run(read_creating_warning(kube, pulling)) == pulling


def test_events_the_operator_may_not_read_leave_the_pass_as_it_was():
    """An install whose RBAC lacks list on events (not the chart's) still runs its passes."""
    class Forbidden(FakeKube):
        async def list_pod_warnings(self, namespace, uid):
            raise ApiException(status=403, reason="Forbidden")
    seen = snapshot(JobBuilder("j").nodes(2).build(), pods=(creating(0, 60),))
    assert asyncio.run(read_creating_warning(Forbidden(), seen)) == seen


def test_merge_patch_is_how_the_api_server_merges_a_status_write():
    assert merge_patch({"a": {"b": 1, "c": 2}, "d": 1}, {"a": {"c": None}, "d": None}) == {
        "a": {"b": 1}}
