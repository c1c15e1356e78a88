"""A job that cannot start or that died says why: the reason read from pod statuses as the
scheduler and the kubelet write them (not_started.py), the root cause of a failure (causes.py), and
the Waiting condition, its events, status.reason and waitingTimeoutSeconds in a pass."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from accelerate_operator.api import parse_job
from accelerate_operator.lifecycle import run_lifecycle
from accelerate_operator.pod_state import read_pod_state, read_process_exit

from tests.helpers.jobs import JobBuilder

NOW = datetime(2026, 1, 1, 12, 0, 0)
CREATED_AT = "2026-01-01T12:00:00Z"


def manifest(index, phase="Pending", conditions=(), containers=(), init=(), limit=None,
             annotations=None):
    """A Pod of job `train` as the API server returns it, with the status the scheduler and
    the kubelet wrote."""
    resources = {"limits": {"memory": limit}} if limit else {}
    status = {"phase": phase, "conditions": list(conditions), "qosClass": "Burstable"}
    if containers:
        status["containerStatuses"] = list(containers)
    if init:
        status["initContainerStatuses"] = list(init)
    return {
        "metadata": {"name": f"train-{index}", "namespace": "ml",
                     "labels": {"accelerate-operator.io/node-index": str(index),
                                "accelerate-operator.io/attempt": "0"},
                     "annotations": annotations or {}},
        "spec": {"nodeName": "worker-1", "restartPolicy": "Never",
                 "containers": [{"name": "trainer", "image": "trainer:nope",
                                 "resources": resources}]},
        "status": status,
    }


SCHEDULED = {"type": "PodScheduled", "status": "True", "lastProbeTime": None,
             "lastTransitionTime": "2026-01-01T12:00:01Z"}
NOT_READY = {"type": "Ready", "status": "False", "reason": "ContainersNotReady",
             "message": "containers with unready status: [trainer]",
             "lastProbeTime": None, "lastTransitionTime": "2026-01-01T12:00:01Z"}


def trainer_waiting(reason, message):
    return {"name": "trainer", "image": "trainer:nope", "imageID": "", "ready": False,
            "restartCount": 0, "started": False,
            "state": {"waiting": {"reason": reason, "message": message}}}


NEVER_PULL = manifest(0, conditions=[SCHEDULED, NOT_READY], containers=[trainer_waiting(
    "ErrImageNeverPull",
    'Container image "trainer:nope" is not present with pull policy of Never')])
PULL_ERROR = manifest(0, conditions=[SCHEDULED, NOT_READY], containers=[trainer_waiting(
    "ErrImagePull",
    'rpc error: code = NotFound desc = failed to pull and unpack image '
    '"docker.io/library/trainer:nope": failed to resolve reference '
    '"docker.io/library/trainer:nope": docker.io/library/trainer:nope: not found')])
PULL_BACKOFF = manifest(0, conditions=[SCHEDULED, NOT_READY], containers=[trainer_waiting(
    "ImagePullBackOff", 'Back-off pulling image "trainer:nope"')])
CONFIG_ERROR = manifest(1, conditions=[SCHEDULED, NOT_READY], containers=[trainer_waiting(
    "CreateContainerConfigError", 'secret "hf-token" not found')])
UNSCHEDULABLE = {**manifest(0, conditions=[{
    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
    "message": "0/2 nodes are available: 2 Insufficient cpu. preemption: 0/2 nodes are "
               "available: 2 No preemption victims found for incoming pod.",
    "lastProbeTime": None, "lastTransitionTime": "2026-01-01T12:00:01Z"}])}
UNSCHEDULABLE["spec"] = {k: v for k, v in UNSCHEDULABLE["spec"].items() if k != "nodeName"}
UNBOUND = {**UNSCHEDULABLE, "status": {"phase": "Pending", "conditions": [{
    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
    "message": "0/2 nodes are available: pod has unbound immediate PersistentVolumeClaims. "
               "preemption: 0/2 nodes are available: 2 Preemption is not helpful for "
               "scheduling.",
    "lastProbeTime": None, "lastTransitionTime": "2026-01-01T12:00:01Z"}]}}
INIT_CRASHLOOP = manifest(0, conditions=[SCHEDULED, {
    "type": "Initialized", "status": "False", "reason": "ContainersNotInitialized",
    "message": "containers with incomplete status: [fetch-data]"}], init=[{
        "name": "fetch-data", "image": "busybox:1.36", "ready": False, "restartCount": 3,
        "started": False,
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                     "startedAt": "2026-01-01T12:00:40Z",
                                     "finishedAt": "2026-01-01T12:00:40Z"}},
        "state": {"waiting": {"reason": "CrashLoopBackOff",
                              "message": "back-off 40s restarting failed container=fetch-data "
                                         "pod=train-0_ml(0c1e)"}}}],
    containers=[trainer_waiting("PodInitializing", "")])
CREATING = manifest(0, conditions=[SCHEDULED, NOT_READY],
                    containers=[trainer_waiting("ContainerCreating", "")])
RUNNING = manifest(0, "Running", conditions=[SCHEDULED, {**NOT_READY, "status": "True"}],
                   containers=[{"name": "trainer", "ready": True, "restartCount": 0,
                                "state": {"running": {"startedAt": "2026-01-01T12:01:00Z"}}}])
OOM_KILLED = manifest(1, "Failed", limit="300Mi", containers=[{
    "name": "trainer", "ready": False, "restartCount": 0, "started": False,
    "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                             "startedAt": "2026-01-01T12:01:00Z",
                             "finishedAt": "2026-01-01T12:02:00Z"}}}])


def at(index, body):
    """`body` as pod `index` of the job."""
    copy = json.loads(json.dumps(body))
    copy["metadata"]["name"] = f"train-{index}"
    copy["metadata"]["labels"]["accelerate-operator.io/node-index"] = str(index)
    return copy


# --- reading the reason (not_started.py through read_pod_state) ---


def test_image_pull_errors_read_as_the_kubelet_wrote_them():
    for body, reason in ((NEVER_PULL, "ErrImageNeverPull"), (PULL_ERROR, "ErrImagePull"),
                         (PULL_BACKOFF, "ImagePullBackOff")):
        waiting = read_pod_state(body).not_started
        assert (waiting.reason, waiting.container, waiting.stuck) == (reason, "trainer", True)
    assert read_pod_state(NEVER_PULL).not_started.describe("train-0") == (
        "pod train-0 cannot start: container trainer: ErrImageNeverPull: Container image "
        '"trainer:nope" is not present with pull policy of Never')


def test_unschedulable_pods_and_unbound_claims_carry_the_schedulers_message():
    waiting = read_pod_state(UNSCHEDULABLE).not_started
    assert waiting.describe("train-0") == (
        "pod train-0 cannot be scheduled: Unschedulable: 0/2 nodes are available: 2 "
        "Insufficient cpu. preemption: 0/2 nodes are available: 2 No preemption victims found "
        "for incoming pod.")
    assert "unbound immediate PersistentVolumeClaims" in read_pod_state(UNBOUND).not_started.message


def test_a_crash_looping_init_container_names_itself_and_its_last_exit_code():
    waiting = read_pod_state(INIT_CRASHLOOP).not_started
    assert waiting.describe("train-0") == (
        "pod train-0 cannot start: init container fetch-data: CrashLoopBackOff (its last run "
        "exited with code 1): back-off 40s restarting failed container=fetch-data "
        "pod=train-0_ml(0c1e)")


def test_pods_on_their_way_or_running_wait_on_nothing():
    assert read_pod_state(CREATING).not_started.stuck is False
    assert read_pod_state(RUNNING).not_started is None
    assert read_pod_state(CONFIG_ERROR).not_started.reason == "CreateContainerConfigError"


# --- the root cause (causes.py) ---


def test_a_container_killed_for_memory_names_its_pod_and_its_limit():
    assert read_pod_state(OOM_KILLED).cause == (
        "out of memory: the kernel killed container trainer of pod train-1 at its memory "
        "limit 300Mi (OOMKilled)")
    assert read_pod_state(RUNNING).cause is None


def reported(exit_fields):
    report = json.dumps({"exit": {"attempt": 0, "exitCode": 1, "message": "torchrun's tail",
                                  **exit_fields}})
    return read_process_exit(report, "train-1")


def test_a_reported_launch_failure_puts_the_ranks_own_error_first():
    ended = reported({"rootCause": "python: can't open file '/workspace/trian.py': [Errno 2] "
                                   "No such file or directory", "rank": 2})
    assert ended.cause == ("python: can't open file '/workspace/trian.py': [Errno 2] No such "
                           "file or directory (pod train-1, rank 2)")
    assert not ended.oom
    memory = reported({"reason": "OOMKilled", "oomKills": 1, "memoryLimitBytes": 314572800})
    assert memory.oom and memory.cause == (
        "out of memory: the kernel's OOM killer ended a training process (memory limit 300Mi) "
        "(pod train-1)")
    assert reported({}).cause is None


# --- a pass (lifecycle.run_lifecycle) ---


def job(**policy):
    return parse_job(JobBuilder().run_policy(**policy).build())


PENDING_STATUS = {"phase": "Pending", "attempt": 0, "attemptStartTime": CREATED_AT,
                  "startTime": CREATED_AT}


def step(status, bodies, now=NOW, **policy):
    return run_lifecycle(job(**policy), status, [read_pod_state(b) for b in bodies], now)


def waiting_condition(plan):
    return next((c for c in plan.status["conditions"] if c["type"] == "Waiting"), None)


def test_a_pod_that_cannot_pull_sets_waiting_and_one_warning_for_the_pull():
    first = step(PENDING_STATUS, [NEVER_PULL, at(1, CREATING)])
    condition = waiting_condition(first)
    assert (condition["status"], condition["reason"]) == ("True", "ErrImageNeverPull")
    assert condition["message"].startswith("pod train-0 cannot start: container trainer: "
                                           "ErrImageNeverPull")
    assert first.status["reason"] == "ErrImageNeverPull"
    assert [(e.type, e.reason) for e in first.events if e.type == "Warning"] == [
        ("Warning", "ErrImageNeverPull")]
    # The kubelet alternates ErrImagePull and ImagePullBackOff: one cause, one event.
    pulling = step(PENDING_STATUS, [PULL_ERROR, at(1, CREATING)])
    backoff = step(pulling.status, [PULL_BACKOFF, at(1, CREATING)])
    again = step(backoff.status, [PULL_ERROR, at(1, CREATING)])
    assert [e.reason for e in pulling.events if e.type == "Warning"] == ["ErrImagePull"]
    assert [e for e in backoff.events + again.events if e.type == "Warning"] == []
    assert backoff.status["reason"] == "ImagePullBackOff"


def test_a_back_off_keeps_the_pull_error_it_waits_after_to_the_timeout():
    """Before Kubernetes 1.32 the kubelet's back-off message is only `Back-off pulling image`,
    and a pod spends most of its time in the back-off."""
    pulling = step(PENDING_STATUS, [PULL_ERROR, at(1, CREATING)], waitingTimeoutSeconds=600)
    backoff = step(pulling.status, [PULL_BACKOFF, at(1, CREATING)], waitingTimeoutSeconds=600)
    condition = waiting_condition(backoff)
    assert condition["reason"] == "ImagePullBackOff"
    assert condition["message"] == waiting_condition(pulling)["message"]
    assert "docker.io/library/trainer:nope: not found" in condition["message"]
    failed = step(backoff.status, [PULL_BACKOFF, at(1, CREATING)],
                  NOW + timedelta(seconds=600), waitingTimeoutSeconds=600)
    assert failed.status["phase"] == "Failed"
    assert "trainer:nope: not found" in failed.status["conditions"][-1]["message"]


def test_a_scheduler_error_is_why_a_pod_waits():
    body = {**UNSCHEDULABLE, "status": {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "SchedulerError",
        "message": 'running PreBind plugin "VolumeBinding": binding volumes: provisioning '
                   'failed for PVC "data"', "lastTransitionTime": CREATED_AT}]}}
    plan = step(PENDING_STATUS, [body, at(1, RUNNING)])
    assert waiting_condition(plan)["message"] == (
        'pod train-0 cannot be scheduled: SchedulerError: running PreBind plugin '
        '"VolumeBinding": binding volumes: provisioning failed for PVC "data"')


def test_a_group_that_stalls_starting_names_what_keeps_its_pod():
    plan = step(PENDING_STATUS, [RUNNING, at(1, PULL_ERROR)], NOW + timedelta(seconds=300),
                stallTimeoutSeconds=300)
    stalled = next(c for c in plan.status["conditions"] if c["type"] == "Stalled")
    assert stalled["message"].startswith(
        "node 1 (pod train-1 cannot start: container trainer: ErrImagePull: rpc error")


def test_a_new_cause_is_a_new_warning_and_started_pods_clear_waiting():
    unschedulable = step(PENDING_STATUS, [UNSCHEDULABLE, at(1, UNSCHEDULABLE)])
    assert waiting_condition(unschedulable)["message"].endswith(
        "(1 more pod(s) of the group wait too)")
    assert unschedulable.status["reason"] == "Unschedulable"
    config = step(unschedulable.status, [RUNNING, CONFIG_ERROR])
    assert [(e.reason, e.message.split(":")[0]) for e in config.events] == [
        ("CreateContainerConfigError", "pod train-1 cannot start")]
    started = step(config.status, [RUNNING, at(1, RUNNING)])
    assert (waiting_condition(started)["status"], started.status["phase"]) == ("False", "Running")
    assert started.status["reason"] == "AllNodesRunning"


def test_a_pod_between_two_tries_keeps_the_condition_without_a_new_event():
    looping = step(PENDING_STATUS, [INIT_CRASHLOOP, at(1, CREATING)])
    retrying = step(looping.status, [CREATING, at(1, CREATING)])  # the init container runs again
    assert waiting_condition(retrying) == waiting_condition(looping)
    assert retrying.events == ()


def test_pods_not_started_within_the_waiting_timeout_fail_the_job():
    waiting = step(PENDING_STATUS, [UNSCHEDULABLE, at(1, RUNNING)], waitingTimeoutSeconds=600)
    assert waiting.status["phase"] == "Pending" and waiting.requeue_after == 600
    late = NOW + timedelta(seconds=600)
    failed = step(waiting.status, [UNSCHEDULABLE, at(1, RUNNING)], late,
                  waitingTimeoutSeconds=600)
    assert failed.status["phase"] == "Failed" and failed.status["reason"] == (
        "WaitingTimeoutExceeded")
    assert next(c for c in failed.status["conditions"] if c["type"] == "Failed")["message"] == (
        "not started 600s after the group's pods were created (spec.runPolicy."
        "waitingTimeoutSeconds; 0 waits forever): pod train-0 cannot be scheduled: "
        "Unschedulable: " + UNSCHEDULABLE["status"]["conditions"][0]["message"])
    assert waiting_condition(failed)["status"] == "False"
    forever = step(waiting.status, [UNSCHEDULABLE, at(1, RUNNING)], late + timedelta(days=1),
                   waitingTimeoutSeconds=0)
    assert forever.status["phase"] == "Pending" and forever.requeue_after is None


def test_the_default_waiting_timeout_is_fifteen_minutes():
    assert job().run_policy.waiting_timeout_seconds == 900
    assert step(PENDING_STATUS, [CREATING, at(1, CREATING)]).requeue_after == 900


def test_a_pod_killed_for_memory_says_out_of_memory_first_and_counts_the_restart():
    running = {**PENDING_STATUS, "phase": "Running"}
    plan = step(running, [at(0, RUNNING), OOM_KILLED])
    assert plan.status["phase"] == "Restarting" and plan.status["restartsCounted"] == 1
    assert plan.status["lastFailure"] == (
        "out of memory: the kernel killed container trainer of pod train-1 at its memory limit "
        "300Mi (OOMKilled); pod train-1 failed (OOMKilled) with exit code 137")
    assert [e.message.startswith("out of memory") for e in plan.events] == [True]


def test_the_rank_killed_for_memory_is_named_before_the_peers_it_took_down():
    peer = manifest(0, "Failed", containers=[{
        "name": "trainer", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": 1, "reason": "Error",
                                 "message": "RuntimeError: Connection closed by peer"}}}])
    plan = step({**PENDING_STATUS, "phase": "Running"}, [peer, OOM_KILLED])
    assert plan.status["lastFailure"].startswith(
        "out of memory: the kernel killed container trainer of pod train-1")


# --- the trainer container speaks for the pod (sidecars, init containers) ---


def with_sidecar(body, first=False):
    """`body` with a plain sidecar container still running (a mesh's proxy, a log shipper):
    the pod stays Running whatever the trainer did. `first`: injected before the trainer, the
    default-container annotation naming the trainer, as Istio does."""
    copy = json.loads(json.dumps(body))
    proxy = {"name": "istio-proxy", "ready": True, "restartCount": 0,
             "state": {"running": {"startedAt": "2026-01-01T12:00:30Z"}}}
    copy["status"]["phase"] = "Running"
    statuses = copy["status"]["containerStatuses"]
    copy["status"]["containerStatuses"] = [proxy, *statuses] if first else [*statuses, proxy]
    spec = copy["spec"]["containers"]
    copy["spec"]["containers"] = [{"name": "istio-proxy"}, *spec] if first \
        else [*spec, {"name": "istio-proxy"}]
    if first:
        copy["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"] = "trainer"
    return copy


def trainer_ended(code, reason, message=None):
    return manifest(1, "Failed", limit="300Mi", containers=[{
        "name": "trainer", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": code, "reason": reason,
                                 **({"message": message} if message else {})}}}])


def test_a_trainer_dead_beside_a_running_sidecar_fails_its_pod_with_its_own_cause():
    for first in (False, True):
        state = read_pod_state(with_sidecar(OOM_KILLED, first))
        assert (state.phase, state.exit_code, state.reason) == ("Failed", 137, "OOMKilled")
        assert state.cause.startswith("out of memory: the kernel killed container trainer")
    plan = step({**PENDING_STATUS, "phase": "Running"},
                [at(0, RUNNING), with_sidecar(OOM_KILLED, first=True)])
    assert plan.status["phase"] == "Restarting"
    assert plan.status["lastFailure"].startswith("out of memory: the kernel killed container "
                                                 "trainer of pod train-1")




def test_a_pod_being_deleted_keeps_its_phase_while_its_trainer_ends():
    going = with_sidecar(trainer_ended(143, "Error"))
    going["metadata"]["deletionTimestamp"] = "2026-01-01T12:05:00Z"
    assert read_pod_state(going).phase == "Running"


def test_the_trainers_failure_speaks_for_the_pod_not_a_sidecar_ended_with_it():
    for where in (0, 1):
        body = trainer_ended(1, "Error", "KeyError: 'input_ids'")
        body["status"]["containerStatuses"].insert(where, {
            "name": "log-shipper", "ready": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": 2, "reason": "Error",
                                     "message": "flush failed"}}})
        body["spec"]["containers"].append({"name": "log-shipper"})
        state = read_pod_state(body)
        assert (state.exit_code, state.message) == (1, "KeyError: 'input_ids'")


def init_failed(reason, code, message=None, sidecar_ended=False):
    """A pod whose init container fetch-data ended `code` (restartPolicy Never: the pod failed
    and its containers never ran)."""
    init = [{"name": "fetch-data", "ready": False, "restartCount": 0,
             "state": {"terminated": {"exitCode": code, "reason": reason,
                                      **({"message": message} if message else {})}}}]
    if sidecar_ended:
        init.insert(0, {"name": "proxy", "ready": False, "restartCount": 0,
                        "state": {"terminated": {"exitCode": 137, "reason": "Error"}}})
    body = manifest(0, "Failed", init=init, containers=[trainer_waiting("PodInitializing", "")])
    body["spec"]["initContainers"] = [{"name": "fetch-data", "resources": {
        "limits": {"memory": "256Mi"}}}] + ([{"name": "proxy", "restartPolicy": "Always"}]
                                            if sidecar_ended else [])
    return body


def test_a_failed_init_container_names_itself_its_exit_code_and_its_words():
    state = read_pod_state(init_failed("Error", 1, "AccessDenied: ListObjectsV2",
                                       sidecar_ended=True))
    assert (state.phase, state.exit_code) == ("Failed", 1)
    assert state.message == "init container fetch-data: AccessDenied: ListObjectsV2"
    plan = step(PENDING_STATUS, [init_failed("Error", 1, "AccessDenied: ListObjectsV2")])
    assert plan.status["lastFailure"] == ("pod train-0 failed with exit code 1: init container "
                                          "fetch-data: AccessDenied: ListObjectsV2")


def test_an_init_container_killed_for_memory_says_so_first_with_its_limit():
    state = read_pod_state(init_failed("OOMKilled", 137))
    assert state.cause == ("out of memory: the kernel killed container fetch-data of pod "
                           "train-0 at its memory limit 256Mi (OOMKilled)")


# --- evictions: the node's, or the pod's own limits ---


def evicted(message, by_node_pressure):
    body = manifest(1, "Failed", containers=[{
        "name": "trainer", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}])
    body["status"].update(reason="Evicted", message=message)
    if by_node_pressure:  # the kubelet's eviction manager sets it for node pressure only
        body["status"]["conditions"].append({
            "type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
            "message": message})
    return body


def test_an_eviction_for_the_pods_own_storage_limit_is_counted_like_out_of_memory():
    limit = evicted("Pod ephemeral local storage usage exceeds the total limit of containers "
                    "50Gi. ", by_node_pressure=False)
    plan = step({**PENDING_STATUS, "phase": "Running"}, [at(0, RUNNING), limit])
    assert (plan.status["restartsCounted"], plan.status["lastFailureReason"]) == (1, "Evicted")
    assert "exceeds the total limit of containers 50Gi" in plan.status["lastFailure"]
    pressure = evicted("The node was low on resource: ephemeral-storage. ",
                       by_node_pressure=True)
    plan = step({**PENDING_STATUS, "phase": "Running"}, [at(0, RUNNING), pressure])
    assert (plan.status["restartsCounted"], plan.status["restarts"]) == (0, 1)
    assert plan.status["lastFailureReason"] == "TerminationByKubelet"


def test_an_event_keeps_the_start_and_the_end_of_a_long_text():
    from accelerate_operator.status import Event, build_event

    text = "out of memory: the cause" + " NCCL WARN noise" * 200 + " KeyError: 'input_ids'"
    message = build_event({"name": "train", "namespace": "ml"}, Event("Warning", "PodFailed",
                                                                      text), NOW)["message"]
    assert len(message) == 1024 and " [...] " in message
    assert message.startswith("out of memory: the cause")
    assert message.endswith("KeyError: 'input_ids'")
