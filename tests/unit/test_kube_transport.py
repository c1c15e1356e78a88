"""kube.py's transport: the credentials the official client found become the request's headers
(an in-cluster token must reach the API server, else every call is system:anonymous)."""

from __future__ import annotations

import kubernetes
from accelerate_operator.kube import Kube


def configuration(**api_key: str) -> kubernetes.client.Configuration:
    config = kubernetes.client.Configuration()
    config.host = "https://10.96.0.1:443"
    config.api_key = dict(api_key)
    return config


def test_in_cluster_token_becomes_the_authorization_header():
    config = configuration(BearerToken="Bearer abc.def")  # as load_incluster_config sets it
    assert Kube(config)._headers("application/json") == {
        "Accept": "application/json", "Content-Type": "application/json",
        "authorization": "Bearer abc.def"}


def test_a_rotated_token_is_read_at_each_request():
    config = configuration(BearerToken="Bearer old")
    tokens = iter(["Bearer new-1", "Bearer new-2"])
    config.refresh_api_key_hook = lambda c: c.api_key.update(BearerToken=next(tokens))
    kube = Kube(config)
    assert kube._headers(None)["authorization"] == "Bearer new-1"
    assert kube._headers(None)["authorization"] == "Bearer new-2"


def test_client_certificates_send_no_token_and_reads_no_content_type():
    assert Kube(configuration())._headers(None) == {"Accept": "application/json"}
