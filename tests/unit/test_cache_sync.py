"""The cache sync after a takeover (cache_sync.py, Controller.set_active) on a real event loop:
a replica that becomes the active one runs no pass until kopf's indexes show what the API server
lists, at the listed resourceVersion; what lags is listed again (an object deleted meanwhile stops
counting); a sync that cannot finish lets the passes run after its timeout; a pause cancels it;
and the caches of the last active spell (the jobs' states, the pods' reports) are dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import pytest
from accelerate_operator import cache_sync
from accelerate_operator.cache_sync import CacheSync, indexed_versions, lagging
from accelerate_operator.controller import Controller
from accelerate_operator.pod_state import PodState, read_pod_state

from tests.helpers.fake_kube import FakeKube

KEY = ("ml", "train")


def uid_of(name: str) -> str:
    return "job-uid" if name == "train" else f"uid-{name.rsplit('-', 1)[-1]}"


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(cache_sync, "CHECK_SECONDS", 0.01)
    monkeypatch.setattr(cache_sync, "RELIST_SECONDS", 0.1)
    monkeypatch.setattr(cache_sync, "TIMEOUT_SECONDS", 1.0)


def job(version: str = "7", uid: str = "job-uid", name: str = "train") -> dict:
    return {"metadata": {"name": name, "namespace": "ml", "uid": uid,
                         "resourceVersion": version},
            "spec": {"numNodes": 2}, "status": {"phase": "Running"}}


def pod(index: int, version: str = "1", uid: str | None = None) -> tuple[str, PodState]:
    return "job-uid", read_pod_state({"metadata": {
        "name": f"train-{index}", "namespace": "ml", "uid": uid or f"uid-{index}",
        "resourceVersion": version, "labels": {"accelerate-operator.io/node-index": str(index),
                                               "accelerate-operator.io/attempt": "1"}},
        "status": {"phase": "Running"}})


class Server:
    """The API server's lists, by kind: (namespace, name) -> resourceVersion; counts lists and
    can fail the next ones."""

    def __init__(self, **kinds: dict[tuple[str, str], str]) -> None:
        self.kinds, self.lists, self.failures = kinds, 0, 0

    async def list_owned(self, kind: str):
        self.lists += 1
        if self.failures:
            self.failures -= 1
            raise ConnectionError("the API server did not answer")
        for (namespace, name), version in list(self.kinds.get(kind, {}).items()):
            yield namespace, name, uid_of(name), version


def indexes(pods: Iterable[tuple[str, PodState]], body: Mapping[str, Any] | None = None
            ) -> dict[str, dict]:
    return {"job_bodies": {KEY: [body or job()]}, "job_pods": {KEY: list(pods)},
            "job_placeholders": {}}


def test_lagging_names_what_the_indexes_lack_or_hold_at_another_version():
    listed = {("Pod", "ml", "train-0", "uid-0"): "5", ("Pod", "ml", "train-1", "uid-1"): "6",
              ("AccelerateJob", "ml", "train", "job-uid"): "9"}
    shown = indexed_versions(indexes([pod(0, "5"), pod(9, "2")], job("8")),
                             ["AccelerateJob", "Pod"])
    assert lagging(listed, shown) == [("AccelerateJob", "ml", "train", "job-uid"),
                                      ("Pod", "ml", "train-1", "uid-1")]
    assert lagging({}, shown) == []  # indexed and not listed: the index audit's business


def test_a_ghost_under_a_reused_name_does_not_stand_for_the_live_pod():
    """kopf keys its entries by uid: the ghost of a pod deleted while unwatched (a newer
    version, its deletion) sits beside nothing for the pod made again under its name."""
    listed = {("Pod", "ml", "train-0", "uid-new"): "30"}
    ghost = indexed_versions(indexes([pod(0, "40", uid="uid-old")]), ["Pod"])
    assert lagging(listed, ghost) == [("Pod", "ml", "train-0", "uid-new")]
    both = indexed_versions(indexes([pod(0, "40", uid="uid-old"), pod(0, "30", uid="uid-new")]),
                            ["Pod"])
    assert lagging(listed, both) == []


def test_the_sync_waits_for_the_indexes_and_lists_again_what_went_meanwhile():
    server = Server(AccelerateJob={("ml", "train"): "7"},
                    Pod={("ml", "train-0"): "1", ("ml", "train-1"): "1", ("ml", "gone-0"): "1"})
    shown = indexes([pod(0)])

    async def scenario():
        waiting = asyncio.create_task(CacheSync(server.list_owned).wait(shown))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # train-1 is missing from the index
        shown["job_pods"][KEY].append(pod(1))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # gone-0, listed, never indexed
        del server.kinds["Pod"][("ml", "gone-0")]  # deleted: the next list lacks it
        return await asyncio.wait_for(waiting, 1)

    assert asyncio.run(scenario()) is True
    assert server.lists >= 4  # two kinds, listed at least twice


def test_a_sync_that_cannot_finish_lets_the_passes_run_after_its_timeout():
    server = Server(Pod={("ml", "train-0"): "2"})  # the index keeps version 1
    server.failures = 1  # and the first list fails

    async def scenario():
        loop = asyncio.get_running_loop()
        started = loop.time()
        synced = await CacheSync(server.list_owned).wait(indexes([pod(0)]))
        return synced, loop.time() - started

    synced, took = asyncio.run(scenario())
    assert synced is False and 1.0 <= took < 1.5
    assert server.lists >= 3  # the failed list was tried again


class Recorder:
    """A Reconciler that records the pods each pass was given."""

    def __init__(self) -> None:
        self.passes: list[list[tuple[str, str]]] = []
        self.jobs: list[str] = []

    async def reconcile(self, state, body, pods, *_: Any, **__: Any) -> None:
        self.jobs.append(body["metadata"]["uid"])
        self.passes.append(sorted((p.name, p.uid) for p in pods))


def takeover(shown: dict, server: Server) -> tuple[Controller, Recorder]:
    recorder = Recorder()
    controller = Controller(FakeKube(), recorder)
    controller.sync = CacheSync(server.list_owned)
    controller.audit.list_owned = server.list_owned
    controller.indexes = controller.audit.indexes = shown
    controller.set_active(False)
    return controller, recorder


def test_a_replica_taking_over_passes_only_once_its_index_shows_every_pod():
    """The standby's index lacks pod 1, made while it was paused: a pass now would count it
    deleted and restart the group. And it still shows the pod 0 deleted meanwhile (its ghost,
    beside the pod made again under its name): a pass would take it for an earlier attempt's
    and delete pod 0 by name. The pass waits for pod 1, and sees no ghost; the last spell's
    report is dropped."""
    server = Server(AccelerateJob={("ml", "train"): "7"},
                    Pod={("ml", "train-0"): "1", ("ml", "train-1"): "1"})
    shown = indexes([pod(0, uid="uid-old"), pod(0)])

    async def scenario():
        controller, recorder = takeover(shown, server)
        controller.queue.start()
        controller.reports.take_report(KEY, "uid-0", {"attempt": 1, "progress": {"step": 80}},
                                       datetime(2026, 1, 1))
        controller.queue.add(KEY)  # an event from before the takeover
        controller.set_active(True)
        assert not controller.paused  # it takes the pods' reports already
        await asyncio.sleep(0.1)
        no_pass_yet = list(recorder.passes)
        shown["job_pods"][KEY].append(pod(1))
        for _ in range(100):
            if recorder.passes:
                break
            await asyncio.sleep(0.01)
        report = controller.reports.text("uid-0")
        await controller.queue.stop()
        return no_pass_yet, recorder.passes, report

    no_pass_yet, passes, report = asyncio.run(scenario())
    assert no_pass_yet == []
    assert passes[0] == [("train-0", "uid-0"), ("train-1", "uid-1")]
    assert report is None  # a report of the last active spell is not trusted


def test_a_pause_during_the_sync_keeps_the_passes_paused():
    server = Server(AccelerateJob={("ml", "train"): "7"}, Pod={("ml", "train-0"): "1"})
    shown = indexes([], job("6"))  # the job's index entry is older than the server's

    async def scenario():
        controller, recorder = takeover(shown, server)
        controller.queue.start()
        controller.set_active(True)
        await asyncio.sleep(0.05)
        controller.set_active(False)
        shown["job_bodies"][KEY] = [job("7")]
        shown["job_pods"][KEY] = [pod(0)]
        await asyncio.sleep(0.2)
        await controller.queue.stop()
        return recorder.passes, controller.queue.paused, controller.paused

    assert asyncio.run(scenario()) == ([], True, True)


def test_an_index_past_the_listed_version_has_caught_up():
    """An object that changed after the list (a pod starting) need not wait for another list;
    a version that is no integer is compared only for equality."""
    zero, one = ("Pod", "ml", "train-0", "uid-0"), ("Pod", "ml", "train-1", "uid-1")
    listed = {zero: "19", one: "a1"}
    assert lagging(listed, {zero: "20", one: "a1"}) == []
    assert lagging(listed, {zero: "9", one: "a2"}) == [zero, one]


def test_a_job_deleted_while_paused_gets_no_pass_and_its_namesake_is_the_job_seen():
    """Jobs deleted while this replica did not watch: one gone for good, one made again under
    its name (kopf shows both uids). After the takeover no pass runs for the first, and the
    second's pass reads the new job, not the ghost."""
    server = Server(AccelerateJob={("ml", "train"): "7"},
                    Pod={("ml", "train-0"): "1", ("ml", "train-1"): "1"})
    shown = indexes([pod(0), pod(1)])
    shown["job_bodies"][KEY] = [job("3", uid="old-uid"), job()]
    shown["job_bodies"][("ml", "gone")] = [job("2", uid="gone-uid", name="gone")]

    async def scenario():
        controller, recorder = takeover(shown, server)
        controller.queue.start()
        controller.set_active(True)
        for _ in range(100):
            if recorder.jobs and not len(controller.queue):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        await controller.queue.stop()
        return recorder.jobs, controller.job_bodies()

    jobs, bodies = asyncio.run(scenario())
    assert jobs == ["job-uid"]
    assert [body["metadata"]["uid"] for body in bodies] == ["job-uid"]
