"""run_lifecycle over fabricated pods: every transition of the job, and what it creates,
deletes and reports."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

from accelerate_operator.api import parse_job
from accelerate_operator.lifecycle import JobError, run_lifecycle
from accelerate_operator.pod_state import NodeState, read_pod_state, read_process_exit

from tests.helpers.jobs import JobBuilder, pod

NOW = datetime(2026, 1, 1, 12, 0, 0)
STAMP = "2026-01-01T12:00:00Z"


def job(**policy):
    return parse_job(JobBuilder().run_policy(**policy).build())


def conditions(plan):
    return {c["type"]: (c["status"], c["reason"]) for c in plan.status["conditions"]}


def step(job_, status, pods, now=NOW, *, config_error=None, config_error_reason="InvalidConfig",
         **kwargs):
    error = JobError(config_error, config_error_reason) if config_error else None
    return run_lifecycle(job_, status, pods, now, error=error, **kwargs)


def running_status(attempt=0, **extra):
    """The status of a group that really went Pending -> Running, conditions included."""
    created = step(job(), {"attempt": attempt}, []).status
    running = step(job(), created, [pod("train", 0, attempt=attempt),
                                    pod("train", 1, attempt=attempt)]).status
    return {**running, **extra}


def test_new_job_creates_every_pod_and_is_pending():
    plan = step(job(), {}, [])
    assert plan.create == (0, 1)
    assert plan.delete == ()
    assert plan.attempt == 0
    assert plan.status["phase"] == "Pending"
    assert plan.status["startTime"] == STAMP
    assert conditions(plan) == {"Created": ("True", "PodsCreated")}
    assert [(e.type, e.reason) for e in plan.events] == [("Normal", "PodsCreated")]


def test_job_runs_only_when_every_node_runs():
    j = job()
    pending = step(j, {"phase": "Pending"}, [pod("train", 0), pod("train", 1, "Pending")])
    assert pending.status["phase"] == "Pending"
    assert pending.create == ()
    assert pending.status["readyNodes"] == "1/2"
    running = step(j, pending.status, [pod("train", 0), pod("train", 1)])
    assert running.status["phase"] == "Running"
    assert running.status["readyNodes"] == "2/2"
    assert conditions(running)["Running"] == ("True", "AllNodesRunning")
    assert [e.reason for e in running.events] == ["AllNodesRunning"]


def test_job_is_not_succeeded_while_a_worker_still_runs():
    plan = step(job(), {"phase": "Running"}, [pod("train", 0, "Succeeded"), pod("train", 1)])
    assert plan.status["phase"] == "Running"
    assert "completionTime" not in plan.status


def test_job_succeeds_when_every_node_succeeded():
    plan = step(job(), running_status(),
                [pod("train", 0, "Succeeded"), pod("train", 1, "Succeeded")])
    assert plan.status["phase"] == "Succeeded"
    assert plan.status["completionTime"] == STAMP
    assert conditions(plan)["Succeeded"] == ("True", "AllNodesSucceeded")
    assert conditions(plan)["Running"][0] == "False"
    assert plan.status["nodes"] == {"active": 0, "ready": 0, "succeeded": 2, "failed": 0}


def test_a_failed_pod_restarts_the_whole_group_under_a_new_attempt():
    plan = step(job(), running_status(),
                [pod("train", 0), pod("train", 1, "Failed", exit_code=1, message="NCCL timeout")])
    assert plan.delete == ("train-0", "train-1")
    assert plan.create == ()
    assert plan.attempt == 1
    assert plan.status["restarts"] == 1
    assert plan.status["phase"] == "Restarting"
    assert plan.status["lastFailure"] == "pod train-1 failed with exit code 1: NCCL timeout"
    assert conditions(plan)["Restarting"] == ("True", "PodFailed")
    assert conditions(plan)["Running"] == ("False", "PodFailed")
    [event] = plan.events
    assert event.type == "Warning"
    assert "pod train-1 failed with exit code 1" in event.message
    assert "restart 1 of 3" in event.message


def test_new_group_waits_until_the_old_pods_are_gone():
    old = [pod("train", 0, attempt=0), pod("train", 1, "Failed", attempt=0)]
    restarting = step(job(), running_status(), old).status
    old = [pod("train", 0, attempt=0, deleting=True), pod("train", 1, "Failed", attempt=0)]
    waiting = step(job(), restarting, old)
    assert waiting.create == ()
    assert waiting.delete == ("train-1",)
    assert waiting.status["phase"] == "Restarting"
    fresh = step(job(), waiting.status, [])
    assert fresh.create == (0, 1)
    assert fresh.attempt == 1
    assert fresh.status["phase"] == "Restarting"
    running = step(job(), fresh.status, [pod("train", 0, attempt=1), pod("train", 1, attempt=1)])
    assert running.status["phase"] == "Running"
    assert conditions(running)["Restarting"] == ("False", "AllNodesRunning")
    assert running.status["restarts"] == 1


def test_planning_twice_on_the_same_input_does_not_double_count_a_restart():
    status = {"phase": "Running", "restarts": 0, "attempt": 0}
    pods = [pod("train", 0, "Failed", exit_code=1), pod("train", 1)]
    first = step(job(), status, pods)
    again = step(job(), status, pods)
    assert first.status == again.status
    # The pods of attempt 0 seen again after the status moved on only get deleted.
    after = step(job(), first.status, pods)
    assert after.status["restarts"] == 1
    assert after.create == ()


def test_a_deleted_pod_of_a_running_group_counts_as_a_failure():
    plan = step(job(), {"phase": "Running"}, [pod("train", 0)])
    assert plan.status["phase"] == "Restarting"
    assert plan.status["lastFailure"] == "pod train-1 was deleted"
    evicted = step(job(), {"phase": "Running"},
                   [pod("train", 0), pod("train", 1, "Failed", reason="Evicted",
                                         message="The node was low on memory.")])
    assert evicted.status["lastFailure"] == ("pod train-1 failed (Evicted): "
                                             "The node was low on memory.")


def test_backoff_limit_fails_the_job_naming_the_last_failure():
    plan = step(job(backoffLimit=2), {"phase": "Running", "restarts": 2, "attempt": 2},
                [pod("train", 0, attempt=2), pod("train", 1, "Failed", attempt=2, exit_code=137)])
    assert plan.status["phase"] == "Failed"
    assert conditions(plan)["Failed"][1] == "BackoffLimitExceeded"
    failed_message = next(c["message"] for c in plan.status["conditions"] if c["type"] == "Failed")
    assert failed_message.startswith("pod train-1 failed with exit code 137; no restarts left")
    assert plan.delete == ("train-0",)  # the survivor would wait in its collectives forever
    assert plan.status["restarts"] == 2


def test_a_failures_text_is_said_once_in_the_conditions():
    """The Failed condition carries the failure; the Running condition it clears only names the
    new phase, not the failure's text again (a pod's message can be KiBs)."""
    message = "Traceback (most recent call last):\nRuntimeError: " + "x" * 1000
    plan = step(job(backoffLimit=0), running_status(),
                [pod("train", 0), pod("train", 1, "Failed", exit_code=1, message=message)])
    texts = [c["message"] for c in plan.status["conditions"]]
    assert conditions(plan)["Running"][0] == "False"
    assert sum(message.strip() in text for text in texts) == 1, texts


def test_config_errors_and_permanent_exit_codes_fail_at_once():
    config = step(job(), {"phase": "Running"},
                  [pod("train", 0, "Failed", exit_code=78, message="invalid configuration: x"),
                   pod("train", 1)])
    assert config.status["phase"] == "Failed"
    assert conditions(config)["Failed"][1] == "InvalidConfig"
    assert config.status.get("restarts", 0) == 0
    permanent = step(job(permanentExitCodes=[42]), {"phase": "Running"},
                     [pod("train", 0, "Failed", exit_code=42), pod("train", 1)])
    assert conditions(permanent)["Failed"][1] == "PermanentFailure"


def test_operator_side_config_error_fails_without_creating_pods():
    plan = step(job(), {}, [], config_error="ConfigMap 'cfg' does not exist")
    assert plan.create == ()
    assert plan.status["phase"] == "Failed"
    assert conditions(plan)["Failed"] == ("True", "InvalidConfig")
    assert plan.events[0].type == "Warning"


def test_deadline_stops_the_pods_and_fails_the_job():
    started = (NOW - timedelta(seconds=61)).strftime("%Y-%m-%dT%H:%M:%SZ")
    plan = step(job(activeDeadlineSeconds=60), {"phase": "Running", "startTime": started},
                [pod("train", 0), pod("train", 1)])
    assert plan.status["phase"] == "Failed"
    assert conditions(plan)["Failed"][1] == "DeadlineExceeded"
    assert plan.delete == ("train-0", "train-1")


def test_clean_pod_policy_decides_which_pods_go_when_finished():
    pods = [pod("train", 0, "Succeeded"), pod("train", 1)]
    status = {"phase": "Failed", "completionTime": STAMP}
    assert step(job(cleanPodPolicy="Running"), status, pods).delete == ("train-1",)
    assert step(job(cleanPodPolicy="All"), status, pods).delete == ("train-0", "train-1")
    assert step(job(cleanPodPolicy="None"), status, pods).delete == ()


def test_ttl_deletes_the_job_once_expired():
    status = {"phase": "Succeeded", "completionTime": STAMP}
    early = step(job(ttlSecondsAfterFinished=30), status, [], now=NOW + timedelta(seconds=10))
    assert not early.delete_job and early.requeue_after == 20
    late = step(job(ttlSecondsAfterFinished=30), status, [], now=NOW + timedelta(seconds=30))
    assert late.delete_job


def test_suspend_deletes_pods_and_resume_starts_a_fresh_group():
    suspended = step(job(suspend=True), {"phase": "Running", "attempt": 0},
                     [pod("train", 0), pod("train", 1)])
    assert suspended.status["phase"] == "Suspended"
    assert suspended.delete == ("train-0", "train-1")
    assert conditions(suspended)["Suspended"] == ("True", "Suspended")
    resumed = step(job(), suspended.status, [])
    assert resumed.attempt == 1
    assert resumed.create == (0, 1)
    assert conditions(resumed)["Suspended"] == ("False", "Resumed")
    assert resumed.status["restarts"] == 0


def test_condition_transition_time_only_moves_on_a_change():
    first = step(job(), {}, [])
    later = step(job(), first.status, [pod("train", 0, "Pending"), pod("train", 1, "Pending")],
                 now=NOW + timedelta(minutes=5))
    created = next(c for c in later.status["conditions"] if c["type"] == "Created")
    assert created["lastTransitionTime"] == STAMP
    assert later.events == ()


def test_pod_state_is_read_from_a_real_pod_manifest():
    manifest = {
        "metadata": {"name": "train-1", "labels": {"accelerate-operator.io/node-index": "1",
                                                   "accelerate-operator.io/attempt": "3"}},
        "status": {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {
            "exitCode": 1, "reason": "Error", "message": "Traceback: boom"}}}]},
    }
    state = read_pod_state(manifest)
    assert (state.index, state.attempt, state.phase, state.exit_code, state.message) == (
        1, 3, "Failed", 1, "Traceback: boom")


def kubelet_reported(containers, *, phase="Running", exit_codes=None, sidecar=False):
    """A pod manifest as the kubelet reports it right after containers exit: the terminated
    states first, the pod's phase still Running until its sandbox is gone."""
    exit_codes = exit_codes or {}
    statuses = []
    for name in containers:
        state = ({"terminated": {"exitCode": exit_codes[name], "reason": "Completed"}}
                 if name in exit_codes else {"running": {"startedAt": STAMP}})
        statuses.append({"name": name, "state": state})
    spec = {"restartPolicy": "Never", "containers": [{"name": n} for n in containers]}
    status = {"phase": phase, "containerStatuses": statuses}
    if sidecar:  # a restartable init container keeps running until the pod is torn down
        spec["initContainers"] = [{"name": "proxy", "restartPolicy": "Always"}]
        status["initContainerStatuses"] = [{"name": "proxy", "state": {"running": {}}}]
    return {"metadata": {"name": "train-0", "labels": {"accelerate-operator.io/node-index": "0"}},
            "spec": spec, "status": status}


def test_a_pod_whose_trainer_succeeded_keeps_the_kubelets_phase_until_it_changes_it():
    # The kubelet reports the terminated containers first and the pod's phase later: a trainer
    # that succeeded waits for the phase rather than deciding it ahead of the kubelet.
    done = read_pod_state(kubelet_reported(["trainer"], exit_codes={"trainer": 0}, sidecar=True))
    assert (done.phase, done.exit_code) == ("Running", 0)


def test_a_pod_whose_trainer_failed_has_failed_whatever_its_other_containers_do():
    # restartPolicy Never: the trainer never runs again, and a sidecar may never end.
    state = read_pod_state(kubelet_reported(["trainer", "uploader"],
                                            exit_codes={"trainer": 137, "uploader": 0}))
    assert (state.phase, state.exit_code) == ("Failed", 137)


def test_a_pod_is_running_while_any_of_its_containers_runs():
    state = read_pod_state(kubelet_reported(["trainer", "uploader"], exit_codes={"trainer": 0}))
    assert state.phase == "Running"
    assert read_pod_state(kubelet_reported(["trainer"])).phase == "Running"


def test_the_kubelets_terminal_phase_stands():
    # A pod evicted while its container still ran: Failed, whatever the container says.
    state = read_pod_state(kubelet_reported(["trainer"], phase="Failed"))
    assert state.phase == "Failed"


def test_a_job_succeeds_once_the_kubelet_reports_its_pods_succeeded():
    def pods(phase):
        found = []
        for index in (0, 1):
            manifest = kubelet_reported(["trainer"], phase=phase, exit_codes={"trainer": 0})
            manifest["metadata"] = {"name": f"train-{index}", "labels": {
                "accelerate-operator.io/node-index": str(index),
                "accelerate-operator.io/attempt": "0"}}
            found.append(read_pod_state(manifest))
        return found
    assert step(job(), running_status(), pods("Running")).status["phase"] == "Running"
    plan = step(job(), running_status(), pods("Succeeded"))
    assert plan.status["phase"] == "Succeeded"
    assert plan.status["nodes"]["succeeded"] == 2


def test_a_node_that_finished_is_kept_when_its_pod_goes_and_never_made_again():
    """Node 1 succeeded while rank 0 still saves; its pod then goes (PodGC after its node was
    scaled away, a clean-up of completed pods, a drain that evicts it): nothing to restart."""
    j = job()
    done = step(j, running_status(), [pod("train", 0), pod("train", 1, "Succeeded")])
    assert done.status["completedIndexes"] == "1"
    drained = replace(pod("train", 1, "Succeeded", deleting=True),
                      disruption="EvictionByEvictionAPI")
    for pods in ([pod("train", 0)], [pod("train", 0), drained]):
        plan = step(j, done.status, pods)
        assert (plan.status["phase"], plan.create, plan.delete) == ("Running", (), ())
        assert plan.status["completedIndexes"] == "1"
    gone = step(j, done.status, [pod("train", 0)])
    finished = step(j, gone.status, [pod("train", 0, "Succeeded")])
    assert finished.status["phase"] == "Succeeded"
    assert finished.status["completedIndexes"] == "0-1"


def test_a_new_group_forgets_the_nodes_the_old_one_finished():
    j = job()
    done = step(j, running_status(), [pod("train", 0), pod("train", 1, "Succeeded")])
    failed = step(j, done.status, [pod("train", 0, "Failed", exit_code=1),
                                   pod("train", 1, "Succeeded")])
    assert failed.status["phase"] == "Restarting" and "completedIndexes" not in failed.status
    fresh = step(j, failed.status, [])
    assert fresh.create == (0, 1)


def test_a_pod_the_server_refuses_fails_the_job_with_the_servers_reason():
    reason = 'the API server refused Pod train-0: violates PodSecurity "restricted:latest"'
    plan = step(job(), {}, [], config_error=reason, config_error_reason="PodRejected")
    assert plan.status["phase"] == "Failed"
    assert conditions(plan)["Failed"] == ("True", "PodRejected")
    assert plan.events[0].message == reason


def test_the_pass_that_creates_pods_counts_them_so_the_next_pass_writes_nothing():
    created = step(job(), {}, [])
    assert created.status["nodes"]["active"] == 2
    seen = step(job(), created.status, [pod("train", 0, "Pending"), pod("train", 1, "Pending")])
    assert seen.status == created.status
    assert seen.create == () and seen.events == ()


# Disruptions, stalls and restarts counted against backoffLimit (issue 24).

def disrupted(index, reason="EvictionByEvictionAPI", **kwargs):
    from dataclasses import replace
    return replace(pod("train", index, **kwargs), disruption=reason, deleting=True)


def test_pod_state_carries_the_disruption_target_condition():
    manifest = {
        "metadata": {"name": "train-1", "deletionTimestamp": "2026-01-01T12:00:00Z",
                     "labels": {"accelerate-operator.io/node-index": "1",
                                "accelerate-operator.io/attempt": "0"}},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "trainer"}]},
        "status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
             "message": "Eviction API: evicting"}]},
    }
    state = read_pod_state(manifest)
    assert (state.disruption, state.deleting, state.message) == (
        "EvictionByEvictionAPI", True, "Eviction API: evicting")
    node_lost = read_pod_state({**manifest, "status": {"phase": "Failed", "reason": "NodeLost"}})
    assert node_lost.disruption == "NodeLost"
    oom = read_pod_state({**manifest, "metadata": {**manifest["metadata"],
                                                   "deletionTimestamp": None},
                          "status": {"phase": "Failed", "containerStatuses": [
                              {"name": "trainer", "state": {"terminated": {
                                  "exitCode": 137, "reason": "OOMKilled"}}}]}})
    assert (oom.disruption, oom.reason, oom.exit_code) == (None, "OOMKilled", 137)


def test_a_drained_pod_restarts_the_group_without_using_the_budget():
    plan = step(job(backoffLimit=0), running_status(),
                [pod("train", 0), disrupted(1, message="Eviction API: evicting")])
    assert plan.status["phase"] == "Restarting"
    assert conditions(plan)["Restarting"] == ("True", "Disrupted")
    assert (plan.status["restarts"], plan.status["restartsCounted"]) == (1, 0)
    # The other pods are asked to stop at once (a graceful delete: SIGTERM, then the grace
    # period), so every rank saves the same checkpoint; the disrupted one is already going.
    assert plan.delete == ("train-0",)
    assert plan.attempt == 1
    assert plan.status["lastFailure"] == ("pod train-1 was disrupted (EvictionByEvictionAPI): "
                                          "Eviction API: evicting")
    event = plan.events[-1]
    assert (event.type, event.reason) == ("Warning", "Disrupted")
    assert "not counted against spec.runPolicy.backoffLimit: 0 of 0 used" in event.message


def test_a_disruption_wins_over_the_failures_it_causes():
    # The ranks on the surviving node crash when their peer goes: the cause is the drain.
    plan = step(job(backoffLimit=3), running_status(),
                [pod("train", 0, "Failed", exit_code=1), disrupted(1, "PreemptionByScheduler")])
    assert conditions(plan)["Restarting"][1] == "Disrupted"
    assert plan.status["restartsCounted"] == 0


def test_a_pod_deleted_by_someone_else_or_gone_is_a_disruption():
    deleting = step(job(), running_status(), [pod("train", 0), pod("train", 1, deleting=True)])
    assert conditions(deleting)["Restarting"][1] == "Disrupted"
    assert deleting.status["lastFailure"] == "pod train-1 is being deleted"
    gone = step(job(), running_status(), [pod("train", 0)])
    assert (gone.status["restarts"], gone.status["restartsCounted"]) == (1, 0)


def test_failures_and_oom_kills_are_counted_and_restarts_show_both_numbers():
    status = {**running_status(), "restarts": 3, "restartsCounted": 1}
    plan = step(job(backoffLimit=3), status,
                [pod("train", 0), pod("train", 1, "Failed", exit_code=137, reason="OOMKilled")])
    assert conditions(plan)["Restarting"][1] == "PodFailed"
    assert (plan.status["restarts"], plan.status["restartsCounted"]) == (4, 2)
    assert "restart 2 of 3" in plan.events[-1].message
    # The budget is the counted restarts only: 3 disruptions before did not use it.
    spent = step(job(backoffLimit=2), {**status, "restartsCounted": 2},
                 [pod("train", 0), pod("train", 1, "Failed", exit_code=1)])
    assert conditions(spent)["Failed"][1] == "BackoffLimitExceeded"


def test_an_older_status_without_counted_restarts_counts_them_all():
    status = {**running_status(), "restarts": 1}
    del status["restartsCounted"]
    plan = step(job(backoffLimit=1), status,
                [pod("train", 0), pod("train", 1, "Failed", exit_code=1)])
    assert conditions(plan)["Failed"][1] == "BackoffLimitExceeded"


def activity(seconds_ago=None, step_=None):
    from accelerate_operator.outcome import Activity
    seen = None if seconds_ago is None else NOW - timedelta(seconds=seconds_ago)
    return Activity(last_activity=seen, last_step=step_)


def running_since(seconds):
    """A Running status whose group has been running for `seconds`."""
    status = running_status()
    stamp = (NOW - timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")
    status["conditions"] = [{**c, "lastTransitionTime": stamp} for c in status["conditions"]]
    return status


def test_a_running_group_silent_past_the_stall_timeout_is_stalled_and_restarted_counted():
    j = job(stallTimeoutSeconds=300)
    pods_ = [pod("train", 0), pod("train", 1)]
    quiet = step(j, running_since(1000), pods_, activity=activity(200, 40))
    assert quiet.status["phase"] == "Running"
    assert quiet.requeue_after == 100.0  # the clock comes back when it would be stalled
    stalled = step(j, running_since(1000), pods_, activity=activity(301, 40))
    assert stalled.status["phase"] == "Restarting"
    assert conditions(stalled)["Stalled"] == ("True", "Stalled")
    assert conditions(stalled)["Restarting"] == ("True", "Stalled")
    assert (stalled.status["restarts"], stalled.status["restartsCounted"]) == (1, 1)
    assert stalled.delete == ("train-0", "train-1")
    event = stalled.events[-1]
    assert (event.type, event.reason) == ("Warning", "Stalled")
    assert "no log line or progress report from rank 0 (pod train-0) for 300s" in event.message
    assert "the last step seen is 40" in event.message
    # The next group running clears it.
    fresh = step(j, stalled.status, [])
    back = step(j, fresh.status, [pod("train", 0, attempt=1), pod("train", 1, attempt=1)])
    assert conditions(back)["Stalled"] == ("False", "AllNodesRunning")


def test_stall_time_counts_from_the_group_running_and_needs_the_runtimes_reading():
    j = job(stallTimeoutSeconds=300)
    pods_ = [pod("train", 0), pod("train", 1)]
    # Old activity (from before this group ran) does not stall a group that just started.
    assert step(j, running_since(10), pods_, activity=activity(5000)).status["phase"] == "Running"
    # Nothing read yet: no decision.
    assert step(j, running_since(5000), pods_, activity=activity()).status["phase"] == "Running"
    # No stallTimeoutSeconds: never.
    assert step(job(), running_since(5000), pods_,
                activity=activity(5000)).status["phase"] == "Running"


def test_a_worker_that_never_starts_is_stalled_naming_its_node_index():
    j = job(stallTimeoutSeconds=300)
    created = step(j, {}, [], now=NOW - timedelta(seconds=301)).status
    assert created["attemptStartTime"] == "2026-01-01T11:54:59Z"
    pods_ = [pod("train", 0), pod("train", 1, "Pending", reason="Unschedulable")]
    waiting = step(j, created, pods_, now=NOW - timedelta(seconds=100))
    assert waiting.status["phase"] == "Pending"
    plan = step(j, created, pods_)
    assert conditions(plan)["Stalled"][0] == "True"
    assert plan.status["lastFailure"].startswith(
        "node 1 (pod train-1: Pending, Unschedulable) not running 300s after the group was "
        "created")
    assert plan.status["restartsCounted"] == 1
    # A node that already finished is not missing.
    quick = step(j, created, [pod("train", 0), pod("train", 1, "Succeeded")])
    assert quick.status["phase"] == "Running"


def test_an_unschedulable_pod_says_why():
    state = read_pod_state({
        "metadata": {"name": "train-1", "labels": {"accelerate-operator.io/node-index": "1"}},
        "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/2 nodes are available"}]}})
    assert (state.phase, state.reason, state.message, state.disruption) == (
        "Pending", "Unschedulable", "0/2 nodes are available", None)


# A node lost (spec.runPolicy.nodeLostTimeoutSeconds, issue 37).

def on_nodes(attempt=0, ready1=False, deleting1=False):
    return [pod("train", 0, attempt=attempt, node="node-a"),
            pod("train", 1, attempt=attempt, node="node-b", ready=ready1, deleting=deleting1)]


def unreachable(seconds, reporting=False):
    return {"node-b": NodeState("node-b", NOW - timedelta(seconds=seconds), reporting)}


def test_a_node_not_ready_within_the_timeout_only_brings_the_next_pass_forward():
    plan = step(job(), running_status(), on_nodes(), lost_nodes=unreachable(4))
    assert plan.status["phase"] == "Running"
    assert plan.delete == plan.force_delete == ()
    assert plan.requeue_after == 6.0  # the default timeout is 10 s


def test_a_node_lost_past_the_timeout_restarts_the_group_and_force_deletes_its_pods():
    plan = step(job(backoffLimit=0), running_status(), on_nodes(), lost_nodes=unreachable(12))
    assert plan.status["phase"] == "Restarting"
    assert conditions(plan)["Restarting"] == ("True", "Disrupted")
    assert (plan.status["restarts"], plan.status["restartsCounted"], plan.attempt) == (1, 0, 1)
    # No kubelet would ever confirm the lost pod's deletion, and the healthy node's ranks wait
    # on the lost ones in a collective (no checkpoint can be taken): both go at once.
    assert (plan.delete, plan.force_delete) == ((), ("train-0", "train-1"))
    assert plan.status["lastFailure"] == (
        "pod train-1 was lost with its node: node node-b has been unreachable (its kubelet "
        "stopped reporting) for 12s (spec.runPolicy.nodeLostTimeoutSeconds=10)")


def test_a_node_that_reports_not_ready_is_lost_too_and_named_so():
    plan = step(job(), running_status(), on_nodes(), lost_nodes=unreachable(12, reporting=True))
    assert conditions(plan)["Restarting"][1] == "Disrupted"
    assert plan.force_delete == ("train-0", "train-1")
    assert "node node-b has been NotReady for 12s" in plan.status["lastFailure"]


def test_a_stale_pod_on_a_node_that_reports_waits_for_its_kubelet():
    stale = on_nodes(attempt=0, deleting1=True)[1:]
    status = {**running_status(attempt=1), "phase": "Restarting"}
    plan = step(job(), status, stale, lost_nodes=unreachable(30, reporting=True))
    assert plan.force_delete == plan.delete == ()


def test_an_earlier_attempts_pod_under_a_current_pods_name_is_not_deleted_by_that_name():
    """Two pods of one name cannot both exist: the earlier attempt's is the ghost of a pod
    deleted while the operator was not watching. A delete by name would hit the current one."""
    ghost = pod("train", 0, attempt=0)
    current = [pod("train", i, attempt=1) for i in range(2)]
    plan = step(job(), running_status(attempt=1), [ghost, *current])
    assert plan.delete == plan.force_delete == ()
    restarting = {**running_status(attempt=1), "phase": "Restarting"}
    old = [pod("train", i, attempt=0) for i in range(2)]
    assert step(job(), restarting, old).delete == ("train-0", "train-1")  # stale pods go
    assert step(job(), restarting, [*old, current[0]]).delete == ("train-1",)


def test_a_pod_stuck_terminating_on_a_lost_node_is_force_deleted_so_the_group_can_start():
    # The previous attempt's pod was evicted by the taint manager; its node never confirms.
    stale = on_nodes(attempt=0, deleting1=True)[1:]
    status = {**running_status(attempt=1), "phase": "Restarting"}
    waiting = step(job(), status, stale, lost_nodes=unreachable(3))
    assert waiting.force_delete == () and waiting.requeue_after == 7.0
    freed = step(job(), status, stale, lost_nodes=unreachable(10))
    assert freed.force_delete == ("train-1",)
    gone = step(job(), status, stale, lost_nodes={"node-b": NodeState("node-b", None, False)})
    assert gone.force_delete == ("train-1",)


def test_the_node_lost_timeout_is_the_jobs_own():
    plan = step(job(nodeLostTimeoutSeconds=0), running_status(), on_nodes(),
                lost_nodes=unreachable(0))
    assert conditions(plan)["Restarting"][1] == "Disrupted"


def test_pod_state_reads_its_node_and_when_its_grace_period_ends():
    manifest = {
        "metadata": {"name": "train-1", "deletionTimestamp": "2026-01-01T12:02:00Z",
                     "labels": {"accelerate-operator.io/node-index": "1"}},
        "spec": {"nodeName": "node-b", "restartPolicy": "Never",
                 "containers": [{"name": "trainer"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    state = read_pod_state(manifest)
    assert (state.node, state.gone_by) == ("node-b", NOW + timedelta(minutes=2))
    assert not state.waits_on_node(NOW)  # Ready, within its grace period
    assert state.waits_on_node(NOW + timedelta(minutes=2))  # outlived it: is its node there?
    not_ready = read_pod_state({**manifest, "metadata": {"name": "train-1"},
                                "status": {"phase": "Running"}})
    assert not_ready.waits_on_node(NOW)
    unbound = read_pod_state({**manifest, "spec": {}, "status": {"phase": "Running"}})
    assert not unbound.waits_on_node(NOW)


# In-place restarts (spec.runPolicy.restartInPlace, issue 37).


def in_place(index, attempt=0, run_attempt=0, exited=None, **kwargs):
    """A running pod of the group created for `attempt`, told to run `run_attempt`; `exited`:
    (attempt, exit code) of a failed launch it reported."""
    from dataclasses import replace

    from accelerate_operator.pod_state import ProcessExit
    state = pod("train", index, attempt=attempt, **kwargs)
    ended = ProcessExit(exited[0], exited[1], "RuntimeError: boom") if exited else None
    return replace(state, run_attempt=run_attempt, exit=ended)


def test_a_failed_launch_in_a_running_group_restarts_its_processes_in_place_counted():
    plan = step(job(), running_status(), [in_place(0), in_place(1, exited=(0, 1))])
    assert (plan.attempt, plan.group, plan.delete, plan.create) == (1, 0, (), ())
    assert plan.tell == ("train-0", "train-1")
    assert (plan.status["attempt"], plan.status["groupAttempt"]) == (1, 0)
    assert (plan.status["restarts"], plan.status["restartsCounted"]) == (1, 1)
    assert plan.status["phase"] == "Restarting"
    assert conditions(plan)["Restarting"] == ("True", "ProcessFailed")
    assert plan.status["lastFailure"] == (
        "pod train-1 ended its training processes with exit code 1: RuntimeError: boom")
    assert [(e.type, e.reason, e.message) for e in plan.events] == [(
        "Warning", "ProcessFailed",
        "pod train-1 ended its training processes with exit code 1: RuntimeError: boom; "
        "restarting the processes of all 2 node(s) in place (restart 1 of 3)")]


def test_the_next_passes_run_the_same_pods_and_tell_the_ones_not_yet_told():
    restarted = step(job(), running_status(), [in_place(0), in_place(1, exited=(0, 1))])
    # The pod watch shows pod 0 told, pod 1 not yet: the old exit is history, pod 1 is told again.
    again = step(job(), restarted.status,
                 [in_place(0, run_attempt=1), in_place(1, exited=(0, 1))])
    assert (again.attempt, again.delete, again.create, again.tell) == (1, (), (), ("train-1",))
    assert again.status["restarts"] == 1 and again.status["phase"] == "Running"
    told = step(job(), again.status, [in_place(0, run_attempt=1), in_place(1, run_attempt=1)])
    assert told.tell == () and told.status == again.status
    # A failure of attempt 1 is a second restart, in the same pods again.
    twice = step(job(), told.status,
                 [in_place(0, run_attempt=1, exited=(1, 137)), in_place(1, run_attempt=1)])
    assert (twice.attempt, twice.group, twice.status["restartsCounted"]) == (2, 0, 2)


def test_a_failed_launch_uses_the_budget_and_permanent_codes_fail_at_once():
    spent = step(job(backoffLimit=1), running_status(restarts=1, restartsCounted=1),
                 [in_place(0), in_place(1, exited=(0, 1))])
    assert spent.status["phase"] == "Failed" and spent.tell == ()
    assert conditions(spent)["Failed"] == ("True", "BackoffLimitExceeded")
    permanent = step(job(permanentExitCodes=[3]), running_status(),
                     [in_place(0), in_place(1, exited=(0, 3))])
    assert conditions(permanent)["Failed"] == ("True", "PermanentFailure")


def test_a_failed_launch_restarts_the_group_when_a_pod_cannot_restart_in_place():
    for pods in ([in_place(0, ready=False, node="n0"), in_place(1, exited=(0, 1))],  # not Ready
                 [in_place(0, deleting=True), in_place(1, exited=(0, 1))]):
        plan = step(job(), running_status(), pods)
        assert plan.tell == () and plan.attempt == 1 and "groupAttempt" not in plan.status
    off = step(job(restartInPlace=False), running_status(),
               [in_place(0), in_place(1, exited=(0, 1))])
    assert (off.delete, off.tell, off.group) == (("train-0", "train-1"), (), 1)
    assert conditions(off)["Restarting"] == ("True", "PodFailed")


def test_a_failed_pod_after_in_place_restarts_recreates_the_group_from_the_current_attempt():
    status = running_status(attempt=2, groupAttempt=0, restarts=2, restartsCounted=2)
    plan = step(job(), status, [in_place(0, run_attempt=2),
                                pod("train", 1, "Failed", exit_code=1, attempt=0)])
    assert (plan.attempt, plan.group, plan.delete) == (3, 3, ("train-0", "train-1"))
    assert "groupAttempt" not in plan.status
    gone = step(job(), plan.status, [])
    assert gone.create == (0, 1) and gone.attempt == 3


def test_pod_state_reads_the_attempt_it_runs_and_the_failed_launch_it_reported():
    """The attempt from the operator's own annotation; the failed launch from the report the
    pod sent to the endpoint (the controller puts it on the PodState), never from the pod."""
    manifest = {"metadata": {"name": "train-1", "uid": "u-1", "labels": {
        "accelerate-operator.io/node-index": "1", "accelerate-operator.io/attempt": "0"},
        "annotations": {"accelerate-operator.io/run-attempt": "2",
                        "accelerate-operator.io/report": '{"exit":{"attempt":2,"exitCode":1}}'}},
        "status": {"phase": "Running"}}
    state = read_pod_state(manifest)
    assert (state.attempt, state.run_attempt, state.uid) == (0, 2, "u-1")
    assert state.exit is None and state.report is None  # an annotation is no report
    ended = read_process_exit('{"progress":null,"lastOutputTime":null,'
                              '"exit":{"attempt":2,"exitCode":1,"time":"x","message":"boom"}}')
    assert (ended.attempt, ended.exit_code, ended.message) == (2, 1, "boom")
    for report in ('{"exit": {"attempt": "2", "exitCode": 1}}', '{"exit": [1]}', "not json",
                   '{"exit": {"attempt": 2, "exitCode": 0}}', '{"exit": {"attempt": 2}}'):
        assert read_process_exit(report) is None


def test_a_containers_own_termination_message_is_kept_printable_and_short():
    """The kubelet copies the container's last words (its log's tail) into its state: the
    user's output, escape codes and all."""
    words = "\x1b[2J\x1b]0;owned\x07" + "x" * 5000 + "\nRuntimeError: boom"
    state = read_pod_state({"metadata": {"name": "train-1"}, "status": {
        "phase": "Failed", "containerStatuses": [{"name": "trainer", "state": {"terminated": {
            "exitCode": 1, "reason": "Error", "message": words}}}]}})
    assert state.message.endswith("\nRuntimeError: boom") and len(state.message) == 2048
    assert "\x1b" not in state.message and "\x07" not in state.message
