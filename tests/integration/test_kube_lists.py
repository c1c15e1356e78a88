"""kube.py (the official client) against the real API server where its reading of the answer
decides what a pass does.
The audit's listing (Kube.list_names): metadata only, in pages, filtered by the label selector.
The audit is what finds an object deleted while kopf's watch was down (a 410 re-list forgets no
deletion), so a wrong or empty list here would hide ghosts. A create in a namespace being
deleted: the refusal the controller stops that namespace's passes on (NamespaceTerminating)."""

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
    monkeypatch.setattr("accelerate_operator.kube.LIST_PAGE", 2)  # three pages
    path = f"/api/v1/namespaces/{namespace}/configmaps"

    async def scenario():
        kube = Kube()
        try:
            names = [item async for item in kube.list_names(path, LABEL)]
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
