"""The report endpoint served for real (aiohttp over TLS on localhost, a real HTTPS client),
with the operator's Controller holding indexes as kopf's would and a stand-in for the API
server's TokenReview: each answer, that only an answer 200 changes what the passes read, and
that a report taken queues the job's pass."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import ssl

import aiohttp
from accelerate_operator.controller import Controller
from accelerate_operator.pod_state import read_pod_state
from accelerate_operator.reconciler import Reconciler
from accelerate_operator.report_keeper import server_context
from accelerate_operator.report_server import ReportServer
from accelerate_operator.report_tls import renew
from accelerate_trainer.contract import MAX_BODY_BYTES, REPORT_AUDIENCE

from tests.helpers.fake_kube import FakeKube

KEY = ("ml", "train")
PATH = "/apis/accelerate-operator.io/v1alpha1/namespaces/{}/acceleratejobs/{}/status"
MATERIAL = renew(None, ["localhost"], dt.datetime.now(dt.timezone.utc))
PROGRESS = {"acceleratePodReport": {"progress": {"step": 3},
                                    "lastOutputTime": "2026-01-01T00:00:00Z"}}


def pod(index: int, uid: str) -> dict:
    return {"metadata": {"name": f"train-{index}", "namespace": "ml", "uid": uid, "labels": {
        "accelerate-operator.io/node-index": str(index), "accelerate-operator.io/attempt": "0"}},
        "status": {"phase": "Running"}}


class Reviews:
    """The API server's TokenReview, for the tokens the test hands out."""

    def __init__(self):
        self.calls = 0
        self.tokens = {f"token-{i}": (f"train-{i}", f"uid-{i}") for i in range(2)}

    async def review_token(self, token: str) -> dict:
        self.calls += 1
        if token not in self.tokens:
            return {"authenticated": False}
        name, uid = self.tokens[token]
        return {"authenticated": True, "audiences": [REPORT_AUDIENCE], "user": {
            "username": "system:serviceaccount:ml:default",
            "extra": {"authentication.kubernetes.io/pod-name": [name],
                      "authentication.kubernetes.io/pod-uid": [uid]}}}


def controller() -> Controller:
    kube = FakeKube()
    made = Controller(kube, Reconciler(kube))
    made.indexes = {
        "job_bodies": {KEY: [{"metadata": {"name": "train", "namespace": "ml",
                                           "uid": "job-uid"}, "spec": {}, "status": {}}]},
        "job_pods": {KEY: [("job-uid", read_pod_state(pod(i, f"uid-{i}"))) for i in range(2)]},
    }
    return made


async def serve(run):
    """Run `run(post, made, reviews)` against a served endpoint."""
    made, reviews = controller(), Reviews()
    server = ReportServer(lambda: made, reviews)
    port = await server.start("127.0.0.1", 0, server_context(MATERIAL))
    client = ssl.create_default_context(cadata=MATERIAL.ca_certs)

    async def post(document, token="token-0", job="train", namespace="ml", raw=None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        data = raw if raw is not None else json.dumps(document).encode()
        async with aiohttp.ClientSession() as session, session.post(
                f"https://localhost:{port}{PATH.format(namespace, job)}", data=data,
                headers=headers, ssl=client) as answer:
            return answer.status, answer.headers.get("Retry-After"), await answer.json()

    try:
        await run(post, made, reviews)
    finally:
        await server.stop()


def run(test):
    asyncio.run(serve(test))


def test_pod_0s_report_is_taken_queued_and_read_by_the_pass():
    async def test(post, made, reviews):
        assert await post(PROGRESS) == (200, None, {"kind": "Status", "apiVersion": "v1",
                                                    "code": 200, "status": "Success",
                                                    "message": "taken"})
        assert len(made.queue) == 1
        pods = made.pods_of(KEY, "job-uid")
        assert json.loads(pods[0].report)["progress"] == {"step": 3}
        assert pods[1].report is None
        await post(PROGRESS)
        assert reviews.calls == 1  # the token's review is cached
    run(test)


def test_every_refusal_leaves_what_the_passes_read_as_it_was():
    async def test(post, made, reviews):
        cases = [
            (dict(document=PROGRESS, token=None), 401),
            (dict(document=PROGRESS, token="forged"), 401),
            (dict(document=PROGRESS, token="token-1"), 403),  # progress from pod 1
            (dict(document=PROGRESS, job="other"), 404),
            (dict(document=None, raw=b"{oops"), 400),
            (dict(document=None, raw=b"x" * (MAX_BODY_BYTES + 1)), 413),
        ]
        for kwargs, code in cases:
            status, _, answer = await post(**kwargs)
            assert (status, answer["code"], answer["status"]) == (code, code, "Failure"), kwargs
        assert [p.report for p in made.pods_of(KEY, "job-uid")] == [None, None]
        assert len(made.queue) == 0
    run(test)


def test_a_flood_from_one_pod_gets_429_with_retry_after_before_any_review():
    async def test(post, made, reviews):
        answers = [(await post(PROGRESS, token="flood"))[:2] for _ in range(12)]
        assert answers[:10] == [(401, None)] * 10
        assert answers[10] == (429, "1")
        assert reviews.calls == 1  # refusals are cached too; the flood costs one review
    run(test)


def test_a_paused_replica_answers_503_and_takes_nothing():
    async def test(post, made, reviews):
        made.queue.paused = True
        assert (await post(PROGRESS))[:2] == (503, "5")
        assert reviews.calls == 0
        assert made.pods_of(KEY, "job-uid")[0].report is None
    run(test)


def test_a_client_that_trusts_another_ca_does_not_send():
    async def test(post, made, reviews):
        other = renew(None, ["localhost"], dt.datetime.now(dt.timezone.utc))
        impostor = ReportServer(lambda: made, reviews)
        port = await impostor.start("127.0.0.1", 0, server_context(other))
        client = ssl.create_default_context(cadata=MATERIAL.ca_certs)
        try:
            async with aiohttp.ClientSession() as session:
                await session.post(f"https://localhost:{port}{PATH.format('ml', 'train')}",
                                   json=PROGRESS, ssl=client)
        except aiohttp.ClientConnectorCertificateError:
            assert reviews.calls == 0
            return
        finally:
            await impostor.stop()
        raise AssertionError("the handshake with a certificate of another CA succeeded")
    run(test)
