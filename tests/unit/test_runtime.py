"""The runtime between kopf's events and the passes, without a cluster: the work queue (one pass
per job at a time, events merged, requeue after, backoff, paused while a standby), the
controller's reading of kopf's indexes (stale pods, ghosts found by the audit), what each event
runs (nothing for a pod state already planned from; a deletion after the grace check), and
following kopf's peering. kopf itself runs these handlers against the real API server in
tests/integration/test_operator_in_process.py and test_kopf_runner.py."""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import logging
from collections.abc import AsyncIterator, Hashable
from pathlib import Path
from typing import Any

import kopf
import pytest
from accelerate_operator.__main__ import replica_priority
from accelerate_operator.controller import (
    LAST_APPLIED,
    Controller,
    PauseTracker,
    failing_pass_event,
    lean_job,
    lean_workload,
    pod_entry,
)
from accelerate_operator.kube import ApiError
from accelerate_operator.workqueue import WorkQueue

from tests.helpers.fake_kube import FakeKube
from tests.helpers.jobs import JobBuilder, pod

JOB_LABEL = "accelerate-operator.io/job-name"


class FakeIndex(dict):
    """What kopf.Index offers a pass: values by key."""

    def put(self, key: Hashable, value: Any) -> None:
        self.setdefault(key, []).append(value)

    def drop(self, key: Hashable, match) -> None:
        self[key] = [v for v in self.get(key, []) if not match(v)]
        if not self[key]:
            del self[key]


class ListingKube(FakeKube):
    """FakeKube plus the audit's listing: what the API server has now."""

    async def list_names(self, path: str, label_selector: str | None = None
                         ) -> AsyncIterator[tuple[str, str]]:
        kind = {"pods": "Pod", "services": "Service", "configmaps": "ConfigMap",
                "poddisruptionbudgets": "PodDisruptionBudget"}[path.rsplit("/", 1)[1]]
        for (k, name) in list(self.objects):
            if k == kind:
                yield "ml", name


def job_body(name: str = "llm", uid: str = "uid-1", **metadata: Any) -> dict[str, Any]:
    body = JobBuilder(name).nodes(2).build()
    body["metadata"].update(namespace="ml", uid=uid, resourceVersion="1", **metadata)
    return body


def pod_body(job: str, index: int, owner: str, *, attempt: int = 0,
             phase: str = "Running") -> dict[str, Any]:
    return {"metadata": {
        "name": f"{job}-{index}", "namespace": "ml",
        "labels": {JOB_LABEL: job, "accelerate-operator.io/node-index": str(index),
                   "accelerate-operator.io/attempt": str(attempt)},
        "ownerReferences": [{"kind": "AccelerateJob", "uid": owner}]},
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True"}]}}


class Harness:
    """A Controller on fake indexes, filled as kopf's index handlers would fill them."""

    def __init__(self, kube: FakeKube | None = None):
        self.kube = kube or ListingKube()
        self.controller = Controller(self.kube)
        self.indexes = {name: FakeIndex() for name in
                        ("job_bodies", "job_pods", "job_services", "job_configmaps",
                         "job_pdbs")}
        self.controller.indexes = self.indexes

    def add_job(self, body: dict[str, Any]) -> None:
        self.indexes["job_bodies"][("ml", body["metadata"]["name"])] = [lean_job(body)]

    def index_created(self) -> None:
        """What the pass created, as the watches bring it into the indexes (no events)."""
        for key in self.indexes:
            if key != "job_bodies":
                self.indexes[key].clear()
        for (kind, name), manifest in self.kube.objects.items():
            job = ("ml", manifest["metadata"]["labels"][JOB_LABEL])
            if kind == "Pod":
                self.indexes["job_pods"].put(job, pod_entry(manifest))
            elif kind in ("Service", "ConfigMap"):
                self.indexes[f"job_{kind.lower()}s"].put(job, name)
            elif kind == "PodDisruptionBudget":
                self.indexes["job_pdbs"].put(job, name)

    async def start_job(self) -> dict[str, Any]:
        """The workers started, then a two-node job's first pass (its children created)."""
        self.controller.queue.start()
        body = job_body()
        self.add_job(body)
        self.controller.on_job("ADDED", body)
        await self.settle()
        return body

    async def settle(self) -> None:
        """Until no pass runs or waits, nor is due within a second (the resync's is not)."""
        for _ in range(200):
            await asyncio.sleep(0.01)
            queue = self.controller.queue
            soon = [due for due, _ in queue._timers.values() if due - queue._clock() < 1.0]
            if not queue._queued and not queue._running and not soon:
                return
        raise AssertionError("the work queue did not settle")


# ---- the work queue ------------------------------------------------------------------------

def test_events_of_a_job_merge_and_one_arriving_during_its_pass_runs_it_once_more():
    async def go():
        runs, release = [], asyncio.Event()

        async def run(key):
            runs.append(key)
            if len(runs) == 1:
                await release.wait()
            return None

        queue = WorkQueue(run, workers=4)
        queue.start()
        for _ in range(10):
            queue.add("a")  # a burst before any pass starts: one pass
        await asyncio.sleep(0.02)
        for _ in range(10):
            queue.add("a")  # during that pass: exactly one more, after it
        await asyncio.sleep(0.02)
        assert runs == ["a"]  # never two passes of one key at once
        release.set()
        await asyncio.sleep(0.05)
        await queue.stop()
        return runs

    assert asyncio.run(go()) == ["a", "a"]


def test_requeue_after_keeps_the_earliest_and_forget_cancels_it():
    async def go():
        runs = []

        async def run(key):
            runs.append(key)
            return None

        queue = WorkQueue(run)
        queue.start()
        queue.add_after("a", 10)
        queue.add_after("a", 0.05)  # earlier: replaces
        queue.add_after("a", 5)     # later: ignored
        queue.add_after("b", 0.05)
        queue.forget("b")
        await asyncio.sleep(0.15)
        await queue.stop()
        return runs

    assert asyncio.run(go()) == ["a"]


def test_a_failing_pass_is_retried_with_backoff_and_the_plans_requeue_is_honoured(monkeypatch):
    monkeypatch.setattr("accelerate_operator.workqueue.BACKOFF_FIRST_SECONDS", 0.02)

    async def go():
        runs = []

        async def run(key):
            runs.append(key)
            if len(runs) < 3:
                raise RuntimeError("the API server said 500")
            return 0.05 if len(runs) == 3 else None

        queue = WorkQueue(run)
        queue.start()
        queue.add("a")
        await asyncio.sleep(0.4)
        await queue.stop()
        return runs

    assert asyncio.run(go()) == ["a"] * 4  # two failures, a success asking to come back, again


class WebhookDownKube(ListingKube):
    """Pod creation refused as the API server refuses it while a fail-closed admission webhook
    has no endpoint (Kueue's mpod.kb.io while its controller restarts): a 500, not a
    rejection of the manifest, so it is retried."""

    def __init__(self) -> None:
        super().__init__()
        self.webhook_down = True

    async def create_if_absent(self, manifest):
        if manifest["kind"] == "Pod" and self.webhook_down:
            raise ApiError(500, "Internal Server Error", json.dumps({
                "kind": "Status", "message": 'Internal error occurred: failed calling webhook '
                '"mpod.kb.io": no endpoints available for service "kueue-webhook-service"'}))
        return await super().create_if_absent(manifest)


def test_a_pass_that_keeps_failing_tells_the_user_why_and_recovers(monkeypatch):
    monkeypatch.setattr("accelerate_operator.workqueue.BACKOFF_FIRST_SECONDS", 0.01)
    monkeypatch.setattr("accelerate_operator.workqueue.BACKOFF_MAX_SECONDS", 0.01)
    harness = Harness(WebhookDownKube())

    async def go():
        harness.controller.queue.start()
        harness.add_job(job_body())
        harness.controller.on_job("ADDED", job_body())
        for _ in range(100):  # the third failure in a row posts the warning
            await asyncio.sleep(0.01)
            if harness.kube.events:
                break
        warnings = list(harness.kube.events)
        harness.kube.webhook_down = False
        await harness.settle()
        await harness.controller.queue.stop()
        return warnings

    warnings = asyncio.run(go())
    assert [(e.type, e.reason) for e in warnings] == [("Warning", "ReconcileFailing")]
    assert "last 3 attempts" in warnings[0].message
    assert 'failed calling webhook "mpod.kb.io"' in warnings[0].message
    assert harness.kube.names("Pod") == ["llm-0", "llm-1"]  # it recovered once the webhook did
    assert ("ml", "llm") not in harness.controller.queue._failures  # the count starts again


def test_the_failing_pass_warning_is_posted_at_the_third_failure_then_every_tenth():
    error = RuntimeError("connection refused")
    due = [n for n in range(1, 40) if failing_pass_event(n, error) is not None]
    assert due == [3, 13, 23, 33]
    assert "RuntimeError('connection refused')" in failing_pass_event(3, error).message


def test_a_paused_queue_runs_no_pass_until_resumed():
    async def go():
        runs = []

        async def run(key):
            runs.append(key)

        queue = WorkQueue(run)
        queue.paused = True
        queue.start()
        queue.add("a")
        await asyncio.sleep(0.05)
        assert runs == []
        queue.paused = False
        await asyncio.sleep(0.05)
        await queue.stop()
        return runs

    assert asyncio.run(go()) == ["a"]


# ---- what a pass reads of the indexes ----------------------------------------------------------

def test_pods_left_by_an_earlier_job_of_the_same_name_are_stale_not_failures():
    harness = Harness()
    harness.indexes["job_pods"].put(("ml", "train"), pod_entry(pod_body("train", 1, "uid-new")))
    harness.indexes["job_pods"].put(("ml", "train"),
                                    pod_entry(pod_body("train", 0, "uid-old", attempt=3)))
    mine, earlier = sorted(harness.controller.pods_of(("ml", "train"), "uid-new"),
                           key=lambda p: p.name, reverse=True)
    assert mine == pod("train", 1)
    assert (earlier.name, earlier.attempt, earlier.deleting) == ("train-0", -1, True)


def test_a_job_is_indexed_without_managed_fields_or_kubectls_copy_of_itself():
    body = job_body(managedFields=[{"manager": "kubectl"}],
                    annotations={LAST_APPLIED: "{...}", "team": "ml"})
    lean = lean_job(body)
    assert "managedFields" not in lean["metadata"]
    assert lean["metadata"]["annotations"] == {"team": "ml"}
    assert lean["spec"] == body["spec"]
    workload = lean_workload({"metadata": {"name": "w", "managedFields": []},
                              "spec": {"podSets": [{"count": 2}], "active": False}})
    assert workload["spec"] == {"active": False} and "managedFields" not in workload["metadata"]


# ---- events and passes ------------------------------------------------------------------------

@pytest.mark.parametrize("seen_indexed", [True, False])
def test_a_deleted_child_is_recreated_after_the_grace(monkeypatch, seen_indexed):
    """Whether or not a pass saw the child indexed before it went: when none did (its creation's
    events run no pass), the job's state still has it in flight, and its DELETED event ends that,
    so the pass recreates it at once rather than IN_FLIGHT_SECONDS later."""
    monkeypatch.setattr("accelerate_operator.controller.DELETION_GRACE_SECONDS", 0.05)
    harness = Harness()

    async def go():
        body = await harness.start_job()
        assert harness.kube.names("Pod") == ["llm-0", "llm-1"]
        if seen_indexed:
            harness.index_created()
            harness.controller.on_job("MODIFIED", body)  # the indexes show what was in flight
            await harness.settle()
        harness.kube.calls.clear()
        deleted = harness.kube.objects.pop(("ConfigMap", "llm-accelerate-config"))
        harness.index_created()
        harness.controller.on_child("DELETED", "ConfigMap", deleted)
        await harness.settle()
        await harness.controller.queue.stop()

    asyncio.run(go())
    assert harness.kube.calls == [("get", "AccelerateJob", "llm"),
                                  ("create", "ConfigMap", "llm-accelerate-config")]


def test_a_pod_event_that_changes_nothing_a_pass_reads_runs_no_pass():
    harness = Harness()

    async def go():
        body = await harness.start_job()
        harness.index_created()
        harness.controller.on_job("MODIFIED", body)  # the pass now plans from the pods
        await harness.settle()
        passes = harness.controller.queue.passes
        manifest = copy.deepcopy(harness.kube.objects[("Pod", "llm-0")])
        manifest["status"] = {"phase": "Pending", "podIP": "10.244.1.7", "qosClass": "Burstable"}
        harness.controller.on_pod("MODIFIED", manifest)  # same PodState as planned from
        await harness.settle()
        unchanged = harness.controller.queue.passes - passes
        manifest["status"] = {"phase": "Running",
                              "conditions": [{"type": "Ready", "status": "True"}]}
        harness.controller.on_pod("MODIFIED", manifest)  # it started: a pass
        await harness.settle()
        changed = harness.controller.queue.passes - passes - unchanged
        await harness.controller.queue.stop()
        return unchanged, changed

    assert asyncio.run(go()) == (0, 1)


@pytest.mark.parametrize("job_deleted_first", [False, True])
def test_children_deleted_with_their_job_are_not_recreated(monkeypatch, job_deleted_first):
    """The garbage collector's (or a namespace's) deletions of a deleted job's children can
    arrive before the job's own DELETED event: after the grace the API server says the job is
    gone, and no pass recreates anything. Or after it: then they run no pass at all. Either
    way the controller keeps nothing of the job (it kept the grace check's key for good, one
    per deleted job, when the children's events came last)."""
    monkeypatch.setattr("accelerate_operator.controller.DELETION_GRACE_SECONDS", 0.05)
    harness = Harness()

    def job_deleted(body):
        harness.indexes["job_bodies"].clear()
        harness.controller.on_job("DELETED", body)

    async def go():
        body = await harness.start_job()
        harness.index_created()
        harness.kube.calls.clear()
        harness.kube.jobs_gone.add("llm")  # deleted: the API server no longer has it
        passes = harness.controller.queue.passes
        if job_deleted_first:
            job_deleted(body)
        for kind, name in list(harness.kube.objects):
            manifest = harness.kube.objects.pop((kind, name))
            if kind == "Pod":
                harness.controller.on_pod("DELETED", manifest)
            else:
                harness.controller.on_child("DELETED", kind, manifest)
        harness.index_created()
        await harness.settle()
        if not job_deleted_first:
            job_deleted(body)
        await harness.controller.queue.stop()
        return harness.controller.queue.passes - passes

    passes = asyncio.run(go())
    assert [c for c in harness.kube.calls if c[0] != "get"] == []
    if job_deleted_first:
        assert passes == 0 and harness.kube.calls == []
    assert not harness.controller._check_exists and len(harness.controller.queue) == 0
    assert len(harness.controller.states) == 0


def test_a_namespace_being_deleted_stops_its_jobs_passes_until_a_job_is_created_there(
        monkeypatch):
    """Its pods go before its jobs: the first pass refused ("being terminated") writes no
    status, and marks the namespace; another job's pass there makes no request (not even the
    grace check's GET) and comes back when the mark ends; a job created there (a new namespace
    of the same name) ends the mark at once."""
    monkeypatch.setattr("accelerate_operator.controller.DELETION_GRACE_SECONDS", 0.01)
    monkeypatch.setattr("accelerate_operator.controller.TERMINATING_NAMESPACE_SECONDS", 1.0)
    harness = Harness()

    def delete_pods(job: str) -> None:
        for name in (f"{job}-0", f"{job}-1"):
            harness.controller.on_pod("DELETED", harness.kube.objects.pop(("Pod", name)))
        harness.index_created()

    async def go():
        harness.controller.queue.start()
        for name, uid in (("llm", "uid-1"), ("other", "uid-2")):
            harness.add_job(job_body(name, uid))
            harness.controller.on_job("ADDED", job_body(name, uid))
        await harness.settle()
        harness.index_created()
        harness.kube.calls.clear()
        harness.kube.namespace_terminating = True
        delete_pods("llm")
        await asyncio.sleep(0.2)  # the grace, then the pass (refused: it comes back in 1 s)
        refused = list(harness.kube.calls)
        harness.kube.calls.clear()
        delete_pods("other")
        await asyncio.sleep(0.2)
        skipped = list(harness.kube.calls)
        await asyncio.sleep(1.0)  # the mark ends: both are tried again, and refused again
        retried = {call for call in harness.kube.calls if call[0] == "create"}
        harness.kube.calls.clear()
        for name, uid in (("llm", "uid-1"), ("other", "uid-2")):  # gone with the namespace
            del harness.indexes["job_bodies"][("ml", name)]
            harness.controller.on_job("DELETED", job_body(name, uid))
        harness.kube.namespace_terminating = False  # gone, and made again
        harness.add_job(job_body("new", "uid-3"))
        harness.controller.on_job("ADDED", job_body("new", "uid-3"))
        await asyncio.sleep(0.1)  # at once, not when the mark would have ended
        created = harness.kube.names("Pod")
        await harness.controller.queue.stop()
        return refused, skipped, retried, created

    refused, skipped, retried, created = asyncio.run(go())
    assert refused == [("get", "AccelerateJob", "llm"), ("create", "Pod", "llm-0"),
                       ("create", "Pod", "llm-1")]  # no status patch, no event
    assert skipped == []
    assert {("create", "Pod", "other-0"), ("create", "Pod", "llm-0")} <= retried
    assert created == ["new-0", "new-1"]
    assert harness.controller._terminating == {}


def test_a_job_deleted_while_its_pass_runs_leaves_nothing_behind():
    class SlowKube(ListingKube):
        def __init__(self):
            super().__init__()
            self.release = asyncio.Event()

        async def create_if_absent(self, manifest):
            await self.release.wait()
            return await super().create_if_absent(manifest)

    harness = Harness(SlowKube())

    async def go():
        harness.controller.queue.start()
        body = job_body()
        harness.add_job(body)
        harness.controller.on_job("ADDED", body)
        await asyncio.sleep(0.05)  # the pass waits on its first create
        harness.indexes["job_bodies"].clear()
        harness.controller.on_job("DELETED", body)
        harness.kube.release.set()
        await harness.settle()
        await harness.controller.queue.stop()

    asyncio.run(go())
    assert harness.kube.names("ConfigMap") == ["llm-accelerate-config"]  # the pass did run on
    assert len(harness.controller.states) == 0 and len(harness.controller.queue) == 0


def test_a_pod_deleted_while_unwatched_is_found_by_the_audit_and_the_group_restarts():
    """kopf's gap: after a 410 re-list, a pod deleted meanwhile stays in its index. The job
    would wait for that pod forever; the audit's listing lacks it, the passes stop seeing it,
    and the job restarts its group as for any pod deleted."""
    harness = Harness()

    async def go():
        body = await harness.start_job()
        for name in ("llm-0", "llm-1"):
            harness.kube.set_pod_phase(name, "Running")
        harness.index_created()
        harness.controller.on_job("MODIFIED", body)
        await harness.settle()
        running = harness.controller.states.peek(("ml", "llm")).written
        assert running["phase"] == "Running"
        # The watch was down (410): pod llm-1 was deleted, kopf's index still shows it.
        del harness.kube.objects[("Pod", "llm-1")]
        harness.kube.calls.clear()
        harness.controller.on_job("MODIFIED", body)
        await harness.settle()
        stuck = [c for c in harness.kube.calls if c[0] in ("delete", "create")]
        ghosts = await harness.controller.audit()
        await harness.settle()
        await harness.controller.queue.stop()
        return stuck, ghosts

    stuck, ghosts = asyncio.run(go())
    assert stuck == [] and ghosts == 1  # without the audit nothing would ever happen
    written = harness.controller.states.peek(("ml", "llm")).written
    assert written["attempt"] == 1 and written["restarts"] == 1, written
    assert ("delete", "Pod", "llm-0") in harness.kube.calls


# ---- kopf: peering and the handlers ------------------------------------------------------------

def test_a_created_pods_first_events_run_no_pass_and_its_start_and_failure_do():
    """The pass that created the pods planned them as they first show (Pending): their ADDED
    events change nothing it decides, nor do the scheduler's rewrites of a Pending pod's
    condition (read only when a stall is declared). Its start and its failure do."""
    harness = Harness()

    async def go():
        await harness.start_job()
        harness.index_created()
        passes = []

        def event(status, event_type="MODIFIED"):
            manifest = copy.deepcopy(harness.kube.objects[("Pod", "llm-0")])
            manifest["status"] = status
            before = harness.controller.queue.passes
            harness.controller.on_pod(event_type, manifest)
            return before

        async def count(before):
            await harness.settle()
            passes.append(harness.controller.queue.passes - before)

        await count(event({"phase": "Pending", "qosClass": "Burstable"}, "ADDED"))
        for message in ("0/2 nodes are available: 2 Insufficient cpu.",
                        "0/3 nodes are available: 3 Insufficient cpu."):
            await count(event({"phase": "Pending", "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": message}]}))
        await count(event({"phase": "Running",
                           "conditions": [{"type": "Ready", "status": "True"}]}))
        await count(event({"phase": "Failed", "reason": "OOMKilled"}))
        await harness.controller.queue.stop()
        return passes

    assert asyncio.run(go()) == [0, 0, 0, 1, 1]


def test_the_echo_of_our_own_status_write_runs_no_pass_and_any_other_change_does():
    class VersionedKube(ListingKube):
        async def patch_job_status(self, namespace, name, status):
            await super().patch_job_status(namespace, name, status)
            return "42"

    harness = Harness(VersionedKube())

    async def go():
        body = await harness.start_job()
        assert harness.kube.statuses, "the first pass writes a status"
        passes = harness.controller.queue.passes
        echo = copy.deepcopy(body)
        echo["metadata"]["resourceVersion"] = "42"
        echo["status"] = copy.deepcopy(harness.kube.statuses[-1])
        harness.controller.on_job("MODIFIED", echo)
        await harness.settle()
        after_echo = harness.controller.queue.passes - passes
        edited = copy.deepcopy(echo)
        edited["metadata"]["resourceVersion"] = "43"
        edited["metadata"].setdefault("labels", {})["team"] = "research"
        harness.controller.on_job("MODIFIED", edited)
        await harness.settle()
        await harness.controller.queue.stop()
        return after_echo, harness.controller.queue.passes - passes - after_echo

    assert asyncio.run(go()) == (0, 1)


def test_kopfs_filters_let_through_exactly_the_events_that_can_change_a_pass():
    """handlers.py hands these predicates to kopf as `when` filters: what they drop, kopf does
    not invoke a handler for. They must drop nothing a handler would act on."""
    from accelerate_operator import handlers

    harness = Harness()
    controller = harness.controller

    async def go():
        await harness.start_job()
        pod = copy.deepcopy(harness.kube.objects[("Pod", "llm-0")])
        pod["status"] = {"phase": "Pending"}
        unschedulable = copy.deepcopy(pod)
        unschedulable["status"]["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
        running = copy.deepcopy(pod)
        running["status"] = {"phase": "Running"}
        deleting = copy.deepcopy(pod)
        deleting["metadata"]["deletionTimestamp"] = "2026-11-24T00:00:00Z"
        orphan = copy.deepcopy(pod)
        orphan["metadata"]["labels"][JOB_LABEL] = "another-job"
        pods = {("ADDED", "created"): controller.pod_event_matters("ADDED", pod),
                ("MODIFIED", "unschedulable"): controller.pod_event_matters(
                    "MODIFIED", unschedulable),
                ("MODIFIED", "running"): controller.pod_event_matters("MODIFIED", running),
                ("MODIFIED", "deleting"): controller.pod_event_matters("MODIFIED", deleting),
                ("DELETED", "created"): controller.pod_event_matters("DELETED", pod),
                (None, "created"): controller.pod_event_matters(None, pod),
                ("ADDED", "of a job not seen"): controller.pod_event_matters("ADDED", orphan)}
        children = {kind: controller.child_event_matters(kind)
                    for kind in ("ADDED", "MODIFIED", "DELETED", None)}
        controller._ghosts.add(("Service", "ml", "llm"))
        with_ghost = controller.child_event_matters("ADDED")
        await controller.queue.stop()
        return pods, children, with_ghost

    pods, children, with_ghost = asyncio.run(go())
    assert pods == {("ADDED", "created"): False, ("MODIFIED", "unschedulable"): False,
                    ("MODIFIED", "running"): True,
                    ("MODIFIED", "deleting"): True, ("DELETED", "created"): True,
                    (None, "created"): True, ("ADDED", "of a job not seen"): True}
    assert children == {"ADDED": False, "MODIFIED": False, "DELETED": True, None: True}
    assert with_ghost  # an event may clear a suspected ghost
    registered = {h.id: h.when for h in kopf_registry_watching_handlers()}
    assert registered["pod_events"] is handlers._pod_event_matters
    assert registered["job_events"] is handlers._job_event_matters
    assert {registered[name] for name in ("service_events", "configmap_events", "pdb_events")} \
        == {handlers._child_event_matters}


def kopf_registry_watching_handlers():
    import kopf

    return list(kopf.get_default_registry()._watching.get_all_handlers())


def test_memory_is_handed_back_while_jobs_go_and_for_a_minute_after_their_children_are_gone(
        monkeypatch):
    """A deletion frees memory for a while after the jobs' own states are gone (their pods'
    deletions, kopf's workers for them, idle connections closing): the trims go on for
    TRIMS_AFTER_SETTLING looks after the count stops falling, then stop until it falls again."""
    import accelerate_operator.controller as controller_module

    trims = []
    monkeypatch.setattr(controller_module, "release_freed_memory", lambda: trims.append(1))
    h = Harness()
    for n in range(3):
        h.indexes["job_pods"].put(("ml", f"job-{n}"), "pod-0")
        h.indexes["job_pods"].put(("ml", f"job-{n}"), "pod-1")
    h.controller._trim()  # jobs arrived: nothing to hand back
    assert trims == []
    del h.indexes["job_pods"][("ml", "job-0")]
    h.controller._trim()  # falling
    assert len(trims) == 1
    h.indexes["job_pods"].clear()
    h.controller._trim()  # still falling
    assert len(trims) == 2
    for _ in range(controller_module.TRIMS_AFTER_SETTLING):
        h.controller._trim()  # settled: the minute after
    assert len(trims) == 2 + controller_module.TRIMS_AFTER_SETTLING
    h.controller._trim()
    h.controller._trim()  # nothing changed since: no more
    assert len(trims) == 2 + controller_module.TRIMS_AFTER_SETTLING
    h.indexes["job_pods"].put(("ml", "job-3"), "pod-0")
    h.controller._trim()  # rising again: nothing to hand back
    assert len(trims) == 2 + controller_module.TRIMS_AFTER_SETTLING


def test_once_started_the_collector_skips_start_ups_objects_and_collects_young_ones_less_often():
    """heap.settle_garbage_collector, in a process of its own (its settings are the whole
    process's): start-up's objects frozen, the young threshold raised, once; a cycle made
    afterwards is still collected. The operator's own process asks for it (__main__); a test
    that runs kopf's start-up in pytest's process does not."""
    import os
    import subprocess
    import sys

    from accelerate_operator import handlers, heap

    script = (
        "import gc, json, weakref\n"
        "from accelerate_operator import heap\n"
        "before = gc.get_threshold()[0]\n"
        "heap.settle_garbage_collector()\n"
        "frozen = gc.get_freeze_count()\n"
        "class Node: pass\n"
        "a, b = Node(), Node(); a.other, b.other = b, a; gone = weakref.ref(a); del a, b\n"
        "heap.settle_garbage_collector()  # a second call changes nothing\n"
        "gc.collect()\n"
        "print(json.dumps([before, gc.get_threshold()[0], frozen, gc.get_freeze_count(),\n"
        "                  gone() is None]))\n")
    package_root = str(Path(heap.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env=env).stdout
    before, threshold, frozen, frozen_after, cycle_collected = json.loads(out)
    assert threshold == 10_000 > before
    assert frozen > 1_000 and frozen_after == frozen  # modules, classes, functions: once
    assert cycle_collected
    assert handlers.RUNTIME.settle_gc is False


def test_the_pause_tracker_follows_kopfs_peering_records():
    queue = WorkQueue(lambda key: None)
    tracker = PauseTracker(queue)
    logger = logging.getLogger(PauseTracker.LOGGER)
    logger.addHandler(tracker)
    logger.setLevel(logging.INFO)
    try:
        logger.info("Pausing operations in favour of [Peer(...)].")
        assert queue.paused
        logger.info("Resuming operations after the pause. Conflicting operators with the same "
                    "priority are gone.")
        assert not queue.paused
    finally:
        logger.removeHandler(tracker)


def test_the_installed_kopf_still_logs_what_the_pause_tracker_reads():
    import kopf._core.engines.peering as peering

    source = Path(peering.__file__).read_text()
    assert peering.logger.name == PauseTracker.LOGGER
    assert 'logger.info(f"Pausing operations' in source
    assert 'logger.warning(f"Pausing all operators' in source
    assert 'logger.info(f"Resuming operations' in source


def test_the_replica_started_first_has_the_highest_peering_priority():
    first = replica_priority(now_ns=1_700_000_000_000_000_000)
    later = replica_priority(now_ns=1_700_000_000_001_000_000)  # a millisecond later
    assert first > later


def test_every_handler_is_a_coroutine_and_none_makes_kopf_write_to_jobs():
    """A plain function would run in kopf's thread pool (a thread hop per event); a changing or
    deletion handler would make kopf keep a diff-base annotation or a finalizer on every job."""
    import accelerate_operator.handlers as handlers

    registry = kopf.get_default_registry()
    ours = [h for h in (registry._indexing.get_all_handlers()
                        + registry._watching.get_all_handlers()
                        + registry._activities.get_all_handlers())
            if h.fn.__module__ == handlers.__name__]
    assert {h.id for h in ours} >= {"job_bodies", "job_pods", "job_services", "job_configmaps",
                                    "job_events", "pod_events", "configure", "login", "jobs"}
    assert all(inspect.iscoroutinefunction(h.fn) for h in ours)
    assert not [h for h in registry._changing.get_all_handlers()
                if h.fn.__module__ == handlers.__name__]
    assert not [h for h in registry._spawning.get_all_handlers()
                if h.fn.__module__ == handlers.__name__]


def test_kopf_makes_no_copy_of_every_watched_body():
    """kopf's cause detection builds a diff-base essence per watch event whatever the handlers;
    with NoDiffBase (configure installs it) that is an empty dict, not a deep copy of the body."""
    import accelerate_operator.handlers as handlers
    from kopf._core.reactor import processing

    assert "diffbase_storage.build(" in inspect.getsource(processing._detect_causes)
    assert "settings.persistence.diffbase_storage = NoDiffBase()" in inspect.getsource(
        handlers.configure)
    body = kopf.Body(job_body())
    storage = handlers.NoDiffBase()
    assert storage.build(body=body) == {} and storage.fetch(body=body) is None


@pytest.mark.parametrize("status, retry_after, expected", [
    (429, "2", [2.0]), (503, None, [1.0]), (429, "120", [10.0])])
def test_throttled_requests_are_retried_after_the_servers_delay(monkeypatch, status, retry_after,
                                                              expected):
    from accelerate_operator.kube import _retry_delay

    assert [_retry_delay(retry_after, 0)] == expected


def test_kopfs_watch_restarts_are_counted_and_its_warnings_still_reach_the_log(caplog):
    import kopf._cogs.clients.watching as watching
    from accelerate_operator.controller import WatchRestartCounter
    from accelerate_operator.metrics import METRICS

    source = Path(watching.__file__).read_text()
    assert watching.logger.name == WatchRestartCounter.LOGGER
    assert 'logger.debug(f"Restarting the watch-stream for {resource} {where}.")' in source

    def count() -> float:
        return METRICS.registry.get_sample_value(
            "accelerate_operator_watch_restarts_total", {"kind": "pods"}) or 0.0

    logger = logging.getLogger(WatchRestartCounter.LOGGER)
    already = [h for h in logger.handlers if isinstance(h, WatchRestartCounter)]
    handler = WatchRestartCounter.install()
    assert WatchRestartCounter.install() is handler  # one per process: nothing counted twice
    try:
        before = count()
        logger.debug("Restarting the watch-stream for pods.v1 cluster-wide.")
        logger.debug("Starting the watch-stream for pods.v1 cluster-wide.")  # not a restart
        with caplog.at_level(logging.WARNING):
            logger.warning("a watch failed")
        assert count() == before + 1
        assert "a watch failed" in caplog.text
    finally:
        if not already:  # an operator run earlier in this process keeps its counter
            logger.removeHandler(handler)
        logger.propagate = True


def test_a_log_with_a_cut_multibyte_character_is_read_not_refused():
    """A pod log is the user's bytes: tqdm's bar (U+2588, three bytes) cut by the container
    runtime made aiohttp's strict decoding refuse every read of rank 0's log, so PROGRESS
    stopped in an e2e run while the job trained on. The read keeps the rest of the log."""
    from accelerate_operator.kube import Kube
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    body = ("100%|\u2588\u2588".encode() + b"\xe2\x96" + b"| 2997/3000\n"
            + b'ACCELERATE_PROGRESS {"step": 3000, "total_steps": 3000}\n')

    async def log(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain")

    async def go() -> str:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/ml/pods/llm-0/log", log)
        async with TestServer(app) as server:
            kube = Kube.from_connection(kopf.ConnectionInfo(server=str(server.make_url(""))))
            try:
                return await kube.read_pod_log("ml", "llm-0", 2000)
            finally:
                await kube.close()

    text = asyncio.run(go())
    assert text.endswith('ACCELERATE_PROGRESS {"step": 3000, "total_steps": 3000}\n')
    assert "\ufffd" in text  # the cut character, replaced
