"""The reconcile pass (parse -> snapshot -> read -> decide -> apply) against a fake API
(tests/helpers/fake_kube.py): what each pass creates, deletes and writes, with no cluster. The
pure step, decide, is also tested alone, and when a pass asks to be run again (requeue_after)."""

from __future__ import annotations

from accelerate_operator.decide import RESYNC_SECONDS, decide, requeue_after
from accelerate_operator.resources.configmap import ConfigSource, read_ca_digest
from accelerate_operator.snapshot import Snapshot
from accelerate_operator.state import JobState

from tests.helpers.fake_kube import FakeKube
from tests.helpers.jobs import JobBuilder, pod
from tests.helpers.passes import Cluster, snapshot


def test_a_new_job_gets_its_configmap_service_and_pods_in_one_pass():
    cluster = Cluster(JobBuilder("llm").nodes(2).build())
    cluster.reconcile()
    assert cluster.kube.names("ConfigMap") == ["llm-accelerate-config"]
    assert cluster.kube.names("Service") == ["llm"]
    assert cluster.kube.names("Pod") == ["llm-0", "llm-1"]
    assert cluster.phase() == "Pending"
    assert [e.reason for e in cluster.kube.events] == ["PodsCreated"]


def test_a_pass_with_nothing_to_change_makes_no_api_call():
    cluster = Cluster(JobBuilder("llm").nodes(2).build())
    cluster.reconcile()
    for name in ("llm-0", "llm-1"):
        cluster.kube.set_pod_phase(name, "Running")
    cluster.kube.calls.clear()
    cluster.reconcile()  # pod 0 runs: its versions come in its reports, no log is read
    assert cluster.phase() == "Running"
    assert not [call for call in cluster.kube.calls if call[0] == "log"]
    cluster.kube.calls.clear()
    cluster.reconcile()  # nothing changed and no read due (the clock stands still here)
    assert cluster.kube.calls == []


def test_a_configmap_or_service_deleted_by_hand_is_recreated_on_the_next_pass():
    cluster = Cluster(JobBuilder("llm").nodes(1).build())
    cluster.reconcile()
    cluster.reconcile()  # a pod event: the indexes show the children
    del cluster.kube.objects[("ConfigMap", "llm-accelerate-config")]
    del cluster.kube.objects[("Service", "llm")]
    cluster.kube.calls.clear()
    cluster.reconcile()
    assert ("create", "ConfigMap", "llm-accelerate-config") in cluster.kube.calls
    assert ("create", "Service", "llm") in cluster.kube.calls
    assert ("create", "Pod", "llm-0") not in cluster.kube.calls


def test_children_created_but_not_yet_indexed_are_not_created_again():
    cluster = Cluster(JobBuilder("llm").nodes(2).build())
    cluster.reconcile(indexed=False)
    cluster.kube.calls.clear()
    cluster.reconcile(indexed=False)  # a pod event before the watch shows the new objects
    assert [c for c in cluster.kube.calls if c[0] == "create"] == []


def test_a_refused_pod_fails_the_job_with_the_servers_reason_on_the_next_pass():
    """The pass the API server refused a pod in ends there, writing nothing; the next, at once,
    fails the job."""
    kube = FakeKube()
    kube.refuse_pods = "violates PodSecurity restricted"
    cluster = Cluster(JobBuilder("llm").nodes(2).build(), kube)
    cluster.reconcile()
    assert cluster.phase() == "Failed"
    assert len(kube.statuses) == 1  # no status claiming the pods were created
    failed = next(c for c in kube.statuses[0]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PodRejected" and "PodSecurity" in failed["message"]
    assert [e.reason for e in kube.events] == ["PodRejected"]


def test_a_refused_child_fails_the_job_under_its_kinds_reason_whatever_the_message_says():
    kube = FakeKube()
    kube.refuse["Service"] = "the API server refused Workload x: a message naming another kind"
    cluster = Cluster(JobBuilder("llm").nodes(2).build(), kube)
    cluster.reconcile()
    failed = next(c for c in kube.statuses[0]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "ServiceRejected"
    assert [e.reason for e in kube.events] == ["ServiceRejected"]


def test_a_missing_config_configmap_fails_the_job_saying_which():
    cluster = Cluster(JobBuilder("llm").config_from("mine", "accelerate.yaml").build())
    cluster.reconcile()
    assert cluster.phase() == "Failed"
    failed = cluster.kube.statuses[-1]["conditions"][-1]
    assert failed["reason"] == "InvalidConfig" and "'mine'" in failed["message"]
    assert cluster.kube.names("Pod") == [] and cluster.kube.names("Service") == []


def test_the_config_from_a_configmap_is_read_once_while_its_copy_is_missing():
    kube = FakeKube({"mine": {"a.yaml": "distributed_type: MULTI_CPU\nuse_cpu: true\n"}})
    cluster = Cluster(JobBuilder("llm").nodes(1).config_from("mine", "a.yaml").build(), kube)
    cluster.reconcile()
    cluster.reconcile()
    assert kube.calls.count(("read", "ConfigMap", "mine")) == 1
    assert "use_cpu: true" in kube.objects[("ConfigMap", "llm-accelerate-config")]["data"][
        "config.yaml"]


def test_a_topology_left_to_the_yaml_is_read_from_the_configmap_then_from_status():
    kube = FakeKube({"mine": {
        "a.yaml": "distributed_type: MULTI_CPU\nuse_cpu: true\nnum_machines: 2\n"
                  "num_processes: 4\nmain_process_port: 9999\n",
        "ds.json": "{}"}})
    body = JobBuilder("llm").config_from("mine", "a.yaml").build()
    for key in ("numNodes", "numProcPerNode", "masterPort"):
        body["spec"].pop(key, None)
    cluster = Cluster(body, kube)
    cluster.reconcile()
    assert cluster.kube.names("Pod") == ["llm-0", "llm-1"]
    assert cluster.body["status"]["topology"] == {"numNodes": 2, "numProcPerNode": 2,
                                                  "worldSize": 4, "masterPort": 9999,
                                                  "summary": "2x2"}
    rendered = kube.objects[("ConfigMap", "llm-accelerate-config")]["data"]
    assert rendered["ds.json"] == "{}"  # shipped beside the config
    pod_env = {e["name"]: e["value"] for e in
               kube.objects[("Pod", "llm-1")]["spec"]["containers"][0]["env"]}
    assert (pod_env["NUM_NODES"], pod_env["MASTER_PORT"]) == ("2", "9999")
    kube.calls.clear()
    cluster.reconcile()  # status.topology is known now: the ConfigMap is not read again
    assert ("read", "ConfigMap", "mine") not in kube.calls


def test_a_restart_archives_the_old_groups_logs_then_creates_a_new_group():
    cluster = Cluster(JobBuilder("llm").nodes(2).build())
    cluster.reconcile()
    cluster.kube.set_pod_phase("llm-0", "Running")
    cluster.kube.set_pod_phase("llm-1", "Failed", exit_code=1)
    cluster.kube.logs["llm-1"] = "Traceback: boom\n"
    cluster.reconcile()
    assert cluster.phase() == "Restarting" and cluster.body["status"]["attempt"] == 1
    archive = cluster.kube.objects[("ConfigMap", "llm-logs-attempt-0")]
    assert archive["data"]["llm-1.log"] == "Traceback: boom\n"
    assert cluster.kube.names("Pod") == []  # the old group goes first...
    cluster.reconcile()
    assert cluster.kube.names("Pod") == ["llm-0", "llm-1"]  # ...then the new one comes
    assert {p.attempt for p in cluster.kube.pods()} == {1}


def test_a_pod_not_ready_makes_the_pass_read_its_node_and_a_lost_one_is_force_deleted():
    cluster = Cluster(JobBuilder("llm").nodes(2).build())
    cluster.reconcile()
    for name, node in (("llm-0", "node-a"), ("llm-1", "node-b")):
        cluster.kube.set_pod_phase(name, "Running")
        cluster.kube.objects[("Pod", name)]["spec"]["nodeName"] = node
    cluster.reconcile()
    assert cluster.phase() == "Running"
    # The node controller marks the pods of a node it no longer hears from not Ready.
    cluster.kube.objects[("Pod", "llm-1")]["status"]["conditions"] = [
        {"type": "Ready", "status": "False"}]
    cluster.kube.nodes["node-b"] = {"metadata": {"name": "node-b"}, "status": {"conditions": [
        {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
    cluster.kube.calls.clear()
    cluster.reconcile()  # a readiness probe, not the node: only readyNodes changes
    assert cluster.kube.calls[0] == ("read", "Node", "node-b")
    assert cluster.phase() == "Running" and cluster.body["status"]["readyNodes"] == "1/2"
    assert not [c for c in cluster.kube.calls if "delete" in c[0]]
    cluster.kube.nodes["node-b"]["status"]["conditions"][0]["status"] = "Unknown"
    cluster.kube.calls.clear()
    cluster.reconcile()
    assert cluster.phase() == "Restarting"
    assert {c for c in cluster.kube.calls if c[0] in ("delete", "force-delete")} == {
        ("force-delete", "Pod", "llm-0"), ("force-delete", "Pod", "llm-1")}


def test_the_report_ca_bundle_reaches_the_jobs_configmap_through_the_jobs_own_pass():
    cluster = Cluster(JobBuilder("llm").nodes(1).build())
    cluster.report_ca = "CA one"
    cluster.reconcile()
    configmap = cluster.kube.objects[("ConfigMap", "llm-accelerate-config")]
    assert configmap["data"]["report-ca.crt"] == "CA one"  # created with it
    cluster.report_ca = "CA two"  # the operator's certificate was renewed
    cluster.kube.calls.clear()
    cluster.reconcile()
    assert cluster.kube.calls == [("patch", "ConfigMap", "llm-accelerate-config")]
    assert configmap["data"]["report-ca.crt"] == "CA two"
    cluster.kube.calls.clear()
    cluster.reconcile()
    assert cluster.kube.calls == []  # the index shows it: nothing more to write


def test_a_ca_bundle_is_written_only_into_an_indexed_configmap_of_an_unfinished_job():
    body = JobBuilder("llm").nodes(1).build()
    children = frozenset({("ConfigMap", "llm-accelerate-config"), ("Service", "llm")})
    old = read_ca_digest({"data": {"report-ca.crt": "CA one"}})
    stale = decide(observed(body, children=children, report_ca="CA two", configmap_ca=old))
    assert stale.ca_patch == ("llm-accelerate-config", {"report-ca.crt": "CA two"})
    assert decide(observed(body, children=children, report_ca="CA two",
                           configmap_ca=None)).ca_patch is None  # not indexed yet
    assert decide(observed(body, children=children, report_ca=None,
                           configmap_ca=old)).ca_patch is None  # no bundle known yet
    body["status"] = {"phase": "Succeeded", "attempt": 0}
    assert decide(observed(body, children=children, report_ca="CA two",
                           configmap_ca=old)).ca_patch is None  # its pods report no more


def test_a_finished_job_past_its_ttl_is_deleted():
    body = JobBuilder("llm").run_policy(ttlSecondsAfterFinished=0).build()
    body["status"] = {"phase": "Succeeded", "attempt": 0, "completionTime": "2026-01-01T00:00:00Z"}
    cluster = Cluster(body)
    cluster.reconcile()
    assert cluster.kube.job_deleted
    assert cluster.kube.names("ConfigMap") == []  # a finished job gets no children back


def test_a_job_being_deleted_is_left_alone():
    body = JobBuilder("llm").build()
    body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    cluster = Cluster(body)
    cluster.reconcile()
    assert cluster.kube.calls == []


# ---- decide alone: pure ---------------------------------------------------------------------


def observed(body: dict, **changes) -> Snapshot:
    return snapshot(body, status=body.get("status") or {}, **changes)


def test_decide_builds_only_the_missing_children():
    body = JobBuilder("llm").nodes(1).build()
    actions = decide(observed(body, children=frozenset({("ConfigMap",
                                                          "llm-accelerate-config")})))
    assert [(m["kind"], m["metadata"]["name"]) for m in actions.children] == [
        ("Service", "llm")]
    assert [m["metadata"]["name"] for m in actions.pods] == ["llm-0"]


def test_decide_names_the_configmap_whose_config_contradicts_the_job():
    body = JobBuilder("llm").nodes(2).config_from("mine", "a.yaml").build()
    text = "distributed_type: MULTI_CPU\nuse_cpu: true\nnum_machines: 3\n"
    actions = decide(observed(body, config_source=ConfigSource("mine", "a.yaml", text)))
    assert actions.status["phase"] == "Failed" and not actions.children and not actions.pods
    assert actions.status["conditions"][-1]["message"].startswith("ConfigMap 'mine' key 'a.yaml'")


def test_decide_asks_the_clock_back_at_the_active_deadline():
    body = JobBuilder("llm").nodes(1).run_policy(activeDeadlineSeconds=60).build()
    body["status"] = {"phase": "Running", "attempt": 0, "startTime": "2026-01-01T11:59:30Z"}
    actions = decide(observed(body, pods=(pod("llm", 0),)))
    assert actions.outcome.requeue_after == 30
    assert actions.requeue_after == 30


# ---- when a pass asks to be run again ------------------------------------------------------


def seen_with(phase: str | None) -> Snapshot:
    body = JobBuilder("llm").build()
    body["status"] = {"phase": phase} if phase else {}
    return observed(body)


def test_an_unfinished_job_comes_back_for_the_resync_or_what_is_due_sooner():
    """A running job's progress comes as pod events: no timer reads it."""
    assert requeue_after(seen_with("Running"), None, []) == RESYNC_SECONDS
    assert requeue_after(seen_with("Pending"), None, []) == RESYNC_SECONDS
    assert requeue_after(seen_with("Running"), None, [2.0]) == 2.0  # the lifecycle's
    held = requeue_after(seen_with("Running"), None, [None, 3.0])  # a progress write held back
    assert held == 3.0
    assert requeue_after(seen_with("Succeeded"), None, [1.0]) == 1.0


def test_a_finished_job_comes_back_only_for_its_ttl():
    assert requeue_after(seen_with("Succeeded"), None, []) is None
    assert requeue_after(seen_with("Succeeded"), None, [60.0]) == 60.0
    assert requeue_after(seen_with("Running"), {"phase": "Failed"}, []) is None  # finishing


def test_in_flight_objects_expire_so_a_pod_deleted_unseen_is_not_hidden_long():
    state = JobState("u")
    state.record_created([{"kind": "Pod", "metadata": {"name": "llm-0", "labels": {
        "accelerate-operator.io/attempt": "0", "accelerate-operator.io/node-index": "0"}}}],
        now=1000.0)
    pods, _ = state.with_in_flight(0, [], frozenset(), now=1000.0)
    assert [p.name for p in pods] == ["llm-0"]
    pods, _ = state.with_in_flight(0, [], frozenset(), now=1031.0)  # IN_FLIGHT_SECONDS: 30
    assert pods == []
    state.prune_in_flight(0, [], frozenset(), now=1031.0)
    assert state.in_flight == {}
