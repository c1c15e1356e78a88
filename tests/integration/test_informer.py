"""The informer against the real API server: a paged list, the watch's events, and a resume
from a version the server no longer has (410), after which the new list reports what changed
while nobody watched, deletions included."""

from __future__ import annotations

import asyncio

import pytest
from accelerate_operator import kube as kube_module
from accelerate_operator.informer import ADDED, DELETED, Collection, Informer, Store
from accelerate_operator.kube import Kube

from devtools.cluster import kubectl

LABEL = "informer-test"
COLLECTION = Collection("/api/v1", "configmaps", f"{LABEL}=yes")


def create(kubeconfig: str, namespace: str, *names: str) -> None:
    for name in names:
        kubectl("-n", namespace, "create", "configmap", name, kubeconfig=kubeconfig)
        kubectl("-n", namespace, "label", "configmap", name, f"{LABEL}=yes",
                kubeconfig=kubeconfig)


async def until(predicate, timeout: float = 30) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.05)
    await asyncio.wait_for(poll(), timeout)


def test_informer_lists_in_pages_follows_the_watch_and_lists_again_after_410(
        kubeconfig: str, namespace: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(kube_module, "LIST_PAGE", 2)  # five objects: three pages
    create(kubeconfig, namespace, "a", "b", "c", "d", "e")
    kubectl("-n", namespace, "create", "configmap", "unlabelled", kubeconfig=kubeconfig)
    events: list[tuple[str, str]] = []
    store = Store(lambda obj: obj["metadata"]["name"], lambda obj: "all")

    async def scenario() -> list[str]:
        kube = Kube.from_environment()
        informer = Informer(kube, COLLECTION, store,
                            lambda kind, group, value, obj: events.append((kind, value)),
                            namespace=namespace)
        try:
            await informer.sync(notify=False)
            listed = sorted(store.get("all"))
            watching = asyncio.create_task(informer.run())
            await asyncio.sleep(1)
            await asyncio.to_thread(create, kubeconfig, namespace, "f")
            await asyncio.to_thread(kubectl, "-n", namespace, "delete", "configmap", "a",
                                    kubeconfig=kubeconfig)
            await until(lambda: (DELETED, "a") in events)
            watching.cancel()
            # Nobody watches: b goes, g comes. Then resume from a version long compacted away.
            await asyncio.to_thread(kubectl, "-n", namespace, "delete", "configmap", "b",
                                    kubeconfig=kubeconfig)
            await asyncio.to_thread(create, kubeconfig, namespace, "g")
            events.clear()
            informer.resource_version = "1"
            watching = asyncio.create_task(informer.run())
            await until(lambda: {(DELETED, "b"), (ADDED, "g")} <= set(events))
            watching.cancel()
            return listed
        finally:
            await kube.close()

    listed = asyncio.run(scenario())
    assert listed == ["a", "b", "c", "d", "e"]
    assert sorted(store.get("all")) == ["c", "d", "e", "f", "g"]
    assert sorted(events) == [(ADDED, "g"), (DELETED, "b")]  # nothing else changed
