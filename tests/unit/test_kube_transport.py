"""kube.py's transport: the credentials become the request's headers (an in-cluster token must
reach the API server, else every call is system:anonymous), read in a pod from the service
account's files without the official client, and from a kubeconfig through it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes
from accelerate_operator.kube import TOKEN_REREAD_SECONDS, Credentials, Kube


def configuration(**api_key: str) -> kubernetes.client.Configuration:
    config = kubernetes.client.Configuration()
    config.host = "https://10.96.0.1:443"
    config.api_key = dict(api_key)
    return config


def service_account(tmp_path: Path, token: str = "abc.def") -> Path:
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "ca.crt").write_text("")
    return tmp_path


IN_A_POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def test_in_a_pod_the_service_accounts_token_becomes_the_authorization_header(tmp_path):
    credentials = Credentials.in_cluster(service_account(tmp_path), IN_A_POD)
    assert (credentials.host, credentials.ca_file) == ("https://10.96.0.1:443",
                                                       str(tmp_path / "ca.crt"))
    assert Kube(credentials)._headers("application/json") == {
        "Accept": "application/json", "Content-Type": "application/json",
        "Authorization": "Bearer abc.def"}


def test_a_rotated_service_account_token_is_read_again_within_a_minute(tmp_path):
    now = [0.0]
    credentials = Credentials.in_cluster(service_account(tmp_path, "old"), IN_A_POD,
                                         clock=lambda: now[0])
    assert credentials.auth_headers() == {"Authorization": "Bearer old"}
    (tmp_path / "token").write_text("new")
    now[0] += TOKEN_REREAD_SECONDS - 1
    assert credentials.auth_headers() == {"Authorization": "Bearer old"}
    now[0] += 1
    assert credentials.auth_headers() == {"Authorization": "Bearer new"}


def test_outside_a_pod_there_are_no_in_cluster_credentials(tmp_path):
    assert Credentials.in_cluster(service_account(tmp_path), {}) is None
    assert Credentials.in_cluster(tmp_path / "missing", IN_A_POD) is None
    ipv6 = Credentials.in_cluster(service_account(tmp_path), {
        "KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"})
    assert ipv6.host == "https://[fd00::1]:443"


def test_a_kubeconfigs_token_refreshed_by_the_client_is_read_at_each_request():
    config = configuration(BearerToken="Bearer old")
    tokens = iter(["Bearer new-1", "Bearer new-2"])
    config.refresh_api_key_hook = lambda c: c.api_key.update(BearerToken=next(tokens))
    kube = Kube(Credentials.from_client_configuration(config))
    assert kube._headers(None)["authorization"] == "Bearer new-1"
    assert kube._headers(None)["authorization"] == "Bearer new-2"


def test_client_certificates_send_no_token_and_reads_no_content_type():
    kube = Kube(Credentials.from_client_configuration(configuration()))
    assert kube._headers(None) == {"Accept": "application/json"}


def test_the_operator_runs_without_importing_the_kubernetes_client():
    """17 MiB of idle memory: only a kubeconfig (outside a pod) loads it."""
    done = subprocess.run([sys.executable, "-c", (
        "import sys, accelerate_operator.__main__, accelerate_operator.controller; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kubernetes', 'kopf')))")],
        capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
