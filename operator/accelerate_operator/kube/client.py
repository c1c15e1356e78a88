"""The one module that talks to the API server, for the passes and everything around them (the
index audit, peering, the report endpoint): create-if-absent, delete, patches, events, reads,
paged lists, the token issuer's keys, all through the official `kubernetes` client. Watching is
kopf's; this module never watches. Everything else is pure and testable without a cluster.

The client is synchronous: each call runs on a small thread pool of its own, as many threads as
the client keeps connections, so the event loop never waits on the network. What the client
brings, this module does not redo: credentials (the service account in a pod, its token re-read
as the kubelet rotates it; else $KUBECONFIG with exec plugins and token refresh), 429 and 503
retried after the server's Retry-After (urllib3's `Retry`, the client's transport), TLS.

Children are created, and a job's status patched (a running job's most frequent request), through
the client's untyped request path (`ApiClient.param_serialize` and `call_api`, what every
generated method calls): the typed `create_namespaced_pod` of kubernetes >= 35 validates a dict
body against its pydantic model and refuses what the API server accepts (`cpu: 2` as an int, a
field newer than the client). A typed call with `_preload_content=False` (no model built of an
answer the pass decodes itself, or does not need) hands back the answer unread: `_run` reads it
in the call's thread (transport.read_whole), for an unread answer never gives its connection back
to the pool (the next request would open a new TLS connection)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from accelerate_trainer.contract import JOB_NAME_LABEL, RUN_ATTEMPT_ANNOTATION
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from ..apierrors import server_message
from ..constants import FIELD_MANAGER, GROUP, PLURAL, VERSION
from ..kueue.workload import KUEUE_GROUP, KUEUE_VERSION, choose_kueue_version
from ..metrics import record_api_error
from ..resources.configmap import ConfigSource
from ..status import Event, build_event
from .errors import ConfigMapMissing, expected, missing_configmap, missing_key, refusal, verb
from .paths import (
    APPLY,
    COLLECTIONS,
    JOBS,
    JWKS,
    LIST_PAGE,
    MERGE,
    METADATA_ONLY,
    OPENID_CONFIGURATION,
    OPENID_KEYS,
    PEERING_GROUP,
    PEERING_VERSION,
    listed_collection,
    peerings,
    workloads,
)
from .transport import CONNECTIONS, T, client_configuration, ignore_gone, read_whole

log = logging.getLogger("accelerate_operator.kube")

# A node agent that does not answer must not hold a pass long.
LOG_REQUEST_TIMEOUT = 10
REQUEST_TIMEOUT = 30


class Kube:
    """Every request the operator makes. `api` defaults to a client configured from the
    environment (client_configuration)."""

    def __init__(self, api: client.ApiClient | None = None):
        self.api = api or client.ApiClient(client_configuration())
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self._threads = ThreadPoolExecutor(CONNECTIONS, thread_name_prefix="kube")
        # Where Kueue's objects are served: its group (another only in tests, which install
        # Workload CRDs of their own) and the version discover_kueue_version found.
        self.kueue_group = KUEUE_GROUP
        self.kueue_version = KUEUE_VERSION

    async def _run(self, method: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One client call (its HTTP `method`), in a thread; a failure other than an expected one is
        counted."""
        loop = asyncio.get_running_loop()
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
        try:
            return await loop.run_in_executor(self._threads, partial(read_whole, call, *args,
                                                                     **kwargs))
        except ApiException as error:
            if not expected(method, error.status):
                record_api_error(verb(method), error.status)
            raise

    def _raw(self, method: str, path: str, body: Any = None, *,
             query: Mapping[str, Any] | None = None, content_type: str | None = None,
             accept: str = "application/json",
             _request_timeout: float = REQUEST_TIMEOUT) -> bytes:
        """The client's untyped request (module docstring): the response's bytes."""
        headers = {"Accept": accept, "Content-Type": content_type or "application/json"}
        request = self.api.param_serialize(
            method, path, query_params=[(k, v) for k, v in (query or {}).items()
                                        if v is not None],
            header_params=headers, body=body, auth_settings=["BearerToken"])
        response = self.api.call_api(*request, _request_timeout=_request_timeout)
        response.read()
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(http_resp=response, body=None, data=None)
        return response.data

    async def request(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        """An untyped request, its JSON answer decoded."""
        data = await self._run(method, self._raw, method, path, body, **kwargs)
        return json.loads(data) if data else None

    async def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.api.close)

    # ---- the index audit and peering (controller.py) --------------------------------------
    async def list_metadata(self, path: str, label_selector: str | None = None
                            ) -> AsyncIterator[Mapping[str, Any]]:
        """The metadata of every object of a collection, listed in pages, metadata only: a full
        list of 1,000 pods is mostly specs to download and decode."""
        token = None
        while True:
            page = await self.request("GET", path, query={
                "labelSelector": label_selector, "limit": LIST_PAGE, "continue": token},
                accept=METADATA_ONLY)
            for item in page.get("items") or []:
                yield item["metadata"]
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return

    async def list_owned(self, kind: str, namespaces: list[str]
                         ) -> AsyncIterator[tuple[str, str, str, str]]:
        """(namespace, name, uid, resourceVersion) of every job, or every object of an owned
        kind the operator watches (its selector), in the namespaces watched (none: every one):
        what the index audit and the cache sync compare kopf's indexes with. A kind not served
        (Kueue absent) lists nothing; an object whose job-name label is empty, which no index
        keeps (indexes.owning_job), is left out."""
        for namespace in namespaces or [None]:
            path, selector = listed_collection(kind, namespace, self.kueue_group,
                                               self.kueue_version)
            try:
                async for metadata in self.list_metadata(path, selector):
                    if selector and not (metadata.get("labels") or {}).get(JOB_NAME_LABEL):
                        continue
                    yield (metadata.get("namespace") or "", metadata["name"],
                           metadata.get("uid") or "", metadata.get("resourceVersion") or "")
            except ApiException as error:
                if error.status != 404:
                    raise

    async def ensure_peering(self, name: str, namespaces: list[str]) -> None:
        """kopf's peering object: a ClusterKopfPeering for an operator of every namespace, else
        a KopfPeering in each one watched. kopf only writes into an existing one; without it a
        replica that must peer stays paused."""
        for namespace in namespaces or [None]:
            body = {"apiVersion": f"{PEERING_GROUP}/{PEERING_VERSION}", "metadata": {"name": name},
                    "kind": "KopfPeering" if namespace else "ClusterKopfPeering"}
            try:
                await self.request("POST", peerings(namespace), body)
            except ApiException as error:
                if error.status != 409:
                    raise

    async def read_peering(self, name: str, namespaces: list[str]) -> list[dict[str, Any]]:
        """The status of kopf's peering object(s): one record per replica (peering.py)."""
        return [(await self.request("GET", f"{peerings(namespace)}/{name}")).get("status") or {}
                for namespace in namespaces or [None]]

    # ---- children -------------------------------------------------------------------------
    async def create_if_absent(self, manifest: Mapping[str, Any]) -> bool:
        """Create a child; an existing one (a restarted operator, a repeated event) is kept.
        Returns whether it was created. The created object is not read back: the watch brings
        it. Raises NamespaceTerminating where the namespace is being deleted."""
        namespace = manifest["metadata"]["namespace"]
        path = (self._workloads_path(namespace, manifest.get("apiVersion"))
                if manifest["kind"] == "Workload"
                else COLLECTIONS[manifest["kind"]].format(namespace))
        try:
            await self._run("POST", self._raw, "POST", path, dict(manifest),
                            query={"fieldManager": FIELD_MANAGER})
        except ApiException as error:
            if error.status == 409:
                return False
            raise refusal(manifest, error) from None
        return True

    def _workloads_path(self, namespace: str, api_version: str | None = None) -> str:
        """Workloads in the version of `api_version` (a manifest's), else the discovered one."""
        version = (api_version or "").rpartition("/")[2] or self.kueue_version
        return workloads(self.kueue_group, version, namespace)

    async def delete_pod(self, namespace: str, name: str,
                         grace_period_seconds: int | None = None) -> None:
        """Delete a pod: gracefully (its own terminationGracePeriodSeconds), or, with 0, at once
        (kubectl delete --force), for a pod on a node whose kubelet is gone."""
        await ignore_gone(self._run("DELETE", self.core.delete_namespaced_pod, name, namespace,
                                     grace_period_seconds=grace_period_seconds,
                                     _preload_content=False))

    async def tell_attempt(self, namespace: str, name: str, attempt: int) -> None:
        """Ask a running pod to launch `attempt` in place (contract.RUN_ATTEMPT_ANNOTATION,
        which its supervisor reads through the downward API); a pod gone meanwhile is no error."""
        body = {"metadata": {"annotations": {RUN_ATTEMPT_ANNOTATION: str(attempt)}}}
        await ignore_gone(self._run("PATCH", self.core.patch_namespaced_pod, name, namespace,
                                     body, _preload_content=False))

    async def read_node(self, name: str) -> dict[str, Any] | None:
        """A Node, or None when it is gone."""
        response = await ignore_gone(self._run("GET", self.core.read_node, name,
                                                _preload_content=False))
        return None if response is None else json.loads(response.data)

    async def list_pod_warnings(self, namespace: str, uid: str) -> list[dict[str, Any]]:
        """A pod's Warning events (the kubelet counts a repeated one in a single event)."""
        found = await self.request("GET", COLLECTIONS["Event"].format(namespace), query={
            "fieldSelector": f"involvedObject.uid={uid},type=Warning", "limit": 50})
        return (found or {}).get("items") or []

    # ---- Kueue ----------------------------------------------------------------------------
    async def discover_kueue_version(self) -> str | None:
        """The Workload version to read and write, from the API group's discovery document
        (`GET /apis/kueue.x-k8s.io`): v1beta2 when served, else v1beta1 (kueue
        choose_kueue_version); None when Kueue is not installed (the default stays). Kept in
        `kueue_version` for every Workload path; called once at start."""
        try:
            group = await self.request("GET", f"/apis/{self.kueue_group}")
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        version = choose_kueue_version(group)
        if version is not None:
            self.kueue_version = version
        return version

    async def _patch_workload(self, namespace: str, name: str, body: Mapping[str, Any],
                              subresource: str, **query: Any) -> None:
        """A patch of a Workload, or of its status. A 409 (it changed since the read the
        patch carries) is logged: its watch event brings the next pass, which decides again."""
        call = (self.custom.patch_namespaced_custom_object_status if subresource == "status"
                else self.custom.patch_namespaced_custom_object)
        try:
            await ignore_gone(self._run("PATCH", call, self.kueue_group, self.kueue_version,
                                         namespace, "workloads", name, dict(body), **query))
        except ApiException as error:
            if error.status != 409:
                raise
            log.info("workload %s/%s changed meanwhile: %s", namespace, name,
                     server_message(error))

    async def patch_workload_status(self, namespace: str, name: str,
                                    patch: Mapping[str, Any]) -> None:
        """A JSON merge patch of the Workload's status (the quota release), carrying the
        resourceVersion read. Fields it does not name stay as they are."""
        await self._patch_workload(namespace, name, patch, "status",
                                   field_manager=FIELD_MANAGER, _content_type=MERGE)

    async def patch_workload(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """A merge patch of the Workload's spec (spec.active)."""
        await self._patch_workload(namespace, name, patch, "spec",
                                   field_manager=FIELD_MANAGER, _content_type=MERGE)

    async def apply_workload_status(self, namespace: str, name: str, body: Mapping[str, Any],
                                    manager: str) -> None:
        """A server-side apply of the operator's own Workload conditions (PodsReady,
        Finished) under `manager`, forced: those conditions are the operator's to set."""
        await self._patch_workload(namespace, name, body, "status", field_manager=manager,
                                   force=True, _content_type=APPLY)

    async def read_kueue_object(self, plural: str, name: str) -> dict[str, Any] | None:
        """A cluster-scoped Kueue object (a ResourceFlavor, a WorkloadPriorityClass), or None."""
        return await ignore_gone(self._run("GET", self.custom.get_cluster_custom_object,
                                            self.kueue_group, self.kueue_version, plural, name))

    # ---- reads ------------------------------------------------------------------------------
    async def read_pod_log(self, namespace: str, name: str, tail_lines: int | None,
                           previous: bool = False, container: str | None = None,
                           timestamps: bool = False) -> str:
        """The last `tail_lines` lines of a pod's log (a restart's archive), each line led by
        the time the runtime logged it with `timestamps`; "" when the pod (or its log) is gone
        or has not started (400: the container is still waiting). A multi-byte character cut
        by the runtime (tqdm's bar at a line split) must not fail the whole read: the bytes
        are decoded leniently."""
        options = {"container": container, "tail_lines": tail_lines, "previous": previous,
                   "timestamps": timestamps}
        try:
            response = await self._run(
                "GET", self.core.read_namespaced_pod_log, name, namespace,
                _preload_content=False, _request_timeout=LOG_REQUEST_TIMEOUT,
                **{k: v for k, v in options.items() if v not in (None, False)})
        except ApiException as error:
            if error.status in (400, 404):
                return ""
            raise
        except HTTPError as error:  # the node agent did not answer in time
            raise ApiException(status=504, reason=f"reading the log failed: {error}") from None
        return response.data.decode("utf-8", errors="replace")

    async def read_config_source(self, namespace: str, name: str, key: str) -> ConfigSource:
        """The accelerate YAML under `key` and every other key of the ConfigMap (the files
        shipped beside it)."""
        try:
            response = await self._run("GET", self.core.read_namespaced_config_map, name,
                                       namespace, _preload_content=False)
        except ApiException as error:
            if error.status == 404:
                raise ConfigMapMissing(missing_configmap(namespace, name)) from None
            raise
        configmap = json.loads(response.data)
        data = configmap.get("data") or {}
        if key not in data:
            raise ConfigMapMissing(missing_key(name, key, data))
        return ConfigSource(name=name, key=key, text=data[key], files=dict(data),
                            binary_files=dict(configmap.get("binaryData") or {}))

    async def patch_configmap(self, namespace: str, name: str, data: Mapping[str, str]) -> None:
        """Merge `data` into a ConfigMap (the report CA bundle); one deleted meanwhile is no
        error."""
        await ignore_gone(self.request("PATCH", f"{COLLECTIONS['ConfigMap'].format(namespace)}/"
                                       f"{name}", {"data": dict(data)}, content_type=MERGE,
                                       query={"fieldManager": FIELD_MANAGER}))

    # ---- the report endpoint (report_server.py, report_keeper.py, report_presence.py) ------
    async def read_issuer(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The service-account issuer's OIDC discovery document and keys (report_tokens.py)."""
        configuration = await self.request("GET", OPENID_CONFIGURATION)
        return configuration or {}, await self.request("GET", OPENID_KEYS, accept=JWKS) or {}

    async def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Secret, its data decoded, or None when there is none."""
        path = f"{COLLECTIONS['Secret'].format(namespace)}/{name}"
        secret = await ignore_gone(self.request("GET", path))
        if secret is None:
            return None
        data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
        return {**secret, "data": data}

    async def write_secret(self, namespace: str, name: str, data: Mapping[str, str],
                           labels: Mapping[str, str], resource_version: str | None) -> bool:
        """Create the Secret (resource_version None) or replace the version read; False when
        another replica wrote first (409: read again)."""
        body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                             **({"resourceVersion": resource_version}
                                if resource_version else {})},
                "stringData": dict(data)}
        path = COLLECTIONS["Secret"].format(namespace)
        method, path = ("POST", path) if resource_version is None else ("PUT", f"{path}/{name}")
        try:
            await self.request(method, path, body, query={"fieldManager": FIELD_MANAGER})
        except ApiException as error:
            if error.status == 409:
                return False
            raise
        return True

    async def label_pod(self, namespace: str, name: str, key: str, value: str | None) -> None:
        """Set (None: remove) one label of a pod."""
        await self.request("PATCH", f"{COLLECTIONS['Pod'].format(namespace)}/{name}",
                           {"metadata": {"labels": {key: value}}}, content_type=MERGE,
                           query={"fieldManager": FIELD_MANAGER})

    # ---- the job ----------------------------------------------------------------------------
    async def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """A merge patch of the status, untyped (module docstring); a gone job has none."""
        await ignore_gone(self._run(
            "PATCH", self._raw, "PATCH", f"{JOBS.format(namespace)}/{name}/status",
            {"status": dict(status)}, query={"fieldManager": FIELD_MANAGER},
            content_type=MERGE))

    async def job_exists(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the job (this one: not another of the same name) still exists, as the API
        server knows it now, not as a watch has told so far."""
        body = await ignore_gone(self._run("GET", self.custom.get_namespaced_custom_object,
                                            GROUP, VERSION, namespace, PLURAL, name))
        return body is not None and body["metadata"].get("uid") == uid and not body[
            "metadata"].get("deletionTimestamp")

    async def delete_job(self, namespace: str, name: str) -> None:
        await ignore_gone(self._run("DELETE", self.custom.delete_namespaced_custom_object,
                                     GROUP, VERSION, namespace, PLURAL, name,
                                     propagation_policy="Background"))

    async def post_event(self, job: Mapping[str, Any], event: Event, now) -> None:
        """Events are best effort: failing to post one must not fail the pass."""
        metadata = job["metadata"]
        try:
            await self._run("POST", self._raw, "POST", COLLECTIONS["Event"].format(
                metadata["namespace"]), build_event(metadata, event, now))
        except (ApiException, HTTPError) as error:
            detail = server_message(error) if isinstance(error, ApiException) else repr(error)
            log.warning("could not post event %s on %s: %s", event.reason, metadata["name"],
                        detail)
