"""The operator's Workload writes through the REAL API server, in both of Kueue's API versions.

Kueue cannot be had here (the Go module proxy refuses it), so the Workload CRDs are ours
(tests/helpers/kueue_crds.py), one per Kueue release line, each under a test group of its own
(never kueue.x-k8s.io: the cluster is shared) and deleted at the end:
- v0.14: v1beta1 only; v0.15 to v0.19: v1beta2 and v1beta1; v0.20: v1beta2 only.
For each: the version the operator discovers (`Kube.discover_kueue_version` on the server's
discovery document), the Workload it creates read back unchanged (no field pruned: v1beta2's
priorityClassRef, v1beta1's priorityClassName), the spec.active patch with its annotation, the
quota release (a merge patch on /status with the resourceVersion: admission gone, admission
checks kept, a stale one refused with 409 and nothing changed), and PodsReady applied under the
operator's own field manager, never Kueue's."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import kubernetes
import pytest
from accelerate_operator.api import parse_job
from accelerate_operator.kube import Kube
from accelerate_operator.kueue.writes import (
    build_active_patch,
    build_condition_apply,
    build_quota_release,
    build_workload,
)

from devtools.cluster import kubectl, kubectl_json, wait_for_crd
from tests.helpers.jobs import JobBuilder
from tests.helpers.kueue_crds import read_priority_class, workload_crd

pytestmark = pytest.mark.cluster

RELEASES = {"v0.14": ("v1beta1",), "v0.15-v0.19": ("v1beta2", "v1beta1"),
            "v0.20": ("v1beta2",)}
MERGE = "application/merge-patch+json"
NOW, LATER = "2026-01-01T12:00:00Z", "2026-01-01T12:05:00Z"


def condition(type_: str, status: str, reason: str, message: str = "") -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": NOW, "observedGeneration": 1}


class Workloads:
    """The test's own reads and Kueue's writes of one Workload, through the official client."""

    def __init__(self, kubeconfig: str, group: str, version: str, namespace: str, name: str):
        client = kubernetes.config.new_client_from_config(config_file=kubeconfig)
        self.api = kubernetes.client.CustomObjectsApi(client)
        self.where = (group, version, namespace, "workloads", name)

    def get(self) -> dict:
        return self.api.get_namespaced_custom_object(*self.where)

    def patch(self, body: dict) -> None:
        self.api.patch_namespaced_custom_object(*self.where, body, _content_type=MERGE)

    def patch_status(self, body: dict, field_manager: str) -> None:
        self.api.patch_namespaced_custom_object_status(*self.where, body,
                                                       field_manager=field_manager,
                                                       _content_type=MERGE)


@pytest.fixture
def kueue_group(kubeconfig: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A Workload CRD of the release's versions under a group of this run's own."""
    versions = RELEASES[request.param]
    group = f"kueue-{uuid.uuid4().hex[:8]}.accelerate-operator.test"
    crd = workload_crd(group, versions)
    kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd), kubeconfig=kubeconfig)
    try:
        wait_for_crd(kubeconfig, f"workloads.{group}")
        yield group
    finally:
        kubectl("delete", "crd", f"workloads.{group}", "--wait=false", kubeconfig=kubeconfig,
                check=False)


@pytest.mark.parametrize("kueue_group", list(RELEASES), indirect=True)
def test_workload_writes_are_accepted_in_the_served_version(kueue_group: str, namespace: str,
                                                            kubeconfig: str, request) -> None:
    release = request.node.callspec.params["kueue_group"]
    expected = RELEASES[release][0]

    async def scenario() -> None:
        kube = Kube()
        kube.kueue_group = kueue_group
        try:
            # Discovery can lag the CRD's Established by a moment.
            for _ in range(60):
                if await kube.discover_kueue_version():
                    break
                await asyncio.sleep(0.5)
            assert kube.kueue_version == expected

            body = JobBuilder("llm", namespace).nodes(2).procs(1).build()
            workload = build_workload(parse_job(body), "team-a", "high", 1000,
                                      kube.kueue_version)
            workload["apiVersion"] = f"{kueue_group}/{kube.kueue_version}"
            # The owner is a job that does not exist: the garbage collector would delete it.
            del workload["metadata"]["ownerReferences"]
            name = workload["metadata"]["name"]
            assert await kube.create_if_absent(workload)
            assert not await kube.create_if_absent(workload)  # idempotent
            api = Workloads(kubeconfig, kueue_group, kube.kueue_version, namespace, name)
            stored = api.get()
            assert stored["spec"] == workload["spec"]  # nothing pruned in this version
            assert read_priority_class(stored) == "high"

            await kube.patch_workload(namespace, name, build_active_patch(False))
            stored = api.get()
            assert stored["spec"]["active"] is False
            assert stored["metadata"]["annotations"] == {
                "accelerate-operator.io/requested-active": "false"}

            # Kueue's side: admitted with an admission check, then evicted.
            kueue = {"status": {
                "admission": {"clusterQueue": "cq", "podSetAssignments": [
                    {"name": "main", "count": 2, "flavors": {"cpu": "default"}}]},
                "admissionChecks": [{"name": "prov", "state": "Ready", "message": "",
                                     "lastTransitionTime": NOW}],
                "conditions": [condition("QuotaReserved", "True", "QuotaReserved"),
                               condition("Admitted", "True", "Admitted"),
                               condition("Evicted", "True", "Preempted", "preempted")]}}
            api.patch_status(kueue, field_manager="kueue-admission")
            evicted = api.get()

            # A release built from a read that is stale by now changes nothing (409).
            api.patch({"metadata": {"labels": {"touched": "yes"}}})
            await kube.patch_workload_status(namespace, name,
                                             build_quota_release(evicted, LATER))
            stored = api.get()
            assert stored["status"]["admission"]["clusterQueue"] == "cq"

            await kube.patch_workload_status(namespace, name,
                                             build_quota_release(stored, LATER))
            released = api.get()
            assert "admission" not in released["status"]
            assert released["status"]["admissionChecks"][0]["name"] == "prov"
            reasons = {c["type"]: (c["status"], c["reason"])
                       for c in released["status"]["conditions"]}
            assert reasons == {"QuotaReserved": ("False", "Pending"),
                               "Admitted": ("False", "NoReservation"),
                               "Evicted": ("True", "Preempted"),
                               "Requeued": ("True", "Preempted")}

            await kube.apply_workload_status(namespace, name, build_condition_apply(
                released, "PodsReady", False, "WaitForStart",
                "Not all pods are ready or succeeded", LATER), "accelerate-operator-PodsReady")
            stored = api.get()
            assert ("False", "WaitForStart") in {
                (c["status"], c["reason"]) for c in stored["status"]["conditions"]
                if c["type"] == "PodsReady"}
            managers = {(m["manager"], m.get("subresource", "")) for m in
                        stored["metadata"]["managedFields"]}
            # The release went in as the operator (a merge patch), PodsReady under the
            # operator's own manager; Kueue's manager holds only what "Kueue" wrote above.
            assert {("accelerate-operator", "status"),
                    ("accelerate-operator-PodsReady", "status")} <= managers
            kueue_owned = next(m["fieldsV1"] for m in stored["metadata"]["managedFields"]
                               if m["manager"] == "kueue-admission")
            assert "f:admission" not in kueue_owned["f:status"]  # released by the operator
        finally:
            await kube.close()

    asyncio.run(scenario())
    # The stored object is served in every version the CRD serves.
    for version in RELEASES[release]:
        listed = kubectl_json("get", f"workloads.{version}.{kueue_group}", "-n", namespace,
                              kubeconfig=kubeconfig)
        assert [w["metadata"]["name"] for w in listed["items"]] == [
            "acceleratejob-llm-uid-llm"]
