"""A tiny Kubernetes REST client for the local node agent (requests + a kubeconfig).

It speaks plain JSON dicts: the agent handles hundreds of pods and the official client's model
(de)serialisation costs more CPU than the whole agent otherwise spends. It reads client
certificates, tokens and CA data from a kubeconfig; it does not implement exec plugins.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import requests
import yaml
from requests.adapters import HTTPAdapter


class ApiError(Exception):
    """A non-2xx answer from the API server; `status` is the HTTP code."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


def _materialise(entry: dict, key: str, tmpdir: str) -> str | None:
    """Return a file path for `key` (a path) or `key-data` (base64) of a kubeconfig entry."""
    if entry.get(key):
        return entry[key]
    data = entry.get(f"{key}-data")
    if not data:
        return None
    path = os.path.join(tmpdir, key)
    with open(path, "wb") as f:
        f.write(base64.b64decode(data))
    return path


class KubeClient:
    def __init__(self, kubeconfig: str, pool_size: int = 32):
        with open(kubeconfig) as f:
            cfg = yaml.safe_load(f)
        ctx_name = cfg.get("current-context")
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
        self._tmp = tempfile.mkdtemp(prefix="local-node-agent-")
        self.server = cluster["server"].rstrip("/")
        self.verify = _materialise(cluster, "certificate-authority", self._tmp) or True
        cert = _materialise(user, "client-certificate", self._tmp)
        key = _materialise(user, "client-key", self._tmp)
        self.cert = (cert, key) if cert else None
        self.headers = {"Authorization": f"Bearer {user['token']}"} if user.get("token") else {}
        self._local = threading.local()
        self._pool_size = pool_size

    @property
    def session(self) -> requests.Session:
        # One session per thread: requests.Session is not documented as thread-safe.
        s = getattr(self._local, "session", None)
        if s is None:
            s = requests.Session()
            # Ignore REQUESTS_CA_BUNDLE / proxies from the environment: they would override our CA.
            s.trust_env = False
            s.mount("https://", HTTPAdapter(pool_connections=4, pool_maxsize=self._pool_size))
            s.verify = self.verify
            s.cert = self.cert
            s.headers.update(self.headers)
            self._local.session = s
        return s

    def request(self, method: str, path: str, body: Any = None, params: dict | None = None,
                content_type: str = "application/json", timeout: float = 30) -> Any:
        data = json.dumps(body) if body is not None else None
        r = self.session.request(method, self.server + path, data=data, params=params,
                                 headers={"Content-Type": content_type}, timeout=timeout)
        if r.status_code >= 300:
            raise ApiError(r.status_code, r.text)
        return r.json() if r.content else None

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params or None)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def put(self, path: str, body: Any) -> Any:
        return self.request("PUT", path, body)

    def merge_patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def delete(self, path: str, body: Any = None) -> Any:
        return self.request("DELETE", path, body)

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 300
              ) -> Iterator[dict]:
        """Yield watch events until the server closes the stream; raises ApiError on errors."""
        params = {"watch": "1", "resourceVersion": resource_version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_seconds)}
        with self.session.get(self.server + path, params=params, stream=True,
                              timeout=(10, timeout_seconds + 30)) as r:
            if r.status_code >= 300:
                raise ApiError(r.status_code, r.text)
            for line in r.iter_lines(chunk_size=None):
                if line:
                    yield json.loads(line)
