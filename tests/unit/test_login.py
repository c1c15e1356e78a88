"""How the operator logs in: in a pod it reaches the API server at the address Kubernetes puts
in the pod's environment (KUBERNETES_SERVICE_HOST/PORT), as client-go does, never at
kubernetes.default.svc, a name only cluster DNS resolves: a lost node that carried the cluster's
DNS would otherwise cut every watch of the operator until it restarted."""

from __future__ import annotations

import kopf
import pytest
from accelerate_operator.handlers import _login
from kubernetes import client
from kubernetes.config import incluster_config


@pytest.fixture
def in_a_pod(tmp_path, monkeypatch):
    """A pod's service account (token, CA) and environment; kopf's own service account login
    answers as it does in a pod, with the DNS name."""
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("pod-token")
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")

    def service_account(**_):
        return kopf.ConnectionInfo(server="https://kubernetes.default.svc", token="pod-token",
                                   ca_path=str(ca))
    monkeypatch.setattr(kopf, "login_with_service_account", service_account)
    default = client.Configuration.get_default_copy()
    yield
    client.Configuration.set_default(default)  # load_incluster_config set the process default


def test_in_a_pod_the_api_server_is_reached_by_its_address(in_a_pod):
    info = _login(kopf.OperatorSettings())
    assert (info.server, info.token) == ("https://10.96.0.1:443", "pod-token")

