"""The only module that talks to the API server: lists and watches (for informer.py),
create-if-absent, delete, status patches, events and reads. Everything else is pure and
testable without a cluster.

Calls are async, on aiohttp sessions in the operator's event loop: a create through the
official client, run in a thread, cost 1.50 ms of CPU against 0.62 ms on aiohttp
(docs/benchmarks.md, finding 5), and its threads held memory the operator never gave back.

Credentials: in a pod, the service account's token, CA and the API server's address, read from
where the kubelet puts them (the token again every minute: it rotates); elsewhere the official
client reads the kubeconfig (exec plugins, OIDC and token refresh included), imported only
then: importing it costs the operator 17 MiB of its idle memory (finding 10)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import ssl
import string
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp

from .apierrors import server_message
from .constants import FIELD_MANAGER, GROUP, KIND, PLURAL, VERSION
from .kueue import KUEUE_GROUP, KUEUE_VERSION, choose_kueue_version
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
          "Pod": "/api/v1/namespaces/{}/pods"}
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
# Lists come in pages: the start-up listing of 10,000 pods is never one 80 MiB response.
LIST_PAGE = 500
# The server ends a watch after this long; the informer watches again from where it was.
WATCH_SECONDS = 300


class Rejected(ValueError):
    """The API server refused a child for good (admission, Pod Security, quota, validation):
    retrying the same manifest cannot succeed."""


class ApiError(Exception):
    """A response other than 2xx. `status`, `reason` and `body` as the official client's
    ApiException has them, so apierrors.server_message reads both."""

    def __init__(self, status: int, reason: str, body: str):
        super().__init__(f"({status}) {reason}: {body[:300]}")
        self.status, self.reason, self.body = status, reason, body


class Gone(Exception):
    """The resourceVersion a watch or a list continues from is too old (410): list again."""


class ConfigMapMissing(LookupError):
    """The ConfigMap or key named by spec.accelerateConfigFrom does not exist."""


SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# client-go reads a projected token again every minute; the kubelet rotates it well before expiry.
TOKEN_REREAD_SECONDS = 60.0


@dataclass
class Credentials:
    """Where the API server is and how to prove who we are. `auth_headers()` is called for
    every request, so a rotated token is sent as soon as it is read."""

    host: str
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify: bool = True
    check_hostname: bool = True
    auth_headers: Callable[[], dict[str, str]] = field(default=dict)

    @classmethod
    def in_cluster(cls, root: Path = SERVICE_ACCOUNT, environ: Mapping[str, str] = os.environ,
                   clock: Callable[[], float] = time.monotonic) -> Credentials | None:
        """The pod's service account, or None outside a pod."""
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port or not (root / "token").is_file():
            return None
        if ":" in host:  # IPv6
            host = f"[{host}]"
        token = _RereadToken(root / "token", clock)
        return cls(host=f"https://{host}:{port}", ca_file=str(root / "ca.crt"),
                   auth_headers=lambda: {"Authorization": f"Bearer {token.read()}"})

    @classmethod
    def from_client_configuration(cls, configuration: Any) -> Credentials:
        """What the official client's Configuration holds (a kubeconfig it loaded); its
        auth_settings() refresh an exec plugin's or a rotated token themselves."""
        def auth_headers() -> dict[str, str]:
            return {auth["key"]: auth["value"]
                    for auth in configuration.auth_settings().values()
                    if auth["in"] == "header" and auth["value"]}
        return cls(host=configuration.host, ca_file=configuration.ssl_ca_cert,
                   cert_file=configuration.cert_file, key_file=configuration.key_file,
                   verify=bool(configuration.verify_ssl),
                   check_hostname=configuration.assert_hostname is not False,
                   auth_headers=auth_headers)

    @classmethod
    def from_kubeconfig(cls, path: str | None = None) -> Credentials:
        import kubernetes  # only here: 17 MiB, and a pod never needs it

        configuration = kubernetes.client.Configuration()
        # $KUBECONFIG read now: the client's own default was fixed when it was imported.
        kubernetes.config.load_kube_config(config_file=path or os.environ.get("KUBECONFIG"),
                                           client_configuration=configuration)
        return cls.from_client_configuration(configuration)

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.verify:
            return False
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        context.check_hostname = self.check_hostname
        return context


class _RereadToken:
    def __init__(self, path: Path, clock: Callable[[], float]):
        self._path, self._clock = path, clock
        self._token, self._read_at = "", float("-inf")

    def read(self) -> str:
        if self._clock() - self._read_at >= TOKEN_REREAD_SECONDS:
            self._token = self._path.read_text().strip()
            self._read_at = self._clock()
        return self._token


class Kube:
    """The requests the operator makes, on one aiohttp session opened on first use (it belongs
    to the running event loop), and one more for the watches."""

    def __init__(self, credentials: Credentials, connections: int = CONNECTIONS):
        self.credentials = credentials
        self.connections = connections
        self._session: aiohttp.ClientSession | None = None
        self._watch_session: aiohttp.ClientSession | None = None
        # Where Kueue's objects are served: its group (another only in tests, which install
        # Workload CRDs of their own) and the version discover_kueue_version found (v1beta1
        # until then).
        self.kueue_group = KUEUE_GROUP
        self.kueue_version = KUEUE_VERSION

    @classmethod
    def from_environment(cls, connections: int = CONNECTIONS) -> Kube:
        """In-cluster credentials when running in a pod, else the current kubeconfig."""
        return cls(Credentials.in_cluster() or Credentials.from_kubeconfig(), connections)

    # ---- transport ------------------------------------------------------------------------
    def _ssl_context(self) -> ssl.SSLContext | bool:
        return self.credentials.ssl_context()

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json", **self.credentials.auth_headers()}
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def _url(self, path: str, query: Mapping[str, Any] | None) -> str:
        url = self.credentials.host + path
        if query:
            url += "?" + urlencode({k: v for k, v in query.items() if v is not None})
        return url

    async def _request(self, method: str, path: str, body: Any = None, *,
                       query: Mapping[str, Any] | None = None,
                       content_type: str = "application/json",
                       timeout: float = REQUEST_TIMEOUT) -> str:
        """The response's text; ApiError for anything but 2xx."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl_context(), limit=self.connections))
        url = self._url(path, query)
        data = None if body is None else json.dumps(body, separators=(",", ":"))
        async with self._session.request(
                method, url, data=data, headers=self._headers(content_type if data else None),
                timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            text = await response.text()
            if response.status >= 300:
                raise ApiError(response.status, response.reason or "", text)
            return text

    async def close(self) -> None:
        for session in (self._session, self._watch_session):
            if session is not None:
                await session.close()

    # ---- lists and watches (informer.py) ---------------------------------------------------
    async def list_pages(self, path: str, label_selector: str | None = None
                         ) -> AsyncIterator[tuple[list[dict[str, Any]], str | None]]:
        """A collection, page by page: (items, None), ..., then the last page's items with the
        list's resourceVersion, from which a watch continues. Gone when a page's continue token
        has expired (the caller lists again)."""
        token = None
        while True:
            try:
                page = json.loads(await self._request(
                    "GET", path, query={"labelSelector": label_selector, "limit": LIST_PAGE,
                                        "continue": token}))
            except ApiError as error:
                if error.status == 410:
                    raise Gone(server_message(error)) from None
                raise
            metadata = page.get("metadata") or {}
            token = metadata.get("continue")
            if not token:
                yield page.get("items") or [], metadata.get("resourceVersion") or ""
                return
            yield page.get("items") or [], None

    async def watch(self, path: str, resource_version: str, label_selector: str | None = None,
                    timeout_seconds: int = WATCH_SECONDS
                    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """The collection's changes after `resource_version`, as (type, object), bookmarks
        included, until the server ends the watch (after `timeout_seconds`). Gone when that
        version is too old. Watches hold their connections for minutes: they get a session of
        their own, so they never take the request pool's connections."""
        if self._watch_session is None or self._watch_session.closed:
            self._watch_session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl_context(), limit=0))
        url = self._url(path, {"watch": "true", "allowWatchBookmarks": "true",
                               "resourceVersion": resource_version,
                               "timeoutSeconds": timeout_seconds,
                               "labelSelector": label_selector})
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT,
                                        sock_read=timeout_seconds + REQUEST_TIMEOUT)
        async with self._watch_session.get(url, headers=self._headers(None),
                                           timeout=timeout) as response:
            if response.status == 410:
                raise Gone(await response.text())
            if response.status >= 300:
                raise ApiError(response.status, response.reason or "", await response.text())
            pending = bytearray()  # one event per line; an object may span many chunks
            async for chunk in response.content.iter_any():
                pending += chunk
                start = 0
                while (end := pending.find(b"\n", start)) >= 0:
                    if end > start:
                        event = json.loads(pending[start:end])
                        if event.get("type") == "ERROR":
                            _raise_watch_error(event.get("object") or {})
                        yield event["type"], event["object"]
                    start = end + 1
                del pending[:start]

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
        it."""
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
                return False  # the namespace is going away, and the job with it
            if error.status in (400, 403, 422):
                raise Rejected(
                    f"the API server refused {manifest['kind']} {manifest['metadata']['name']}: "
                    f"{message}"
                ) from None
            raise
        return True

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
                           **kwargs: Any) -> None:
        """A write to an object that may be gone meanwhile (a pod deleted, a job and its
        Workload deleted): 404 is nothing to do."""
        try:
            await self._request(method, path, body, **kwargs)
        except ApiError as error:
            if error.status != 404:
                raise

    async def delete_pod(self, namespace: str, name: str) -> None:
        await self._ignore_gone("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}")

    async def read_pod_log(self, namespace: str, name: str, tail_lines: int | None,
                           previous: bool = False, container: str | None = None,
                           limit_bytes: int | None = None) -> str:
        """The last `tail_lines` lines of a pod's log (or, with tail_lines None, its first
        `limit_bytes` bytes); "" when the pod (or its log) is gone or has not started (400: the
        container is still waiting)."""
        try:
            return await self._request(
                "GET", f"/api/v1/namespaces/{namespace}/pods/{name}/log",
                query={"container": container, "tailLines": tail_lines, "limitBytes": limit_bytes,
                       "previous": "true" if previous else None},
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
                               status: Mapping[str, Any]) -> None:
        """A job deleted meanwhile has nothing to report on."""
        await self._ignore_gone(
            "PATCH", self._job_path(namespace, name) + "/status",
            {"status": dict(status)}, query={"fieldManager": FIELD_MANAGER}, content_type=MERGE)

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


def _raise_watch_error(status: Mapping[str, Any]) -> None:
    """A watch's ERROR event carries a Status: 410 (the version expired) means list again."""
    if status.get("code") == 410:
        raise Gone(status.get("message") or "the watch's resourceVersion expired")
    raise ApiError(int(status.get("code") or 500), status.get("reason") or "",
                   json.dumps(status))
