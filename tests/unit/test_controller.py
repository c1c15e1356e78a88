"""The controller's stores and informers without a cluster: what each store keeps of an object,
how a re-list reports what changed while nobody watched (deletions included), how a watch
resumes and lists again after 410, and how events reach the job's pass. The same informers run
against the real API server in tests/integration/test_informer.py."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
from accelerate_operator.controller import (
    CONFIGMAPS,
    LAST_APPLIED,
    LEGACY_FINALIZER,
    Controller,
    lean_job,
)
from accelerate_operator.informer import ADDED, DELETED, MODIFIED, Collection, Informer, Store
from accelerate_operator.kube import Gone
from accelerate_operator.kueue import QueueContext

from tests.helpers.fake_kube import FakeKube
from tests.helpers.jobs import JobBuilder, pod

JOB_LABEL = "accelerate-operator.io/job-name"


def pod_body(job: str, index: int, owner: str, *, attempt: int = 0, phase: str = "Running",
             version: str = "1") -> dict[str, Any]:
    return {"metadata": {
        "name": f"{job}-{index}", "namespace": "ml", "resourceVersion": version,
        "labels": {JOB_LABEL: job, "accelerate-operator.io/node-index": str(index),
                   "accelerate-operator.io/attempt": str(attempt)},
        "ownerReferences": [{"kind": "AccelerateJob", "uid": owner}]},
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True"}]}}


def configmap(name: str, job: str | None, version: str = "1", value: str = "") -> dict[str, Any]:
    labels = {JOB_LABEL: job} if job else {}
    return {"metadata": {"name": name, "namespace": "ml", "labels": labels,
                         "resourceVersion": version}, "data": {"value": value}}


def name_and_value(obj) -> str:
    return obj["metadata"]["name"] + obj["data"]["value"]


def by_job(obj):
    job = obj["metadata"]["labels"].get(JOB_LABEL)
    return ("ml", job) if job else None


def test_store_groups_objects_by_job_and_moves_one_whose_label_changes():
    store = Store(lambda obj: obj["metadata"]["name"], by_job)
    assert store.put(configmap("a", "train")) == (("ml", "train"), "a", None)
    store.put(configmap("b", "train"))
    assert sorted(store.get(("ml", "train"))) == ["a", "b"]
    assert store.put(configmap("b", "other", "2")) == (("ml", "other"), "b", ("ml", "train"))
    assert store.get(("ml", "train")) == ["a"] and store.version(("ml", "b")) == "2"
    assert store.put(configmap("a", None, "3")) == (None, None, ("ml", "train"))
    assert store.get(("ml", "train")) == [] and len(store) == 1
    assert store.remove(("ml", "b")) == (("ml", "other"), "b")
    assert len(store) == 0 and list(store.groups()) == []


def test_a_job_is_kept_without_managed_fields_or_kubectls_copy_of_itself():
    body = JobBuilder("llm").build()
    body["metadata"].update(managedFields=[{"manager": "kubectl"}], resourceVersion="7",
                            annotations={LAST_APPLIED: "{...}", "team": "nlp"})
    body["status"] = {"phase": "Running"}
    lean = lean_job(body)
    assert lean == {"metadata": {k: v for k, v in body["metadata"].items()
                                 if k != "managedFields"} | {"annotations": {"team": "nlp"}},
                    "spec": body["spec"], "status": {"phase": "Running"}}
    assert body["metadata"]["annotations"][LAST_APPLIED] == "{...}"  # the input is not changed


class StreamKube:
    """Plays the API server's list and watch for one collection: `lists` are the answers to
    successive lists (each a list of pages), `watches` those to successive watches (a list of
    events, or Gone)."""

    def __init__(self, lists: list[list[list[dict]]], watches: list[Any]):
        self.lists, self.watches = lists, watches
        self.watched_from: list[str] = []

    async def list_pages(self, path: str, label_selector: str | None = None
                         ) -> AsyncIterator[tuple[list[dict], str | None]]:
        pages = self.lists.pop(0)
        for number, items in enumerate(pages):
            last = number == len(pages) - 1
            yield items, (str(100 + len(self.lists)) if last else None)

    async def watch(self, path: str, resource_version: str, label_selector: str | None = None
                    ) -> AsyncIterator[tuple[str, dict]]:
        self.watched_from.append(resource_version)
        if not self.watches:
            await asyncio.Event().wait()  # the watch stays open: the test cancels it
        answer = self.watches.pop(0)
        if answer is Gone:
            raise Gone("too old")
        for event in answer:
            yield event


def run_informer(kube: StreamKube, events: list, until: int) -> Store:
    store = Store(name_and_value, by_job)
    informer = Informer(kube, CONFIGMAPS, store,
                        lambda kind, group, value, obj: events.append((kind, group, value)),
                        namespace="ml")

    async def go():
        await informer.sync(notify=False)
        task = asyncio.create_task(informer.run())
        while len(events) < until:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(go(), 10))
    return store


def test_informer_follows_the_watch_and_lists_again_when_its_version_expired():
    """The first list only fills the store; the watch reports changes (not one that leaves what
    the store keeps as it was: e's); after 410 the new list reports what changed meanwhile: b
    deleted, c created, a changed (d and e unchanged: no event)."""
    a, b, e = configmap("a", "train"), configmap("b", "train"), configmap("e", "train")
    d, c = configmap("d", "train"), configmap("c", "train", "5")
    d2, e2 = configmap("d", "train", "2", value="2"), configmap("e", "train", "3")
    a2 = configmap("a", "train", "6", value="2")
    kube = StreamKube(lists=[[[a, b], [d, e]], [[a2, c], [d2, e2]]],
                      watches=[[("BOOKMARK", {"metadata": {"resourceVersion": "150"}}),
                                ("MODIFIED", e2), ("MODIFIED", d2)], Gone])
    events: list = []
    store = run_informer(kube, events, until=4)
    assert events == [(MODIFIED, ("ml", "train"), "d2"), (MODIFIED, ("ml", "train"), "a2"),
                      (ADDED, ("ml", "train"), "c"), (DELETED, ("ml", "train"), "b")]
    assert sorted(store.get(("ml", "train"))) == ["a2", "c", "d2", "e"]
    # Watched from the first list's version, resumed from the last event's (the bookmark's was
    # newer then), and after 410 from the second list's.
    assert kube.watched_from == ["101", "2", "100"]


def test_informer_reports_a_deletion_and_a_job_label_removed_as_deletions():
    kube = StreamKube(lists=[[[configmap("a", "train"), configmap("b", "train")]]],
                      watches=[[("DELETED", configmap("a", "train")),
                                ("MODIFIED", configmap("b", None, "2")),
                                ("ADDED", configmap("x", None))]])
    events: list = []
    store = run_informer(kube, events, until=2)
    assert events == [(DELETED, ("ml", "train"), "a"), (DELETED, ("ml", "train"), None)]
    assert len(store) == 0


def test_a_collection_not_served_is_no_error_when_optional():
    """Kueue's Workloads on a cluster without Kueue: the start-up listing goes on without them."""
    class NotServed(StreamKube):
        async def list_pages(self, path, label_selector=None):
            from accelerate_operator.kube import ApiError
            raise ApiError(404, "Not Found", "")
            yield  # an async generator

    informer = Informer(NotServed([], []), Collection("/apis/kueue.x-k8s.io/v1beta1",
                                                      "workloads"), Store(dict, by_job),
                        required=False)
    asyncio.run(asyncio.wait_for(informer.sync(), 5))
    assert informer.resource_version is None


# ---- the controller ------------------------------------------------------------------------
def test_pods_left_by_an_earlier_job_of_the_same_name_are_stale_not_failures():
    controller = Controller(FakeKube())
    controller.pods.put(pod_body("train", 1, "uid-new"))
    controller.pods.put(pod_body("train", 0, "uid-old", attempt=3))
    mine, earlier = sorted(controller.pods_of("ml", "train", "uid-new"), key=lambda p: p.name,
                           reverse=True)
    assert mine == pod("train", 1)
    assert (earlier.name, earlier.attempt, earlier.deleting) == ("train-0", -1, True)


def job_body(name: str = "llm", uid: str = "uid-1", **metadata: Any) -> dict[str, Any]:
    body = JobBuilder(name).nodes(2).build()
    body["metadata"].update(namespace="ml", uid=uid, resourceVersion="1", **metadata)
    return body


async def settle(controller: Controller) -> None:
    while controller._tasks:
        await asyncio.gather(*list(controller._tasks))


async def job_with_children(kube: FakeKube, controller: Controller) -> None:
    """A job's first pass, then its children as the watches bring them (no events: the
    stores are only filled)."""
    group, body, _ = controller.jobs.put(job_body())
    controller.on_job(ADDED, group, body, None)
    await settle(controller)
    for (kind, _), manifest in kube.objects.items():
        {"Pod": controller.pods, "ConfigMap": controller.configmaps,
         "Service": controller.services}[kind].put(manifest)
    kube.calls.clear()


def test_a_job_event_runs_its_pass_and_a_deleted_child_runs_it_again():
    kube = FakeKube()
    controller = Controller(kube)

    async def go():
        group, body, _ = controller.jobs.put(job_body())
        controller.on_job(ADDED, group, body, None)
        await settle(controller)
        assert kube.names("Pod") == ["llm-0", "llm-1"]
        assert kube.names("ConfigMap") == ["llm-accelerate-config"]
        for (kind, _), manifest in kube.objects.items():  # the watches bring what was created
            store = {"Pod": controller.pods, "ConfigMap": controller.configmaps,
                     "Service": controller.services}[kind]
            group, value, _ = store.put(manifest)
            (controller.on_pod if kind == "Pod" else controller.on_child)(
                ADDED, group, value, manifest)
        await settle(controller)
        kube.calls.clear()
        # The rendered ConfigMap deleted by hand: the job's pass creates it again.
        del kube.objects[("ConfigMap", "llm-accelerate-config")]
        group, value = controller.configmaps.remove(("ml", "llm-accelerate-config"))
        controller.on_child(DELETED, group, value, None)
        await settle(controller)
        return [c for c in kube.calls if c[0] == "create"]

    assert asyncio.run(go()) == [("create", "ConfigMap", "llm-accelerate-config")]


def test_a_deleted_job_is_forgotten_and_the_legacy_finalizer_removed():
    class FinalizerKube(FakeKube):
        async def remove_finalizer(self, body, finalizer):
            self.calls.append(("unfinalize", body["metadata"]["name"], finalizer))

    kube = FinalizerKube()
    controller = Controller(kube)

    async def go():
        deleting = job_body(deletionTimestamp="2026-01-01T00:00:00Z",
                            finalizers=[LEGACY_FINALIZER, "other/keep"])
        group, body, _ = controller.jobs.put(deleting)
        controller.on_job(MODIFIED, group, body, None)
        await settle(controller)
        assert controller.clock._jobs  # followed until it is gone
        group, value = controller.jobs.remove(("ml", "llm"))
        controller.on_job(DELETED, group, value, None)
        return kube.calls

    calls = asyncio.run(go())
    assert ("unfinalize", "llm", LEGACY_FINALIZER) in calls
    assert not [c for c in calls if c[0] == "create"]  # a job being deleted gets no children
    assert controller.clock._jobs == {} and controller._uids == {}


def test_a_job_created_again_under_its_name_while_unwatched_forgets_the_old_one():
    controller = Controller(FakeKube())

    async def go():
        for uid in ("uid-old", "uid-new"):
            group, body, _ = controller.jobs.put(job_body(uid=uid))
            controller.on_job(MODIFIED, group, body, None)
            await settle(controller)

    asyncio.run(go())
    assert list(controller.clock._jobs) == ["uid-new"]
    assert controller._uids == {("ml", "llm"): "uid-new"}


@pytest.mark.parametrize("kueue", [False, True])
def test_the_controller_follows_workloads_only_with_kueue(kueue: bool):
    controller = Controller(FakeKube(), namespaces=["a", "b"], kueue=kueue)
    followed = sorted((i.collection.plural, i.namespace, i.required)
                      for i in controller.owned_informers + controller.job_informers)
    expected = [(plural, ns, plural != "workloads")
                for plural in ("acceleratejobs", "configmaps", "pods", "services")
                + (("workloads",) if kueue else ()) for ns in ("a", "b")]
    assert followed == sorted(expected)
    assert controller.queue_of("a", "x", "u") == (QueueContext(workload=None) if kueue
                                                   else None)


def test_children_deleted_with_their_job_are_not_recreated(monkeypatch):
    """The garbage collector's deletions of a deleted job's children can arrive before the job's
    own DELETED event: within the grace the job is gone, and no pass recreates anything."""
    monkeypatch.setattr("accelerate_operator.controller.DELETION_GRACE_SECONDS", 0.2)
    kube = FakeKube()
    controller = Controller(kube)

    async def go():
        await job_with_children(kube, controller)
        for key, store in ((("ml", "llm-accelerate-config"), controller.configmaps),
                           (("ml", "llm"), controller.services),
                           (("ml", "llm-0"), controller.pods)):
            group, value = store.remove(key)
            (controller.on_pod if store is controller.pods else controller.on_child)(
                DELETED, group, value, None)
        group, value = controller.jobs.remove(("ml", "llm"))
        controller.on_job(DELETED, group, value, None)
        await settle(controller)

    asyncio.run(go())
    assert kube.calls == []
    memory = controller.reconciler.memory
    assert memory._locks == {} and memory.in_flight._created == {} and memory.written._written == {}


def test_a_job_forgotten_while_its_pass_runs_leaves_nothing_behind():
    class SlowKube(FakeKube):
        def __init__(self):
            super().__init__()
            self.release = asyncio.Event()

        async def create_if_absent(self, manifest):
            await self.release.wait()
            return await super().create_if_absent(manifest)

    kube = SlowKube()
    controller = Controller(kube)

    async def go():
        group, body, _ = controller.jobs.put(job_body())
        controller.on_job(ADDED, group, body, None)
        await asyncio.sleep(0.05)  # the pass waits on its first create
        group, value = controller.jobs.remove(("ml", "llm"))
        controller.on_job(DELETED, group, value, None)
        kube.release.set()
        await settle(controller)

    asyncio.run(go())
    assert kube.names("ConfigMap") == ["llm-accelerate-config"]  # the pass did run on
    memory = controller.reconciler.memory
    assert memory._locks == {} and memory.in_flight._created == {} and memory.written._written == {}
    assert controller.reconciler._waiting == {}


def test_a_deleted_jobs_children_are_not_recreated_when_its_own_event_lags(monkeypatch):
    """Under load the job's DELETED event may come after the grace: the API server is asked,
    says the job is gone, and no pass runs."""
    monkeypatch.setattr("accelerate_operator.controller.DELETION_GRACE_SECONDS", 0.1)
    kube = FakeKube()
    controller = Controller(kube)

    async def go():
        await job_with_children(kube, controller)
        kube.jobs_gone.add("llm")
        # llm-0 is being deleted (graceful: a MODIFIED event with its deletionTimestamp first)
        deleting = copy.deepcopy(kube.objects[("Pod", "llm-0")])
        deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        group, value, _ = controller.pods.put(deleting)
        controller.on_pod(MODIFIED, group, value, deleting)
        for key, store in ((("ml", "llm-1"), controller.pods),
                           (("ml", "llm"), controller.services)):
            group, value = store.remove(key)
            controller.on_pod(DELETED, group, value, None)
        await settle(controller)

    asyncio.run(go())
    assert kube.calls == [("get", "AccelerateJob", "llm")]  # one check for the three events


def test_a_start_up_list_whose_continue_token_expired_is_listed_again(monkeypatch):
    monkeypatch.setattr("accelerate_operator.informer.BACKOFF_SECONDS", (0,))

    class ExpiringKube(StreamKube):
        async def list_pages(self, path, label_selector=None):
            if len(self.lists) == 2:  # the first list: its second page's token has expired
                self.lists.pop(0)
                yield [configmap("a", "train")], None
                raise Gone("the continue token expired")
            async for page in super().list_pages(path, label_selector):
                yield page

    kube = ExpiringKube(lists=[[], [[configmap("a", "train")], [configmap("b", "train")]]],
                        watches=[])
    store = Store(name_and_value, by_job)
    asyncio.run(Informer(kube, CONFIGMAPS, store, namespace="ml").sync(notify=False))
    assert sorted(store.get(("ml", "train"))) == ["a", "b"]
