"""The only module that talks to the API server for the passes: create-if-absent, delete,
status patches, events, reads, and one paged list for the index audit, all through the official
`kubernetes` client. Watching is kopf's; this module never watches. Everything else is pure and
testable without a cluster.

The client is synchronous: each call runs on a small thread pool of its own, as many threads as
the client keeps connections, so the event loop never waits on the network. What the client
brings, this module does not redo: credentials (the service account in a pod, its token re-read
as the kubelet rotates it; else $KUBECONFIG with exec plugins and token refresh), 429 and 503
retried after the server's Retry-After (urllib3's `Retry`, the client's transport), TLS.

Children are created through the client's untyped request path (`ApiClient.param_serialize` and
`call_api`, what every generated method calls): the typed `create_namespaced_pod` of kubernetes
>= 35 validates a dict body against its pydantic model and refuses what the API server accepts
(`cpu: 2` as an int, a field newer than the client). A typed call with `_preload_content=False`
(no model built of an answer the pass decodes itself, or does not need) hands back the answer
unread: `_run` reads it in the call's thread, for an unread answer never gives its connection
back to the pool (the next request would open a new TLS connection)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import string
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from accelerate_trainer.contract import RUN_ATTEMPT_ANNOTATION
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError
from urllib3.util.retry import Retry

from .apierrors import server_message
from .constants import FIELD_MANAGER, GROUP, KIND, PLURAL, VERSION
from .kueue import KUEUE_GROUP, KUEUE_VERSION, choose_kueue_version
from .metrics import record_api_error
from .resources.configmap import ConfigSource
from .status import Event
from .timefmt import format_time

log = logging.getLogger("accelerate_operator.kube")

# A node agent that does not answer must not hold a pass long.
LOG_REQUEST_TIMEOUT = 10
REQUEST_TIMEOUT = 30
# Threads (and so connections) for API calls: as many as apply.py has creates in flight.
CONNECTIONS = 16
# A 429 or 503 is retried this many times, after the server's Retry-After.
RETRIES = 3
_PATHS = {"ConfigMap": "/api/v1/namespaces/{}/configmaps",
          "Service": "/api/v1/namespaces/{}/services",
          "PodDisruptionBudget": "/apis/policy/v1/namespaces/{}/poddisruptionbudgets",
          "Pod": "/api/v1/namespaces/{}/pods",
          "Event": "/api/v1/namespaces/{}/events"}
MERGE = "application/merge-patch+json"
APPLY = "application/apply-patch+yaml"
# Lists come in pages: the audit's listing of 10,000 pods is never one 80 MiB response.
LIST_PAGE = 500
# A list of names needs no spec: the server sends metadata only (PartialObjectMetadataList).
METADATA_ONLY = ("application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io, "
                 "application/json")
PEERING_GROUP, PEERING_VERSION = "kopf.dev", "v1"
__all__ = ["ApiException", "ConfigMapMissing", "Kube", "NamespaceTerminating", "Rejected"]
T = TypeVar("T")


class Rejected(ValueError):
    """The API server refused a child for good (admission, Pod Security, quota, validation):
    retrying the same manifest cannot succeed. `kind` is the child's."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class NamespaceTerminating(Exception):
    """The job's namespace is being deleted: the API server creates nothing more in it, and
    every object in it, the job included, is on its way out. The pass ends here (no status
    write) and the job is looked at again later."""

    def __init__(self, namespace: str):
        super().__init__(f"namespace {namespace} is being terminated")
        self.namespace = namespace


class ConfigMapMissing(LookupError):
    """The ConfigMap or key named by spec.accelerateConfigFrom does not exist."""


def client_configuration() -> client.Configuration:
    """In a pod, its service account; elsewhere the kubeconfig $KUBECONFIG names now (the
    client's default is read once, when `kubernetes` is first imported)."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                client_configuration=configuration)
    return with_retries(configuration)


def with_retries(configuration: client.Configuration) -> client.Configuration:
    """Only throttling and an unavailable server are retried, after the server's Retry-After
    (the request was not processed); a read that timed out is not: a create may have
    happened."""
    configuration.retries = Retry(total=RETRIES, connect=RETRIES, read=0, status=RETRIES,
                                  status_forcelist=(429, 503), allowed_methods=None,
                                  respect_retry_after_header=True, raise_on_status=False,
                                  backoff_factor=0.5)
    configuration.connection_pool_maxsize = CONNECTIONS
    return configuration


def _verb(method: str) -> str:
    return {"GET": "get", "POST": "create", "PATCH": "patch", "PUT": "update",
            "DELETE": "delete"}.get(method, "other")


def _expected(method: str, status: int | None) -> bool:
    """Answers the callers treat as a result, not an error: a create that found the object
    (409), a read, patch or delete of something gone (404)."""
    return (method == "POST" and status == 409) or (method != "POST" and status == 404)


class Kube:
    """The requests a pass makes. `api` defaults to a client configured from the environment
    (client_configuration)."""

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
        """One client call (its HTTP `method`), in a thread; a failure other than _expected is
        counted."""
        loop = asyncio.get_running_loop()
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
        try:
            return await loop.run_in_executor(self._threads, partial(_read, call, *args,
                                                                     **kwargs))
        except ApiException as error:
            if not _expected(method, error.status):
                record_api_error(_verb(method), error.status)
            raise

    def _raw(self, method: str, path: str, body: Any = None, *,
             query: Mapping[str, Any] | None = None, content_type: str | None = None,
             accept: str = "application/json",
             _request_timeout: float = REQUEST_TIMEOUT) -> bytes:
        """The client's untyped request (module docstring): the response's bytes."""
        headers = {"Accept": accept, **({"Content-Type": content_type} if content_type
                                        else {"Content-Type": "application/json"})}
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
    async def list_names(self, path: str, label_selector: str | None = None
                         ) -> AsyncIterator[tuple[str, str]]:
        """(namespace, name) of every object of a collection, listed in pages, metadata only:
        a full list of 1,000 pods is mostly specs to download and decode."""
        token = None
        while True:
            page = await self.request("GET", path, query={
                "labelSelector": label_selector, "limit": LIST_PAGE, "continue": token},
                accept=METADATA_ONLY)
            for item in page.get("items") or []:
                metadata = item["metadata"]
                yield metadata.get("namespace") or "", metadata["name"]
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return

    async def ensure_peering(self, name: str, namespaces: list[str]) -> None:
        """kopf's peering object: a ClusterKopfPeering for an operator of every namespace, else
        a KopfPeering in each one watched. kopf only writes into an existing one; without it a
        replica that must peer stays paused."""
        for namespace in namespaces or [None]:
            kind = "KopfPeering" if namespace else "ClusterKopfPeering"
            body = {"apiVersion": f"{PEERING_GROUP}/{PEERING_VERSION}", "kind": kind,
                    "metadata": {"name": name}}
            try:
                if namespace:
                    await self._run("POST", self.custom.create_namespaced_custom_object,
                                    PEERING_GROUP, PEERING_VERSION, namespace, "kopfpeerings",
                                    body)
                else:
                    await self._run("POST", self.custom.create_cluster_custom_object,
                                    PEERING_GROUP, PEERING_VERSION, "clusterkopfpeerings", body)
            except ApiException as error:
                if error.status != 409:
                    raise

    async def read_peering(self, name: str, namespaces: list[str]) -> list[dict[str, Any]]:
        """The status of kopf's peering object(s): one record per replica (peering.py)."""
        if not namespaces:
            found = [await self._run("GET", self.custom.get_cluster_custom_object,
                                     PEERING_GROUP, PEERING_VERSION, "clusterkopfpeerings",
                                     name)]
        else:
            found = [await self._run("GET", self.custom.get_namespaced_custom_object,
                                     PEERING_GROUP, PEERING_VERSION, namespace, "kopfpeerings",
                                     name) for namespace in namespaces]
        return [body.get("status") or {} for body in found]

    # ---- children -------------------------------------------------------------------------
    async def create_if_absent(self, manifest: Mapping[str, Any]) -> bool:
        """Create a child; an existing one (a restarted operator, a repeated event) is kept.
        Returns whether it was created. The created object is not read back: the watch brings
        it. Raises NamespaceTerminating where the namespace is being deleted."""
        namespace = manifest["metadata"]["namespace"]
        path = (self._workloads_path(namespace, manifest.get("apiVersion"))
                if manifest["kind"] == "Workload" else _PATHS[manifest["kind"]].format(namespace))
        try:
            await self._run("POST", self._raw, "POST", path, dict(manifest),
                            query={"fieldManager": FIELD_MANAGER})
        except ApiException as error:
            if error.status == 409:
                return False
            raise _refusal(manifest, error) from None
        return True

    def _workloads_path(self, namespace: str, api_version: str | None = None) -> str:
        """Workloads in the version of `api_version` (a manifest's), else the discovered one."""
        version = (api_version or "").rpartition("/")[2] or self.kueue_version
        return f"/apis/{self.kueue_group}/{version}/namespaces/{namespace}/workloads"

    async def delete_pod(self, namespace: str, name: str,
                         grace_period_seconds: int | None = None) -> None:
        """Delete a pod: gracefully (its own terminationGracePeriodSeconds), or, with 0, at once
        (kubectl delete --force), for a pod on a node whose kubelet is gone."""
        await _ignore_gone(self._run("DELETE", self.core.delete_namespaced_pod, name, namespace,
                                     grace_period_seconds=grace_period_seconds,
                                     _preload_content=False))

    async def tell_attempt(self, namespace: str, name: str, attempt: int) -> None:
        """Ask a running pod to launch `attempt` in place (contract.RUN_ATTEMPT_ANNOTATION,
        which its supervisor reads through the downward API); a pod gone meanwhile is no error."""
        body = {"metadata": {"annotations": {RUN_ATTEMPT_ANNOTATION: str(attempt)}}}
        await _ignore_gone(self._run("PATCH", self.core.patch_namespaced_pod, name, namespace,
                                     body, _preload_content=False))

    async def read_node(self, name: str) -> dict[str, Any] | None:
        """A Node, or None when it is gone."""
        response = await _ignore_gone(self._run("GET", self.core.read_node, name,
                                                _preload_content=False))
        return None if response is None else json.loads(response.data)

    # ---- Kueue ----------------------------------------------------------------------------
    async def discover_kueue_version(self) -> str | None:
        """The Workload version to read and write, from the API group's discovery document
        (`GET /apis/kueue.x-k8s.io`): v1beta2 when served, else v1beta1 (kueue.py
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
        patch carries) is logged: its watch event brings the next pass, which plans again."""
        call = (self.custom.patch_namespaced_custom_object_status if subresource == "status"
                else self.custom.patch_namespaced_custom_object)
        try:
            await _ignore_gone(self._run("PATCH", call, self.kueue_group, self.kueue_version,
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
        return await _ignore_gone(self._run("GET", self.custom.get_cluster_custom_object,
                                            self.kueue_group, self.kueue_version, plural, name))

    # ---- reads ------------------------------------------------------------------------------
    async def read_pod_log(self, namespace: str, name: str, tail_lines: int | None,
                           previous: bool = False, container: str | None = None,
                           limit_bytes: int | None = None, timestamps: bool = False) -> str:
        """The last `tail_lines` lines of a pod's log (or, with tail_lines None, its first
        `limit_bytes` bytes), each line led by the time the runtime logged it with
        `timestamps`; "" when the pod (or its log) is gone or has not started (400: the
        container is still waiting). A multi-byte character cut by the runtime (tqdm's bar at
        a line split) must not fail the whole read: the bytes are decoded leniently."""
        options = {"container": container, "tail_lines": tail_lines, "previous": previous,
                   "limit_bytes": limit_bytes, "timestamps": timestamps}
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
                raise ConfigMapMissing(
                    f"spec.accelerateConfigFrom.configMapKeyRef names ConfigMap {name!r}, which "
                    f"does not exist in namespace {namespace!r}; create it with "
                    f"`kubectl create configmap {name} --from-file=<accelerate config>`"
                ) from None
            raise
        configmap = json.loads(response.data)
        data = configmap.get("data") or {}
        if key not in data:
            raise ConfigMapMissing(
                f"ConfigMap {name!r} has no key {key!r} "
                f"(it has: {', '.join(sorted(data)) or 'none'}); "
                "fix spec.accelerateConfigFrom.configMapKeyRef.key")
        return ConfigSource(name=name, key=key, text=data[key], files=dict(data),
                            binary_files=dict(configmap.get("binaryData") or {}))

    # ---- the job ----------------------------------------------------------------------------
    async def patch_job_status(self, namespace: str, name: str,
                               status: Mapping[str, Any]) -> None:
        """A merge patch of the job's status; a job deleted meanwhile has nothing to report."""
        await _ignore_gone(self._run(
            "PATCH", self.custom.patch_namespaced_custom_object_status, GROUP, VERSION,
            namespace, PLURAL, name, {"status": dict(status)}, field_manager=FIELD_MANAGER,
            _content_type=MERGE, _preload_content=False))

    async def job_exists(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the job (this one: not another of the same name) still exists, as the API
        server knows it now, not as a watch has told so far."""
        body = await _ignore_gone(self._run("GET", self.custom.get_namespaced_custom_object,
                                            GROUP, VERSION, namespace, PLURAL, name))
        return body is not None and body["metadata"].get("uid") == uid and not body[
            "metadata"].get("deletionTimestamp")

    async def delete_job(self, namespace: str, name: str) -> None:
        await _ignore_gone(self._run("DELETE", self.custom.delete_namespaced_custom_object,
                                     GROUP, VERSION, namespace, PLURAL, name,
                                     propagation_policy="Background"))

    async def post_event(self, job: Mapping[str, Any], event: Event, now) -> None:
        """Events are best effort: failing to post one must not fail the pass."""
        metadata = job["metadata"]
        try:
            await self._run("POST", self._raw, "POST", _PATHS["Event"].format(
                metadata["namespace"]), build_event(metadata, event, now))
        except (ApiException, HTTPError) as error:
            detail = server_message(error) if isinstance(error, ApiException) else repr(error)
            log.warning("could not post event %s on %s: %s", event.reason, metadata["name"],
                        detail)


def _read(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`call`, and with `_preload_content=False` its answer read whole (kept in `.data`) and
    its connection handed back to the pool (module docstring)."""
    result = call(*args, **kwargs)
    if kwargs.get("_preload_content") is False:
        result.data  # noqa: B018 - reading is the point: urllib3 caches the body here
        result.release_conn()
    return result


def build_event(metadata: Mapping[str, Any], event: Event, now) -> dict[str, Any]:
    """A core/v1 Event about the job (what `kubectl describe` lists)."""
    suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=10))
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{metadata['name']}.{suffix}",
                     "namespace": metadata["namespace"]},
        "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                           "name": metadata["name"], "namespace": metadata["namespace"],
                           "uid": metadata.get("uid")},
        "type": event.type, "reason": event.reason, "message": event.message[:1024],
        "firstTimestamp": format_time(now), "lastTimestamp": format_time(now), "count": 1,
        "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
    }


async def _ignore_gone(call: Any) -> Any:
    """A call on an object that may be gone meanwhile: 404 is nothing to do (None)."""
    try:
        return await call
    except ApiException as error:
        if error.status != 404:
            raise
        return None


def _refusal(manifest: Mapping[str, Any], error: ApiException) -> Exception:
    """What a refused create means for the pass: a namespace being deleted, a refusal for
    good (the job fails with the server's reason), or an error to retry."""
    kind, name = manifest["kind"], manifest["metadata"]["name"]
    if error.status == 404 and kind == "Workload":
        return Rejected(kind, f"the API server refused Workload {name}: it serves no "
                        f"{manifest.get('apiVersion')} Workloads; install Kueue (v0.14 to "
                        "v0.20), or remove the job's label kueue.x-k8s.io/queue-name")
    message = server_message(error)
    if error.status == 403 and "being terminated" in message:
        return NamespaceTerminating(manifest["metadata"]["namespace"])
    if error.status in (400, 403, 422):
        return Rejected(kind, f"the API server refused {kind} {name}: {message}")
    return error
