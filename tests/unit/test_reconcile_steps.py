"""The reconcile pass (parse -> observe -> plan -> apply) against a fake API (tests/helpers/
fake_kube.py): what each pass creates, deletes and writes, with no cluster. The pure step,
plan_pass, is also tested alone; the clock with a fake time."""

from __future__ import annotations

import asyncio
from datetime import datetime

from accelerate_operator.api import parse_job
from accelerate_operator.clock import PROGRESS_SECONDS, RESYNC_SECONDS, Clock
from accelerate_operator.memory import InFlight
from accelerate_operator.plan import Observed, plan_pass
from accelerate_operator.reconciler import Reconciler
from accelerate_operator.resources.configmap import ConfigSource

from tests.helpers.fake_kube import FakeKube
from tests.helpers.jobs import JobBuilder, pod

NOW = datetime(2026, 1, 1, 12, 0, 0)


class Cluster:
    """The fake API plus a job whose status follows the operator's writes, as the watch would
    deliver them."""

    def __init__(self, body: dict, kube: FakeKube | None = None):
        self.kube = kube or FakeKube()
        self.body = body
        self.reconciler = Reconciler(self.kube)

    def reconcile(self, *, indexed: bool = True) -> float | None:
        pods = self.kube.pods() if indexed else []
        children = self.kube.children() if indexed else set()
        requeue = asyncio.run(self.reconciler.reconcile(self.body, pods, children))
        for status in self.kube.statuses:
            self.body.setdefault("status", {}).update(status)
        return requeue

    def phase(self) -> str | None:
        return (self.body.get("status") or {}).get("phase")


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
    cluster.reconcile()
    assert cluster.phase() == "Running"
    cluster.kube.calls.clear()
    cluster.reconcile()
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
    kube = FakeKube()
    kube.refuse_pods = "violates PodSecurity restricted"
    cluster = Cluster(JobBuilder("llm").nodes(2).build(), kube)
    cluster.reconcile()
    assert cluster.phase() == "Failed"
    assert len(kube.statuses) == 1  # no status claiming the pods were created
    failed = next(c for c in kube.statuses[0]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PodRejected" and "PodSecurity" in failed["message"]
    assert [e.reason for e in kube.events] == ["PodRejected"]


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


# ---- plan_pass alone: pure ------------------------------------------------------------------


def observed(body: dict, **changes) -> Observed:
    values = dict(body=body, job=parse_job(body), status=body.get("status") or {}, pods=(),
                  children=frozenset())
    return Observed(**{**values, **changes})


def test_plan_builds_only_the_missing_children():
    body = JobBuilder("llm").nodes(1).build()
    actions = plan_pass(observed(body, children=frozenset({("ConfigMap",
                                                              "llm-accelerate-config")})), NOW)
    assert [(m["kind"], m["metadata"]["name"]) for m in actions.children] == [("Service", "llm")]
    assert [m["metadata"]["name"] for m in actions.pods] == ["llm-0"]


def test_plan_names_the_configmap_whose_config_contradicts_the_job():
    body = JobBuilder("llm").nodes(2).config_from("mine", "a.yaml").build()
    text = "distributed_type: MULTI_CPU\nuse_cpu: true\nnum_machines: 3\n"
    actions = plan_pass(observed(body, config_source=ConfigSource("mine", "a.yaml", text)), NOW)
    assert actions.status["phase"] == "Failed" and not actions.children and not actions.pods
    assert actions.status["conditions"][-1]["message"].startswith("ConfigMap 'mine' key 'a.yaml'")


def test_plan_asks_the_clock_back_at_the_active_deadline():
    body = JobBuilder("llm").nodes(1).run_policy(activeDeadlineSeconds=60).build()
    body["status"] = {"phase": "Running", "attempt": 0, "startTime": "2026-01-01T11:59:30Z"}
    actions = plan_pass(observed(body, pods=(pod("llm", 0),)), NOW)
    assert actions.requeue_after == 30


# ---- the clock, with a fake time ------------------------------------------------------------


class Time:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def clock_with(requeue=None):
    passes, reads, time = [], [], Time()

    async def reconcile(body):
        passes.append(body["metadata"]["name"])
        return requeue

    async def refresh(body):
        reads.append(body["metadata"]["name"])

    return Clock(reconcile, refresh, now=time), passes, reads, time


def test_the_clock_runs_a_pass_when_the_plan_asked_for_one():
    clock, passes, _, time = clock_with(requeue=5.0)
    body = JobBuilder("llm").build()
    clock.track(body)
    asyncio.run(clock.run_pass(body))
    time.now += 4
    asyncio.run(clock.tick())
    assert passes == ["llm"]
    time.now += 1
    asyncio.run(clock.tick())
    assert passes == ["llm", "llm"]


def test_the_clock_resyncs_an_unfinished_job_and_reads_progress_while_running():
    clock, passes, reads, time = clock_with()
    body = JobBuilder("llm").build()
    body["status"] = {"phase": "Running"}
    clock.track(body)
    asyncio.run(clock.tick())
    assert (passes, reads) == ([], ["llm"])
    time.now += PROGRESS_SECONDS
    asyncio.run(clock.tick())
    assert reads == ["llm", "llm"]
    time.now += RESYNC_SECONDS
    asyncio.run(clock.tick())
    assert passes == ["llm"]


def test_a_finished_job_without_a_ttl_leaves_the_clock():
    clock, passes, reads, time = clock_with()
    body = JobBuilder("llm").build()
    body["status"] = {"phase": "Succeeded"}
    clock.track(body)
    time.now += 10 * RESYNC_SECONDS
    asyncio.run(clock.tick())
    assert (passes, reads) == ([], [])


def test_in_flight_objects_expire_so_a_pod_deleted_unseen_is_not_hidden_long():
    time = Time()
    cache = InFlight(ttl=30, clock=time)
    cache.record("u", [{"kind": "Pod", "metadata": {"name": "llm-0", "labels": {
        "accelerate-operator.io/attempt": "0", "accelerate-operator.io/node-index": "0"}}}])
    pods, _ = cache.add_to("u", 0, [], frozenset())
    assert [p.name for p in pods] == ["llm-0"]
    time.now += 31
    pods, _ = cache.add_to("u", 0, [], frozenset())
    assert pods == []


def test_events_arriving_while_a_pass_waits_join_it():
    """Ten events of one job at once (its pods created, scheduled, started...): the first pass
    runs, the nine others join the single pass waiting behind it, which reads the indexes
    when it starts; every caller gets that pass's result."""
    kube = FakeKube()
    reconciler = Reconciler(kube)
    body = JobBuilder("llm").nodes(2).build()
    index_reads = []

    def indexed():
        index_reads.append(len(kube.pods()))
        return kube.pods(), kube.children(), None

    async def burst():
        return await asyncio.gather(*(reconciler.reconcile_latest(body, indexed)
                                      for _ in range(10)))

    results = asyncio.run(burst())
    assert index_reads == [0, 2]  # two passes: the second saw the first one's pods
    assert [c for c in kube.calls if c[0] == "create"].count(("create", "Pod", "llm-0")) == 1
    assert len(set(results[1:])) == 1  # the nine who joined share one result
    assert reconciler._waiting == {}
