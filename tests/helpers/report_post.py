"""POSTs to the operator's report endpoint from this host, as a pod would send them: HTTPS,
verified with the CA bundle the operator wrote into the job's ConfigMap, for the Service name
its certificate holds, with a bearer token the API server issued (TokenRequest). The endpoint is
reached on a local port: the in-process operator's own, or `kubectl port-forward` to the
deployed operator's active replica."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from accelerate_trainer.contract import REPORT_AUDIENCE, REPORT_CA_KEY

from devtools.cluster import kubectl, kubectl_binary, wait_for

# The endpoint's name in its certificate: the chart's default Service (release accelerate-operator
# in accelerate-system), and an operator's default outside the chart.
SERVICE_HOST = "accelerate-operator.accelerate-system.svc"
PATH = "/apis/accelerate-operator.io/v1alpha1/namespaces/{}/acceleratejobs/{}/status"


class _Connection(http.client.HTTPSConnection):
    """To 127.0.0.1:port, with TLS verified for `name` (the Service's)."""

    def __init__(self, port: int, context: ssl.SSLContext, name: str):
        super().__init__("127.0.0.1", port, context=context, timeout=15)
        self._name, self._tls = name, context

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._tls.wrap_socket(sock, server_hostname=self._name)


def post(port: int, ca: str, namespace: str, job: str, token: str | None,
         body: dict | bytes, name: str = SERVICE_HOST) -> tuple[int, dict[str, Any], str | None]:
    """(status, answer, Retry-After) of one POST."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection = _Connection(port, ssl.create_default_context(cadata=ca), name)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        connection.request("POST", PATH.format(namespace, job), body=raw, headers=headers)
        answer = connection.getresponse()
        text = answer.read()
        return answer.status, json.loads(text or b"{}"), answer.getheader("Retry-After")
    finally:
        connection.close()


def job_ca(kubeconfig: str, namespace: str, job: str) -> str:
    """The CA bundle the operator wrote into the job's ConfigMap."""
    key = REPORT_CA_KEY.replace(".", "\\.")
    return wait_for(lambda: kubectl(
        "-n", namespace, "get", "configmap", f"{job}-accelerate-config", "-o",
        f"jsonpath={{.data.{key}}}", kubeconfig=kubeconfig, check=False).stdout.strip(),
        timeout=60, description=f"the report CA in {job}'s ConfigMap")


def pod_token(kubeconfig: str, namespace: str, pod: str | None, uid: str | None = None,
              audience: str | None = REPORT_AUDIENCE) -> str:
    """A token of the namespace's `default` account (TokenRequest), bound to `pod` (or to
    nothing), for `audience` (None: the API server's own)."""
    args = ["--duration", "10m"]
    if audience:
        args += ["--audience", audience]
    if pod:
        args += ["--bound-object-kind", "Pod", "--bound-object-name", pod]
        if uid:
            args += ["--bound-object-uid", uid]
    return kubectl("-n", namespace, "create", "token", "default", *args,
                   kubeconfig=kubeconfig).stdout.strip()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _reachable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@contextmanager
def forwarded(kubeconfig: str, namespace: str, pod: str, remote: int = 8443) -> Iterator[int]:
    """`kubectl port-forward` to a pod's port: the local port."""
    port = _free_port()
    process = subprocess.Popen([kubectl_binary(), "--kubeconfig", kubeconfig, "-n", namespace,
                                "port-forward", f"pod/{pod}", f"{port}:{remote}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: _reachable(port), timeout=30,
                 description=f"kubectl port-forward to {pod}:{remote}")
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)
