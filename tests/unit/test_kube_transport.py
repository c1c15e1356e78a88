"""kube.py's transport against a real HTTP server on loopback (aiohttp.web): the credentials
are kopf's ConnectionInfo (its headers), a 401 logs in again once and retries, a 429/503 is
retried after the server's Retry-After, concurrent first requests share one login, URLs keep
the server's path and encode each query value once, and the operator's modules do not import
the official client (17 MiB of idle memory)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import kopf
from accelerate_operator.kube import ApiError, Kube
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]


class Server:
    """Answers each request with the next canned (status, headers) and records what came."""

    def __init__(self, answers: list[tuple[int, dict[str, str]]]):
        self.answers = list(answers)
        self.seen: list[tuple[str, str | None]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, request.headers.get("Authorization")))
        status, headers = self.answers.pop(0) if self.answers else (200, {})
        return web.json_response({"kind": "Status", "message": "canned"}, status=status,
                                 headers=headers)


async def serve(handle, work):
    """`work(url)` against a loopback server that answers every request with `handle`."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await work(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def logins(url: str, tokens: list[str]):
    """A login that hands out the next token each time, as kopf's would after a rotation."""
    count = {"n": 0}

    async def login() -> kopf.ConnectionInfo:
        token = tokens[min(count["n"], len(tokens) - 1)]
        count["n"] += 1
        await asyncio.sleep(0.01)
        return kopf.ConnectionInfo(server=url, scheme="Bearer", token=token)
    return login, count


def test_kopfs_credentials_become_the_authorization_header_and_a_401_logs_in_again():
    server = Server([(401, {}), (200, {})])

    async def work(url):
        login, count = logins(url, ["old", "rotated"])
        kube = Kube(login)
        await kube.delete_pod("ml", "llm-0")
        await kube.close()
        return count["n"]

    assert asyncio.run(serve(server.handle, work)) == 2
    assert server.seen == [("/api/v1/namespaces/ml/pods/llm-0", "Bearer old"),
                           ("/api/v1/namespaces/ml/pods/llm-0", "Bearer rotated")]


def test_a_second_401_is_an_error_not_a_loop():
    server = Server([(401, {}), (401, {})])

    async def work(url):
        login, _ = logins(url, ["a", "b"])
        kube = Kube(login)
        try:
            await kube.delete_pod("ml", "llm-0")
        except ApiError as error:
            return error.status
        finally:
            await kube.close()

    assert asyncio.run(serve(server.handle, work)) == 401
    assert len(server.seen) == 2


def test_throttling_is_retried_after_the_servers_retry_after():
    server = Server([(429, {"Retry-After": "0"}), (503, {"Retry-After": "0"}), (201, {})])

    async def work(url):
        kube = Kube.from_connection(kopf.ConnectionInfo(server=url, token="t", scheme="Bearer"))
        created = await kube.create_if_absent({"kind": "ConfigMap", "metadata": {
            "name": "c", "namespace": "ml"}})
        await kube.close()
        return created

    assert asyncio.run(serve(server.handle, work)) is True
    assert len(server.seen) == 3


def test_concurrent_first_requests_share_one_login():
    server = Server([])

    async def work(url):
        login, count = logins(url, ["t"])
        kube = Kube(login)
        await asyncio.gather(*(kube.delete_pod("ml", f"p-{i}") for i in range(8)))
        await kube.close()
        return count["n"]

    assert asyncio.run(serve(server.handle, work)) == 1
    assert len(server.seen) == 8


def test_the_operator_runs_without_the_kubernetes_client_installed():
    """17 MiB of idle memory: kopf imports the official client whenever it is installed, so the
    operator's image does not install it (pyproject's `operator` extra), and nothing of the
    operator needs it: here it is made unimportable, as in the image."""
    done = subprocess.run([sys.executable, "-c", (
        "import sys; sys.modules['kubernetes'] = None; "
        "import accelerate_operator.__main__, accelerate_operator.handlers, kopf; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes'))")],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            str(ROOT / part) for part in ("operator", "trainer"))})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['kubernetes']"  # only the blocked entry itself
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    image = project["dependencies"] + project["optional-dependencies"]["operator"]
    assert not [d for d in image if d.startswith("kubernetes")]


def test_urls_keep_the_servers_path_and_encode_each_query_value_once():
    """A kubeconfig may name a server behind a path (Rancher's /k8s/clusters/<id>), and a label
    selector or a continue token holds characters a query must encode (`=`, `,`, `+`, `/`).
    kube.py builds its URLs with yarl's URL.build (whose URLs stay out of yarl's cache); the
    server must read back exactly the values that were sent, each encoded once."""
    seen: list[tuple[str, dict[str, str]]] = []
    token = "eyJ2IjoibWV0YS5rOHMuaW8vdjEi+/=="
    selector = "accelerate-operator.io/job in (a,b),tier=x"

    async def handle(request: web.Request) -> web.Response:
        seen.append((request.path, dict(request.query)))
        page = {"continue": token} if len(seen) == 1 else {}
        return web.json_response({"metadata": page, "items": [
            {"metadata": {"namespace": "ml", "name": f"p{len(seen)}"}}]})

    async def work(url):
        kube = Kube.from_connection(kopf.ConnectionInfo(server=f"{url}/k8s/clusters/c-1/"))
        try:
            return [name async for name in kube.list_names("/api/v1/pods", selector)]
        finally:
            await kube.close()

    assert asyncio.run(serve(handle, work)) == [("ml", "p1"), ("ml", "p2")]
    assert seen == [("/k8s/clusters/c-1/api/v1/pods", {"labelSelector": selector, "limit": "500"}),
                    ("/k8s/clusters/c-1/api/v1/pods",
                     {"labelSelector": selector, "limit": "500", "continue": token})]


def test_a_log_with_a_cut_multibyte_character_is_read_not_refused():
    """A pod log is the user's bytes: tqdm's bar (U+2588, three bytes) cut by the container
    runtime made aiohttp's strict decoding refuse every read of rank 0's log, so PROGRESS
    stopped in an e2e run while the job trained on. The read keeps the rest of the log."""
    from aiohttp.test_utils import TestServer

    body = ("100%|\u2588\u2588".encode() + b"\xe2\x96" + b"| 2997/3000\n"
            + b'ACCELERATE_PROGRESS {"step": 3000, "total_steps": 3000}\n')

    async def log(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain")

    async def go() -> str:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/ml/pods/llm-0/log", log)
        async with TestServer(app) as server:
            kube = Kube.from_connection(kopf.ConnectionInfo(server=str(server.make_url(""))))
            try:
                return await kube.read_pod_log("ml", "llm-0", 2000)
            finally:
                await kube.close()

    text = asyncio.run(go())
    assert text.endswith('ACCELERATE_PROGRESS {"step": 3000, "total_steps": 3000}\n')
    assert "\ufffd" in text  # the cut character, replaced
