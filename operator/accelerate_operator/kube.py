"""The only module that talks to the API server for the passes: create-if-absent, delete,
status patches, events, reads, and one paged list for the index audit. Watching is kopf's; this
module never watches. Everything else is pure and testable without a cluster.

Calls are async, on one aiohttp session in the operator's event loop: a create through the
official client, run in a thread, cost 1.50 ms of CPU against 0.62 ms on aiohttp
(docs/benchmarks.md, finding 5), and its threads held memory the operator never gave back.

Credentials are kopf's: the `kopf.ConnectionInfo` its login handler returned (handlers.py), made
into headers and an SSL context by kopf's own `as_http_headers()` / `as_ssl_context()`. A 401
logs in again through the same login (a rotated service-account token, an expired exec-plugin
token) and retries once; a 429 or 503 is retried after the server's Retry-After, as kopf's own
requests are."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import string
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
from yarl import URL

if TYPE_CHECKING:
    from kopf import ConnectionInfo

from .apierrors import server_message
from .constants import FIELD_MANAGER, GROUP, KIND, PLURAL, VERSION
from .kueue import KUEUE_GROUP, KUEUE_VERSION, choose_kueue_version
from .metrics import record_api_error
from .resources.configmap import ConfigSource
from .status import Event, format_time

log = logging.getLogger("accelerate_operator.kube")

# A node agent that does not answer must not hold a reconcile (or the clock's progress read) long.
LOG_REQUEST_TIMEOUT = 10
REQUEST_TIMEOUT = 30
# As many connections as apply.py has creates in flight (CREATE_PARALLELISM): each TLS connection
# holds a 256 KiB read buffer (asyncio sslproto), so no more are kept open.
CONNECTIONS = 16
WORKLOADS = "workloads"
_PATHS = {"ConfigMap": "/api/v1/namespaces/{}/configmaps",
          "Service": "/api/v1/namespaces/{}/services",
          "PodDisruptionBudget": "/apis/policy/v1/namespaces/{}/poddisruptionbudgets",
          "Pod": "/api/v1/namespaces/{}/pods"}
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
# Lists come in pages: the audit's listing of 10,000 pods is never one 80 MiB response.
LIST_PAGE = 500
# A list of names needs no spec: the server sends metadata only (PartialObjectMetadataList).
METADATA_ONLY = ("application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io, "
                 "application/json")
# A 429 or 503 is retried this many times, after the server's Retry-After (capped).
RETRIES = 3
RETRY_AFTER_MAX_SECONDS = 10.0


class Rejected(ValueError):
    """The API server refused a child for good (admission, Pod Security, quota, validation):
    retrying the same manifest cannot succeed."""


class ApiError(Exception):
    """A response other than 2xx. `status`, `reason` and `body` as the official client's
    ApiException has them, so apierrors.server_message reads both."""

    def __init__(self, status: int, reason: str, body: str):
        super().__init__(f"({status}) {reason}: {body[:300]}")
        self.status, self.reason, self.body = status, reason, body


class NamespaceTerminating(Exception):
    """The job's namespace is being deleted: the API server creates nothing more in it, and
    every object in it, the job included, is on its way out. The pass ends here (no status
    write), and the controller runs no pass of that namespace's jobs for a while."""

    def __init__(self, namespace: str):
        super().__init__(f"namespace {namespace} is being terminated")
        self.namespace = namespace


class ConfigMapMissing(LookupError):
    """The ConfigMap or key named by spec.accelerateConfigFrom does not exist."""


Login = Callable[[], Awaitable["ConnectionInfo"]]


class Kube:
    """The requests a pass makes, on one aiohttp session opened on first use (it belongs to the
    running event loop). `login` returns kopf's current ConnectionInfo: called before the first
    request, and again after a 401."""

    def __init__(self, login: Login, connections: int = CONNECTIONS):
        self._login = login
        self.connections = connections
        self._info: ConnectionInfo | None = None
        self._headers_cache: dict[str, str] = {}
        self._base = URL()  # the API server's URL, set at each login
        self._session: aiohttp.ClientSession | None = None
        self._logging_in = asyncio.Lock()
        # Where Kueue's objects are served: its group (another only in tests, which install
        # Workload CRDs of their own) and the version discover_kueue_version found (v1beta1
        # until then).
        self.kueue_group = KUEUE_GROUP
        self.kueue_version = KUEUE_VERSION

    @classmethod
    def from_connection(cls, info: ConnectionInfo, connections: int = CONNECTIONS) -> Kube:
        """Fixed credentials (tests, benchmarks): a 401 logs in to the same ones again."""
        async def login() -> ConnectionInfo:
            return info
        return cls(login, connections)

    # ---- transport ------------------------------------------------------------------------
    async def _connect(self, again: bool = False) -> aiohttp.ClientSession:
        """The session, logged in. Concurrent requests share one login: `again` (after a
        401) logs in anew unless another request already did while this one waited."""
        stale = self._info
        if self._info is None or again:
            async with self._logging_in:
                if self._info is stale:
                    self._info = await self._login()
                    self._base = URL(self._info.server)
                    self._headers_cache = {"Accept": "application/json",
                                           **self._info.as_http_headers()}
                    if self._session is not None:
                        await self._session.close()
                        self._session = None
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                ssl=self._info.as_ssl_context(), limit=self.connections))
        return self._session

    def _url(self, path: str, query: Mapping[str, Any] | None) -> URL:
        """Built with `URL.build`, the one yarl constructor that keeps no cache. A string URL
        goes through yarl's `encode_url` cache (128 entries, private to yarl), which after a
        burst holds the last 128 jobs' URLs and the heap pages under them: 1.7 MiB of the RSS
        after deletion (docs/benchmarks.md, finding 17)."""
        base = self._base
        return URL.build(scheme=base.scheme, authority=base.raw_authority,
                         path=base.raw_path.rstrip("/") + path,
                         query={k: v for k, v in query.items() if v is not None}
                         if query else None)

    async def _request(self, method: str, path: str, body: Any = None, *,
                       query: Mapping[str, Any] | None = None,
                       content_type: str = "application/json",
                       accept: str | None = None,
                       timeout: float = REQUEST_TIMEOUT) -> str:
        """The response's text; ApiError for anything but 2xx (after the retries)."""
        session = await self._connect()
        data = None if body is None else json.dumps(body, separators=(",", ":"))
        own = {**({"Content-Type": content_type} if data is not None else {}),
               **({"Accept": accept} if accept else {})}
        headers = {**self._headers_cache, **own}
        logged_in_again = False
        for attempt in range(RETRIES + 1):
            async with session.request(
                    method, self._url(path, query), data=data, headers=headers,
                    timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                # A pod log is the user's bytes: a multi-byte character cut by the runtime (tqdm's
                # bar at a line split) must not make the whole read fail.
                text = await response.text(errors="replace")
                if response.status < 300:
                    return text
                error = ApiError(response.status, response.reason or "", text)
                retry_after = response.headers.get("Retry-After")
            if error.status == 401 and not logged_in_again:
                logged_in_again = True
                session = await self._connect(again=True)
                headers = {**self._headers_cache, **own}
                continue
            if error.status in (429, 503) and attempt < RETRIES:
                await asyncio.sleep(_retry_delay(retry_after, attempt))
                continue
            if not _expected(method, error.status):
                record_api_error(_VERBS.get(method, "other"), error.status)
            raise error
        raise AssertionError("unreachable")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    # ---- the index audit (controller.py) ---------------------------------------------------
    async def list_names(self, path: str, label_selector: str | None = None
                         ) -> AsyncIterator[tuple[str, str]]:
        """(namespace, name) of every object of a collection, listed in pages. Metadata only
        (the API server's PartialObjectMetadataList): a full list of 1,000 pods is mostly specs
        to download and decode, and this runs in every audit."""
        token = None
        while True:
            page = json.loads(await self._request(
                "GET", path, query={"labelSelector": label_selector, "limit": LIST_PAGE,
                                    "continue": token}, accept=METADATA_ONLY))
            for item in page.get("items") or []:
                metadata = item["metadata"]
                yield metadata.get("namespace") or "", metadata["name"]
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return

    async def remove_finalizer(self, body: Mapping[str, Any], finalizer: str) -> None:
        """Drop `finalizer` from a job, as of the body's resourceVersion (409: the job changed
        meanwhile, and its next event brings the next try)."""
        metadata = body["metadata"]
        kept = [f for f in metadata.get("finalizers") or [] if f != finalizer]
        try:
            await self._ignore_gone(
                "PATCH", self._job_path(metadata["namespace"], metadata["name"]), {"metadata": {
                    "finalizers": kept, "resourceVersion": metadata.get("resourceVersion")}},
                content_type=MERGE)
        except ApiError as error:
            if error.status != 409:
                raise

    # ---- children -------------------------------------------------------------------------
    async def create_if_absent(self, manifest: Mapping[str, Any]) -> bool:
        """Create a child; an existing one (a restarted operator, a repeated event) is kept.
        Returns whether it was created. The created object is not read back: the watch brings
        it. Raises NamespaceTerminating where the namespace is being deleted."""
        namespace = manifest["metadata"]["namespace"]
        path = (self._workloads_path(namespace, manifest.get("apiVersion"))
                if manifest["kind"] == "Workload" else _PATHS[manifest["kind"]].format(namespace))
        try:
            await self._request("POST", path, manifest, query={"fieldManager": FIELD_MANAGER})
        except ApiError as error:
            if error.status == 409:
                return False
            if error.status == 404 and manifest["kind"] == "Workload":
                raise Rejected(
                    f"the API server refused Workload {manifest['metadata']['name']}: it serves "
                    f"no {manifest.get('apiVersion')} Workloads; install Kueue (v0.14 to v0.20), "
                    "or remove the job's label kueue.x-k8s.io/queue-name"
                ) from None
            message = server_message(error)
            if error.status == 403 and "being terminated" in message:
                raise NamespaceTerminating(namespace) from None
            if error.status in (400, 403, 422):
                raise Rejected(
                    f"the API server refused {manifest['kind']} {manifest['metadata']['name']}: "
                    f"{message}"
                ) from None
            raise
        return True

    async def ensure_peering(self, name: str, namespaces: list[str]) -> None:
        """kopf's peering object: a ClusterKopfPeering for an operator of every namespace, else
        a KopfPeering in each one watched. kopf only writes into an existing one; without it a
        replica that must peer stays paused."""
        body = {"apiVersion": "kopf.dev/v1", "metadata": {"name": name}}
        paths = ([f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings" for ns in namespaces]
                 or ["/apis/kopf.dev/v1/clusterkopfpeerings"])
        for path in paths:
            kind = "ClusterKopfPeering" if "clusterkopfpeerings" in path else "KopfPeering"
            try:
                await self._request("POST", path, {**body, "kind": kind})
            except ApiError as error:
                if error.status != 409:
                    raise

    @staticmethod
    def _job_path(namespace: str, name: str) -> str:
        return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"

    def _workloads_path(self, namespace: str, api_version: str | None = None) -> str:
        """Workloads in the version of `api_version` (a manifest's), else the discovered one."""
        version = (api_version or "").rpartition("/")[2] or self.kueue_version
        return f"/apis/{self.kueue_group}/{version}/namespaces/{namespace}/{WORKLOADS}"

    def _workload_path(self, namespace: str, name: str) -> str:
        return f"{self._workloads_path(namespace)}/{name}"

    async def discover_kueue_version(self) -> str | None:
        """The Workload version to read and write, from the API group's discovery document
        (`GET /apis/kueue.x-k8s.io`): v1beta2 when served, else v1beta1 (kueue.py
        choose_kueue_version); None when Kueue is not installed (the default stays). Kept in
        `kueue_version` for every Workload path; called once at start."""
        try:
            group = json.loads(await self._request("GET", f"/apis/{self.kueue_group}"))
        except ApiError as error:
            if error.status == 404:
                return None
            raise
        version = choose_kueue_version(group)
        if version is not None:
            self.kueue_version = version
        return version

    async def patch_workload_status(self, namespace: str, name: str,
                                    patch: Mapping[str, Any]) -> None:
        """A JSON merge patch of the Workload's status (the quota release): it carries the
        resourceVersion read, so a Workload changed meanwhile answers 409 and its watch event
        brings the next pass, which plans again. Fields it does not name stay as they are."""
        try:
            await self._ignore_gone("PATCH", self._workload_path(namespace, name) + "/status",
                                    dict(patch), query={"fieldManager": FIELD_MANAGER},
                                    content_type=MERGE)
        except ApiError as error:
            if error.status != 409:
                raise
            log.info("workload %s/%s changed meanwhile: %s", namespace, name,
                     server_message(error))

    async def patch_workload(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """A merge patch of the Workload's spec (spec.active)."""
        await self._ignore_gone("PATCH", self._workload_path(namespace, name), dict(patch),
                                query={"fieldManager": FIELD_MANAGER}, content_type=MERGE)

    async def apply_workload_status(self, namespace: str, name: str, body: Mapping[str, Any],
                                    manager: str) -> None:
        """A server-side apply of the operator's own Workload conditions (PodsReady,
        Finished) under `manager`, one of the operator's own field managers, forced: those
        conditions are the operator's to set. A 409 is logged; the next pass plans again."""
        try:
            await self._ignore_gone("PATCH", self._workload_path(namespace, name) + "/status",
                                    dict(body), query={"fieldManager": manager, "force": "true"},
                                    content_type=APPLY)
        except ApiError as error:
            if error.status != 409:
                raise
            log.info("workload %s/%s changed meanwhile: %s", namespace, name,
                     server_message(error))

    async def read_kueue_object(self, plural: str, name: str) -> dict[str, Any] | None:
        """A cluster-scoped Kueue object (a ResourceFlavor, a WorkloadPriorityClass), or None."""
        try:
            return json.loads(await self._request(
                "GET", f"/apis/{self.kueue_group}/{self.kueue_version}/{plural}/{name}"))
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def _ignore_gone(self, method: str, path: str, body: Any = None,
                           **kwargs: Any) -> str | None:
        """A write to an object that may be gone meanwhile (a pod deleted, a job and its
        Workload deleted): 404 is nothing to do. The response's text, None when gone."""
        try:
            return await self._request(method, path, body, **kwargs)
        except ApiError as error:
            if error.status != 404:
                raise
            return None

    async def delete_pod(self, namespace: str, name: str) -> None:
        await self._ignore_gone("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}")

    async def read_pod_log(self, namespace: str, name: str, tail_lines: int | None,
                           previous: bool = False, container: str | None = None,
                           limit_bytes: int | None = None, timestamps: bool = False) -> str:
        """The last `tail_lines` lines of a pod's log (or, with tail_lines None, its first
        `limit_bytes` bytes), each line led by the time the runtime logged it with
        `timestamps`; "" when the pod (or its log) is gone or has not started (400: the
        container is still waiting)."""
        try:
            return await self._request(
                "GET", f"/api/v1/namespaces/{namespace}/pods/{name}/log",
                query={"container": container, "tailLines": tail_lines, "limitBytes": limit_bytes,
                       "previous": "true" if previous else None,
                       "timestamps": "true" if timestamps else None},
                timeout=LOG_REQUEST_TIMEOUT)
        except ApiError as error:
            if error.status in (400, 404):
                return ""
            raise
        except asyncio.TimeoutError:
            raise ApiError(504, "timed out reading the log", "") from None

    async def read_config_source(self, namespace: str, name: str, key: str) -> ConfigSource:
        """The accelerate YAML under `key` and every other key of the ConfigMap (the files
        shipped beside it)."""
        configmap = await self._read_configmap(namespace, name, key)
        data = configmap.get("data") or {}
        return ConfigSource(name=name, key=key, text=data[key], files=dict(data),
                            binary_files=dict(configmap.get("binaryData") or {}))

    async def _read_configmap(self, namespace: str, name: str, key: str) -> dict[str, Any]:
        try:
            configmap = json.loads(await self._request(
                "GET", f"/api/v1/namespaces/{namespace}/configmaps/{name}"))
        except ApiError as error:
            if error.status == 404:
                raise ConfigMapMissing(
                    f"spec.accelerateConfigFrom.configMapKeyRef names ConfigMap {name!r}, which "
                    f"does not exist in namespace {namespace!r}; create it with "
                    f"`kubectl create configmap "
                    f"{name} --from-file=<accelerate config>`"
                ) from None
            raise
        data = configmap.get("data") or {}
        if key not in data:
            raise ConfigMapMissing(
                f"ConfigMap {name!r} has no key {key!r} "
                f"(it has: {', '.join(sorted(data)) or 'none'}); "
                "fix spec.accelerateConfigFrom.configMapKeyRef.key"
            )
        return configmap

    # ---- the job ----------------------------------------------------------------------------
    async def patch_job_status(self, namespace: str, name: str,
                               status: Mapping[str, Any]) -> str | None:
        """The job's resourceVersion after the write (its watch event is this write's echo), or
        None: a job deleted meanwhile has nothing to report on."""
        text = await self._ignore_gone(
            "PATCH", self._job_path(namespace, name) + "/status", {"status": dict(status)},
            query={"fieldManager": FIELD_MANAGER}, content_type=MERGE)
        return None if text is None else json.loads(text)["metadata"].get("resourceVersion")

    async def job_exists(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the job (this one: not another of the same name) still exists, as the API
        server knows it now, not as a watch has told so far."""
        try:
            body = json.loads(await self._request("GET", self._job_path(namespace, name)))
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        return body["metadata"].get("uid") == uid and not body["metadata"].get(
            "deletionTimestamp")

    async def delete_job(self, namespace: str, name: str) -> None:
        await self._ignore_gone("DELETE", self._job_path(namespace, name),
                                {"propagationPolicy": "Background"})

    async def post_event(self, job: Mapping[str, Any], event: Event, now) -> None:
        """Events are best effort: failing to post one must not fail the reconcile."""
        metadata = job["metadata"]
        suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=10))
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{metadata['name']}.{suffix}",
                         "namespace": metadata["namespace"]},
            "involvedObject": {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "name": metadata["name"],
                "namespace": metadata["namespace"],
                "uid": metadata.get("uid"),
            },
            "type": event.type,
            "reason": event.reason,
            "message": event.message[:1024],
            "firstTimestamp": format_time(now),
            "lastTimestamp": format_time(now),
            "count": 1,
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
        }
        try:
            await self._request("POST", f"/api/v1/namespaces/{metadata['namespace']}/events",
                                body)
        except (ApiError, aiohttp.ClientError, asyncio.TimeoutError) as error:
            detail = server_message(error) if isinstance(error, ApiError) else repr(error)
            log.warning("could not post event %s on %s: %s", event.reason, metadata["name"],
                        detail)


_VERBS = {"GET": "get", "POST": "create", "PATCH": "patch", "PUT": "update",
          "DELETE": "delete"}


def _expected(method: str, status: int) -> bool:
    """Answers the callers treat as a result, not an error: a create that found the object
    (409), a read or delete of something gone (404)."""
    return (method == "POST" and status == 409) or (method in ("GET", "DELETE", "PATCH")
                                                    and status == 404)


def _retry_delay(retry_after: str | None, attempt: int) -> float:
    """The server's Retry-After (seconds), else 1, 2, 4 s; never more than the cap."""
    try:
        delay = float(retry_after) if retry_after else 2.0 ** attempt
    except ValueError:  # an HTTP date: not worth parsing for a few seconds
        delay = 2.0 ** attempt
    return min(max(delay, 0.0), RETRY_AFTER_MAX_SECONDS)
