"""kube.py's use of the official client against a real HTTP server on loopback (aiohttp.web):
throttling (429 with Retry-After) and an unavailable server (503) are retried by the client's
transport as configured (with_retries), a refusal for good is not, every kind of call hands its
connection back for the next one, and a pod log whose multi-byte character the runtime cut is
read, not refused."""

from __future__ import annotations

import asyncio

import pytest
from accelerate_operator.kube import ApiException, Kube, Rejected, with_retries
from aiohttp import web
from kubernetes import client

CONFIGMAP = {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": "cm", "namespace": "ml"}, "data": {"k": "v"}}


async def serve(answers: list[tuple[int, dict[str, str], bytes]], work,
                connections: set | None = None):
    """`work(kube)` against a loopback server that gives each request the next answer (status,
    headers, body); returns what `work` returned and the requests' (method, path). The client
    ends of the connections the requests came on are added to `connections`."""
    seen: list[tuple[str, str]] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append((request.method, request.path))
        if connections is not None:
            connections.add(request.transport.get_extra_info("peername"))
        status, headers, body = answers.pop(0) if answers else (200, {}, b"{}")
        return web.Response(status=status, headers=headers, body=body,
                            content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    kube = Kube(client.ApiClient(with_retries(client.Configuration(
        host=f"http://127.0.0.1:{port}"))))
    try:
        return await work(kube), seen
    finally:
        await kube.close()
        await runner.cleanup()


def test_throttling_and_an_unavailable_server_are_retried_after_retry_after():
    answers = [(429, {"Retry-After": "0"}, b"{}"), (503, {"Retry-After": "0"}, b"{}"),
               (201, {}, b"{}")]
    created, seen = asyncio.run(serve(answers, lambda kube: kube.create_if_absent(CONFIGMAP)))
    assert created is True
    assert seen == [("POST", "/api/v1/namespaces/ml/configmaps")] * 3


def test_a_refusal_for_good_is_not_retried_and_names_the_servers_reason():
    status = b'{"kind": "Status", "message": "exceeded quota: compute"}'
    with pytest.raises(Rejected, match="exceeded quota: compute") as refused:
        asyncio.run(serve([(403, {}, status)], lambda kube: kube.create_if_absent(CONFIGMAP)))
    assert refused.value.kind == "ConfigMap"  # the job fails as ConfigMapRejected


def test_an_existing_child_is_kept_and_a_server_error_is_raised():
    created, _ = asyncio.run(serve([(409, {}, b"{}")],
                                   lambda kube: kube.create_if_absent(CONFIGMAP)))
    assert created is False
    with pytest.raises(ApiException):
        asyncio.run(serve([(500, {}, b"{}")], lambda kube: kube.create_if_absent(CONFIGMAP)))


def test_every_call_hands_its_connection_back_for_the_next():
    """An answer left unread keeps its connection out of the pool: the next request would
    open a new one (a TLS handshake on a real API server) for every status write."""
    connections: set = set()

    async def calls(kube: Kube) -> None:
        for _ in range(3):
            await kube.patch_job_status("ml", "llm", {"phase": "Running"})
            await kube.tell_attempt("ml", "llm-0", 1)
            await kube.delete_pod("ml", "llm-1")
            await kube.read_node("node-1")
            await kube.create_if_absent(CONFIGMAP)
            await kube.delete_job("ml", "llm")

    _, seen = asyncio.run(serve([], calls, connections))
    assert len(seen) == 18
    assert len(connections) == 1


def test_a_log_with_a_cut_multibyte_character_is_read_not_refused():
    """tqdm's bar (U+2588, three bytes) cut by the container runtime's line split."""
    bar = "\u2588".encode()
    log = b"step 1 " + bar * 3 + bar[:2] + b"\nACCELERATE_PROGRESS {\"step\": 2}\n"
    text, seen = asyncio.run(serve([(200, {}, log)], lambda kube: kube.read_pod_log(
        "ml", "llm-0", 100, container="trainer")))
    assert seen == [("GET", "/api/v1/namespaces/ml/pods/llm-0/log")]
    assert text.endswith('ACCELERATE_PROGRESS {"step": 2}\n')
    assert "\ufffd" in text  # the cut character, replaced
