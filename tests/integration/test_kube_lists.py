"""kube.py (the official client) against the real API server where its reading of the answer
decides what a pass does.
The listing of the index audit and the cache sync (Kube.list_owned): metadata only, in pages,
filtered by the label selector and the namespaces watched. The audit is what finds an object
deleted while kopf's watch was down (a 410 re-list forgets no deletion), so a wrong or empty list
here would hide ghosts; the sync holds a new active replica's passes until its indexes show it. A
create in a namespace being deleted: the refusal the controller stops that namespace's passes on
(NamespaceTerminating). Every other call kind a pass makes, once each, as the API server answers
it."""

from __future__ import annotations

import asyncio
import json

import pytest
from accelerate_operator.kube import METADATA_ONLY, Kube, NamespaceTerminating

from devtools.cluster import kubectl

pytestmark = pytest.mark.cluster

LABEL = "accelerate-operator.io/job-name"


def configmap(name: str, namespace: str, labels: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "data": {"accelerate.yaml": "x" * 2000}}


def test_the_audit_lists_names_from_metadata_only_pages(kubeconfig, namespace, monkeypatch):
    objects = [configmap(f"owned-{i}", namespace, {LABEL: "llm"}) for i in range(5)]
    objects.append(configmap("not-ours", namespace, {"app": "other"}))
    kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in objects),
            kubeconfig=kubeconfig)
    monkeypatch.setattr("accelerate_operator.kube.client.LIST_PAGE", 2)  # three pages
    path = f"/api/v1/namespaces/{namespace}/configmaps"

    async def scenario():
        kube = Kube()
        try:
            names = [item[:2] async for item in kube.list_owned("ConfigMap", [namespace])]
            page = await kube.request("GET", path, query={"labelSelector": LABEL},
                                      accept=METADATA_ONLY)
            return names, page
        finally:
            await kube.close()

    names, page = asyncio.run(scenario())
    assert sorted(names) == [(namespace, f"owned-{i}") for i in range(5)]
    assert page["kind"] == "PartialObjectMetadataList"
    assert all("data" not in item for item in page["items"])  # no body to decode


def test_a_create_in_a_namespace_being_deleted_is_told_apart(kubeconfig, namespace):
    """A ConfigMap with a finalizer holds the namespace in Terminating while the create is
    tried; the API server's 403 ("... because it is being terminated") is NamespaceTerminating,
    not a rejection of the manifest (which would fail the job)."""
    held = configmap("held", namespace, {"app": "test"})
    held["metadata"]["finalizers"] = ["accelerate-operator.io/test-hold"]
    kubectl("apply", "-f", "-", input=json.dumps(held), kubeconfig=kubeconfig)
    kubectl("delete", "namespace", namespace, "--wait=false", kubeconfig=kubeconfig)

    async def scenario():
        kube = Kube()
        try:
            with pytest.raises(NamespaceTerminating) as refused:
                await kube.create_if_absent(configmap("new", namespace, {LABEL: "llm"}))
            return refused.value
        finally:
            await kube.close()

    try:
        error = asyncio.run(scenario())
    finally:
        kubectl("-n", namespace, "patch", "configmap", "held", "--type=merge", "-p",
                '{"metadata":{"finalizers":null}}', kubeconfig=kubeconfig)
    assert error.namespace == namespace


def test_each_kind_of_call_is_answered_as_the_pass_expects(kubeconfig, namespace):
    """A pod no node can take: its status written by the pass's merge patch, its log read
    (nothing yet: the container has not started), the run-attempt told, the pod deleted; a
    node read, and one that is gone."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p-0", "namespace": namespace, "labels": {LABEL: "p"}},
           "spec": {"nodeSelector": {"accelerate-operator.io/no-such-node": "x"},
                    "containers": [{"name": "trainer", "image": "busybox"}]}}

    async def scenario():
        kube = Kube()
        try:
            assert await kube.create_if_absent(pod) is True
            assert await kube.create_if_absent(pod) is False
            log = await kube.read_pod_log(namespace, "p-0", 100, container="trainer",
                                          timestamps=True)
            await kube.tell_attempt(namespace, "p-0", 2)
            told = await kube.request("GET", f"/api/v1/namespaces/{namespace}/pods/p-0")
            node = await kube.read_node(told["spec"].get("nodeName") or "no-such-node")
            await kube.delete_pod(namespace, "p-0", grace_period_seconds=0)
            await kube.delete_pod(namespace, "p-0")  # gone: no error
            return log, told, node
        finally:
            await kube.close()

    log, told, node = asyncio.run(scenario())
    assert log == ""
    assert told["metadata"]["annotations"]["accelerate-operator.io/run-attempt"] == "2"
    assert node is None


def test_the_cache_sync_lists_versions_in_the_namespaces_watched(kubeconfig, namespace,
                                                                 monkeypatch):
    """Kube.list_owned, what the cache sync compares kopf's indexes with: the owned pods of
    the namespaces watched (their resourceVersion as the server has them), in pages; a pod
    without the label, or with an empty one, is not listed; a kind not served lists nothing."""
    def pod(name: str, labels: dict[str, str]) -> dict:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace, "labels": labels},
                "spec": {"nodeSelector": {"accelerate-operator.io/no-such-node": "x"},
                         "containers": [{"name": "trainer", "image": "busybox"}]}}

    pods = [pod(f"owned-{i}", {LABEL: "llm"}) for i in range(3)] + [
        pod("other", {"app": "x"}), pod("no-job", {LABEL: ""})]  # no index keeps either
    kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(p) for p in pods),
            kubeconfig=kubeconfig)
    shown = [line for line in kubectl(
        "-n", namespace, "get", "pods", "-l", LABEL, "-o",
        "jsonpath={range .items[*]}{.metadata.name}={.metadata.resourceVersion} {end}",
        kubeconfig=kubeconfig).stdout.split() if line.startswith("owned-")]
    monkeypatch.setattr("accelerate_operator.kube.client.LIST_PAGE", 2)  # two pages

    async def scenario():
        kube = Kube()
        kube.kueue_group = "not-served.accelerate-operator.io"
        try:
            listed = [item async for item in kube.list_owned("Pod", [namespace])]
            workloads = [item async for item in kube.list_owned("Workload", [namespace])]
            return listed, workloads
        finally:
            await kube.close()

    listed, workloads = asyncio.run(scenario())
    assert sorted(f"{name}={version}" for _, name, _, version in listed) == sorted(shown)
    assert {ns for ns, *_ in listed} == {namespace} and len(shown) == 3
    assert all(uid for _, _, uid, _ in listed)
    assert workloads == []
