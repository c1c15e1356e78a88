"""The transport under client.py: the official client configured for the operator (credentials,
retries of throttling and an unavailable server, its connection pool), and reading an answer
whole so its connection goes back to the pool."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.util.retry import Retry

# Threads (and so connections) for API calls: as many as a pass has creates in flight.
CONNECTIONS = 16
# A 429 or 503 is retried this many times, after the server's Retry-After.
RETRIES = 3
T = TypeVar("T")


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


def read_whole(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`call`, and with `_preload_content=False` its answer read whole (kept in `.data`) and
    its connection handed back to the pool (client.py says why)."""
    result = call(*args, **kwargs)
    if kwargs.get("_preload_content") is False:
        result.data  # noqa: B018 - reading is the point: urllib3 caches the body here
        result.release_conn()
    return result


async def ignore_gone(call: Any) -> Any:
    """A call on an object that may be gone meanwhile: 404 is nothing to do (None)."""
    try:
        return await call
    except ApiException as error:
        if error.status != 404:
            raise
        return None
