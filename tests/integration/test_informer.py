"""The informer against the real API server: a paged list, the watch's events, a resume from
the last version seen (the server replays the gap), and a list again (what a 410 leads to:
tests/unit/test_controller.py plays the 410 itself, which this API server's watch cache does
not give on demand), after which the new list reports what changed while nobody watched,
deletions included."""

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


def test_informer_lists_in_pages_follows_the_watch_resumes_and_lists_again(
        kubeconfig: str, namespace: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(kube_module, "LIST_PAGE", 2)  # five objects: three pages
    create(kubeconfig, namespace, "a", "b", "c", "d", "e")
    kubectl("-n", namespace, "create", "configmap", "unlabelled", kubeconfig=kubeconfig)
    events: list[tuple[str, str]] = []
    store = Store(lambda obj: obj["metadata"]["name"], lambda obj: "all")
    lists = []

    def changes(*commands: tuple[str, ...]) -> None:
        for command in commands:
            if command[0] == "create":
                create(kubeconfig, namespace, command[1])
            else:
                kubectl("-n", namespace, "delete", "configmap", command[1],
                        kubeconfig=kubeconfig)

    async def scenario() -> dict[str, list]:
        kube = Kube.from_environment()
        pages = kube.list_pages

        def counted(*args, **kwargs):
            lists.append(args)
            return pages(*args, **kwargs)
        kube.list_pages = counted
        informer = Informer(kube, COLLECTION, store,
                            lambda kind, group, value, obj: events.append((kind, value)),
                            namespace=namespace)
        seen = {}

        async def watch_until(expected: set) -> list:
            events.clear()
            watching = asyncio.create_task(informer.run())
            await until(lambda: expected <= set(events))
            await asyncio.sleep(1)  # nothing more comes
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            return sorted(events)
        try:
            await informer.sync(notify=False)
            seen["listed"] = sorted(store.get("all"))
            seen["pages"] = len(lists)
            # Followed: f created, a deleted.
            watching = asyncio.create_task(informer.run())
            await asyncio.sleep(1)
            await asyncio.to_thread(changes, ("create", "f"), ("delete", "a"))
            await until(lambda: (DELETED, "a") in events)
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            seen["watched"] = sorted(events)
            # Unwatched, then resumed from the last version seen: the watch replays the gap.
            await asyncio.to_thread(changes, ("delete", "b"), ("create", "g"))
            seen["resumed"] = await watch_until({(DELETED, "b"), (ADDED, "g")})
            # Unwatched, and listed again (as after a 410: the version was too old), the list
            # reports what changed meanwhile, and the watch goes on from the list's version.
            await asyncio.to_thread(changes, ("delete", "c"), ("create", "h"))
            lists.clear()
            informer.resource_version = None
            seen["relisted"] = await watch_until({(DELETED, "c"), (ADDED, "h")})
            seen["lists"] = len(lists)
            return seen
        finally:
            await kube.close()

    seen = asyncio.run(scenario())
    assert seen["listed"] == ["a", "b", "c", "d", "e"] and seen["pages"] == 1  # one paged list
    assert seen["watched"] == [(ADDED, "f"), (DELETED, "a")]
    assert seen["resumed"] == [(ADDED, "g"), (DELETED, "b")]
    assert seen["relisted"] == [(ADDED, "h"), (DELETED, "c")] and seen["lists"] == 1
    assert sorted(store.get("all")) == ["d", "e", "f", "g", "h"]
