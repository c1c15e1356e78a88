"""A fake of kube.py's Kube for the reconcile steps: objects in dicts, every call recorded, no
cluster; async, as Kube is. `pods()` and `children()` play the informers' stores (what the
controller hands to a pass)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from accelerate_operator.indexes import is_placeholder
from accelerate_operator.kube import ConfigMapMissing, NamespaceTerminating, Rejected
from accelerate_operator.pod_state import PodState, read_pod_state
from accelerate_operator.resources.configmap import ConfigSource

# Kueue's own field manager for the admission, and the conditions it sets: how a test stands in
# for Kueue's scheduler (the operator never writes under it).
ADMISSION_MANAGER = "kueue-admission"
ADMISSION_CONDITIONS = ("QuotaReserved", "BlockedOnPreemptionGates", "Evicted", "Admitted",
                        "Preempted", "Requeued", "DeactivationTarget", "Finished", "PodsReady")


class FakeKube:
    def __init__(self, configmaps: Mapping[str, Mapping[str, str]] | None = None):
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.user_configmaps = dict(configmaps or {})
        self.logs: dict[str, str] = {}
        self.calls: list[tuple] = []
        self.statuses: list[dict[str, Any]] = []
        self.events: list[Any] = []
        self.refuse_pods: str | None = None
        self.refuse: dict[str, str] = {}  # kind -> the server's message, for any other child
        self.namespace_terminating = False  # creates refused: "... it is being terminated"
        self.job_deleted = False
        self.jobs_gone: set[str] = set()  # deleted by someone else: job_exists says no
        # Cluster-scoped Kueue objects by (plural, name): ResourceFlavors, priority classes.
        self.kueue_objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}  # Node manifests by name (read_node)
        self.pod_events: dict[str, list[dict[str, Any]]] = {}  # Warning events by pod uid

    # ---- Kube's interface ----------------------------------------------------------------
    async def create_if_absent(self, manifest: Mapping[str, Any]) -> bool:
        key = (manifest["kind"], manifest["metadata"]["name"])
        self.calls.append(("create", *key))
        if self.namespace_terminating:
            raise NamespaceTerminating(manifest["metadata"]["namespace"])
        if manifest["kind"] == "Pod" and self.refuse_pods:
            raise Rejected("Pod", f"the API server refused Pod {key[1]}: {self.refuse_pods}")
        if manifest["kind"] in self.refuse:
            raise Rejected(key[0], f"the API server refused {key[0]} {key[1]}: "
                           f"{self.refuse[key[0]]}")
        if key in self.objects:
            return False
        self.objects[key] = copy.deepcopy(dict(manifest))
        if manifest["kind"] == "Workload":  # as the server does; the release's precondition
            self._bump(self.objects[key])
        return True

    async def delete_pod(self, namespace: str, name: str,
                         grace_period_seconds: int | None = None) -> None:
        self.calls.append(("delete" if grace_period_seconds is None else "force-delete", "Pod",
                           name))
        self.objects.pop(("Pod", name), None)

    async def list_pod_warnings(self, namespace: str, uid: str) -> list[dict[str, Any]]:
        self.calls.append(("list", "Event", uid))
        return copy.deepcopy(self.pod_events.get(uid, []))

    async def read_node(self, name: str) -> dict[str, Any] | None:
        self.calls.append(("read", "Node", name))
        return copy.deepcopy(self.nodes.get(name))

    async def read_pod_log(self, namespace: str, name: str, tail_lines: int | None,
                           previous: bool = False, container: str | None = None,
                           timestamps: bool = False) -> str:
        self.calls.append(("log", name))
        text = self.logs.get(name, "")
        if tail_lines is not None:  # as the kubelet: only the last lines
            text = "".join(text.splitlines(keepends=True)[-tail_lines:])
        return text

    async def read_config_source(self, namespace: str, name: str, key: str) -> ConfigSource:
        self.calls.append(("read", "ConfigMap", name))
        data = self.user_configmaps.get(name, {})
        if key not in data:
            raise ConfigMapMissing(f"ConfigMap {name!r} with key {key!r} does not exist")
        return ConfigSource(name=name, key=key, text=data[key], files=dict(data))

    async def patch_configmap(self, namespace: str, name: str, data: Mapping[str, str]) -> None:
        self.calls.append(("patch", "ConfigMap", name))
        configmap = self.objects.get(("ConfigMap", name))
        if configmap is not None:
            configmap.setdefault("data", {}).update(data)

    async def patch_workload(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        self.calls.append(("patch", "Workload", name))
        workload = self.workload()
        workload["spec"].update(patch["spec"])
        annotations = (patch.get("metadata") or {}).get("annotations") or {}
        if annotations:
            workload["metadata"].setdefault("annotations", {}).update(annotations)
        self._bump(workload)

    async def patch_workload_status(self, namespace: str, name: str,
                                    patch: Mapping[str, Any]) -> None:
        """A JSON merge patch of /status (RFC 7386: a list replaced whole, null deletes), with
        the resourceVersion precondition the API server checks: a stale one changes nothing."""
        self.calls.append(("merge-status", "Workload", name))
        workload = self.workload()
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != workload["metadata"].get("resourceVersion"):
            self.calls.append(("conflict", "Workload", name))
            return
        status = workload.setdefault("status", {})
        for key, value in patch["status"].items():
            if value is None:
                status.pop(key, None)
            else:
                status[key] = copy.deepcopy(value)
        self._bump(workload)

    async def apply_workload_status(self, namespace: str, name: str,
                                    body: Mapping[str, Any], manager: str) -> None:
        """Server-side apply as far as these writes need it: under Kueue's admission manager
        the applied admission conditions replace Kueue's, and an admission left out is gone;
        under another manager the applied conditions are set."""
        self.calls.append(("apply", "Workload", manager))
        workload = self.workload()
        status = workload.setdefault("status", {})
        applied = copy.deepcopy(body["status"]["conditions"])
        kept = [c for c in status.get("conditions") or []
                if c["type"] not in {a["type"] for a in applied}
                and (manager != ADMISSION_MANAGER or c["type"] not in ADMISSION_CONDITIONS)]
        status["conditions"] = kept + applied
        if manager == ADMISSION_MANAGER and "admission" not in body["status"]:
            status.pop("admission", None)
        self._bump(workload)

    async def read_kueue_object(self, plural: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("read", plural, name))
        return copy.deepcopy(self.kueue_objects.get((plural, name)))

    def workload(self) -> dict[str, Any]:
        return next(o for (kind, _), o in self.objects.items() if kind == "Workload")

    @staticmethod
    def _bump(obj: dict[str, Any]) -> None:
        metadata = obj["metadata"]
        metadata["resourceVersion"] = str(int(metadata.get("resourceVersion") or 0) + 1)

    async def patch_job_status(self, namespace: str, name: str,
                               status: Mapping[str, Any]) -> None:
        self.calls.append(("patch", "status", name))
        self.statuses.append(copy.deepcopy(dict(status)))

    async def job_exists(self, namespace: str, name: str, uid: str) -> bool:
        self.calls.append(("get", "AccelerateJob", name))
        return not self.job_deleted and name not in self.jobs_gone

    async def delete_job(self, namespace: str, name: str) -> None:
        self.calls.append(("delete", "AccelerateJob", name))
        self.job_deleted = True

    async def post_event(self, job: Mapping[str, Any], event: Any, now: Any) -> None:
        self.calls.append(("event", event.reason))
        self.events.append(event)

    # ---- what the stores would show -------------------------------------------------------
    def pods(self) -> list[PodState]:
        return [read_pod_state(o) for (kind, _), o in self.objects.items()
                if kind == "Pod" and not is_placeholder(o["metadata"])]

    def placeholders(self) -> list[PodState]:
        """An elastic job's placeholder pods: an index of their own, as the controller has."""
        return [read_pod_state(o) for (kind, _), o in self.objects.items()
                if kind == "Pod" and is_placeholder(o["metadata"])]

    def children(self) -> set[tuple[str, str]]:
        return {key for key in self.objects if key[0] in ("ConfigMap", "Service")}

    def set_pod_phase(self, name: str, phase: str, *, exit_code: int | None = None) -> None:
        pod = self.objects[("Pod", name)]
        status: dict[str, Any] = {"phase": phase}
        if phase == "Running":
            status["conditions"] = [{"type": "Ready", "status": "True"}]
        if exit_code is not None:
            status["containerStatuses"] = [{"state": {"terminated": {"exitCode": exit_code}}}]
        pod["status"] = status

    def names(self, kind: str) -> list[str]:
        return sorted(name for k, name in self.objects if k == kind)
