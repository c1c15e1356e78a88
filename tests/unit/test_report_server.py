"""The report endpoint served for real (aiohttp over TLS on localhost, real HTTPS clients and raw
sockets), with the operator's Controller holding indexes as kopf's would and tokens signed by a
key made in the test (the API server's keys, as report_tokens fetches them): each answer, that
only an answer 200 changes what the passes read, that a report taken queues the job's pass, and
what a slow, idle or greedy client gets (short deadlines, so the tests stay fast)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import ssl
import time

import aiohttp
from accelerate_operator.controller import Controller
from accelerate_operator.pod_state import read_pod_state
from accelerate_operator.reconciler import Reconciler
from accelerate_operator.report_checks import parse_body
from accelerate_operator.report_keeper import server_context
from accelerate_operator.report_listener import Bounds
from accelerate_operator.report_server import Limits, ReportServer
from accelerate_operator.report_settings import PROGRESS_WRITE_SECONDS
from accelerate_operator.report_tls import renew
from accelerate_operator.report_tokens import Caller, IssuerKeys
from accelerate_trainer.contract import MAX_BODY_BYTES, NEXT_REPORT_SECONDS

from tests.helpers.fake_kube import FakeKube
from tests.helpers.tokens import TestIssuer

KEY = ("ml", "train")
PATH = "/apis/accelerate-operator.io/v1alpha1/namespaces/{}/acceleratejobs/{}/status"
MATERIAL = renew(None, ["localhost"], dt.datetime.now(dt.timezone.utc))
PROGRESS = {"acceleratePodReport": {"progress": {"step": 3},
                                    "lastOutputTime": "2026-01-01T00:00:00Z"}}
EXIT = {"acceleratePodReport": {"attempt": 0, "exit": {"attempt": 0, "exitCode": 1}}}


ISSUER = TestIssuer(kind="EC")
TOKENS = {f"token-{i}": ISSUER.token(pod=f"train-{i}", uid=f"uid-{i}") for i in range(2)}
FAST = Limits(bounds=Bounds(connections=6, connections_per_peer=4, handshake_seconds=0.5,
                            header_seconds=0.3, idle_seconds=1.0), body_seconds=0.5,
              linger_seconds=0.3)


def pod(index: int, uid: str) -> dict:
    return {"metadata": {"name": f"train-{index}", "namespace": "ml", "uid": uid, "labels": {
        "accelerate-operator.io/node-index": str(index), "accelerate-operator.io/attempt": "0"},
        "ownerReferences": [{"kind": "AccelerateJob", "uid": "job-uid", "controller": True}]},
        "status": {"phase": "Running"}}


class Keys:
    """The API server's keys, counting the fetches."""

    def __init__(self):
        self.calls = 0

    async def fetch(self):
        self.calls += 1
        return ISSUER.documents()


def controller() -> Controller:
    kube = FakeKube()
    made = Controller(kube, Reconciler(kube))
    made.indexes = {
        "job_bodies": {KEY: [{"metadata": {"name": "train", "namespace": "ml",
                                           "uid": "job-uid"}, "spec": {"numNodes": 2},
                              "status": {}}]},
        "job_pods": {KEY: [("job-uid", read_pod_state(pod(i, f"uid-{i}"))) for i in range(2)]},
    }
    return made


async def serve(run, limits: Limits = FAST):
    """Run `run(post, made, keys)` (`run(post, made, keys, port)` when it takes four) against
    a served endpoint."""
    made, keys = controller(), Keys()
    server = ReportServer(lambda: made, IssuerKeys(keys.fetch, time.monotonic), limits)
    port = await server.start("127.0.0.1", 0, server_context(MATERIAL))
    client = ssl.create_default_context(cadata=MATERIAL.ca_certs)

    async def post(document, token="token-0", job="train", namespace="ml", raw=None):
        headers = {"Authorization": f"Bearer {TOKENS.get(token, token)}"} if token else {}
        data = raw if raw is not None else json.dumps(document).encode()
        async with aiohttp.ClientSession() as session, session.post(
                f"https://localhost:{port}{PATH.format(namespace, job)}", data=data,
                headers=headers, ssl=client) as answer:
            return answer.status, answer.headers.get("Retry-After"), await answer.json()

    try:
        if run.__code__.co_argcount == 4:
            await run(post, made, keys, port)
        else:
            await run(post, made, keys)
    finally:
        await server.stop()


def run(test):
    asyncio.run(serve(test))


def test_pod_0s_report_is_taken_queued_and_read_by_the_pass():
    async def test(post, made, reviews):
        assert await post(PROGRESS) == (200, None, {
            "kind": "Status", "apiVersion": "v1", "code": 200, "status": "Success",
            "message": "taken", "nextReportSeconds": PROGRESS_WRITE_SECONDS})
        assert len(made.queue) == 1
        pods = made.pods_of(KEY, "job-uid")
        assert json.loads(pods[0].report)["progress"] == {"step": 3}
        assert pods[1].report is None
        await post(PROGRESS)
        assert reviews.calls == 1  # the keys are fetched once, no call per token
    run(test)


class Queued:
    """The controller's work queue, recording when each pass was asked for."""

    paused = False

    def __init__(self):
        self.asked = []

    def add(self, key):
        self.asked.append("now")

    def add_after(self, key, seconds):
        self.asked.append(f"in {seconds:g} s")


def test_a_report_queues_a_pass_at_once_for_a_decision_and_for_its_write_for_progress():
    made, clock = controller(), [100.0]
    made.clock, made.queue = lambda: clock[0], Queued()
    made.states.get(KEY, "job-uid").next_progress_write = 106.0  # written at 96
    pod_0, pod_1 = (made.report_pod(KEY, Caller("ml", f"train-{i}", f"uid-{i}", 0.0))
                    for i in range(2))

    def take(pod, **report):
        made.take_report(KEY, pod, parse_body(json.dumps({"acceleratePodReport": {
            "attempt": 0, "lastOutputTime": "2026-01-01T00:00:00Z", **report}}).encode()),
            dt.datetime.now(dt.timezone.utc))
        return made.queue.asked.pop() if made.queue.asked else None

    assert take(pod_0) is None  # alive, nothing to write
    assert take(pod_0, progress={"step": 1}) == "now"  # the first step ends the startup
    assert take(pod_0, progress={"step": 2}) == "in 6 s"  # when the write is due
    assert take(pod_0, progress={"step": 2}, lastOutputTime="2026-01-01T00:00:09Z") is None
    clock[0] = 107.0
    assert take(pod_0, progress={"step": 3}) == "in 0 s"
    assert take(pod_1, lastOutputTime=None, exit={"attempt": 0, "exitCode": 1}) == "now"


def test_pod_0_is_told_to_report_when_the_jobs_next_progress_write_falls_due():
    made, clock = controller(), [100.0]
    made.clock, made.queue = lambda: clock[0], Queued()
    made.reconciler.applier.progress_write_seconds = 5.0
    state = made.states.get(KEY, "job-uid")
    pod_0, pod_1 = (made.report_pod(KEY, Caller("ml", f"train-{i}", f"uid-{i}", 0.0))
                    for i in range(2))

    def pace(pod, **report):
        return made.take_report(KEY, pod, parse_body(json.dumps({"acceleratePodReport": {
            "attempt": 0, "lastOutputTime": "2026-01-01T00:00:00Z", **report}}).encode()),
            dt.datetime.now(dt.timezone.utc))

    state.next_progress_write = 106.0  # the last write was at 96: this report's waits 6 s
    assert pace(pod_0, progress={"step": 2}) == 11.0
    state.next_progress_write = 0.0  # written as it comes
    assert pace(pod_0, progress={"step": 3}) == 5.0
    assert pace(pod_1, lastOutputTime=None, exit={"attempt": 0, "exitCode": 1}) is None
    # Signs of life still come twice per least stall timeout.
    made.reconciler.applier.progress_write_seconds = 60.0
    assert pace(pod_0, progress={"step": 4}) == NEXT_REPORT_SECONDS[1]


def test_every_refusal_leaves_what_the_passes_read_as_it_was():
    async def test(post, made, reviews):
        cases = [
            (dict(document=PROGRESS, token=None), 401),
            (dict(document=PROGRESS, token="forged"), 401),
            (dict(document=PROGRESS, token=ISSUER.token(audience="https://kubernetes")), 401),
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


def test_a_flood_from_one_pod_gets_429_with_retry_after_and_its_neighbours_go_on():
    async def test(post, made, reviews):
        answers = [(await post(PROGRESS))[:2] for _ in range(12)]
        assert answers[:10] == [(200, None)] * 10
        assert answers[10] == (429, "1")
        assert (await post(EXIT, token="token-1"))[0] == 200  # pod 1: a budget of its own
    run(test)


def test_many_made_up_tokens_cost_no_api_call_and_spend_no_ones_budget():
    async def test(post, made, reviews):
        stranger = TestIssuer(kid=ISSUER.kid, kind="EC")  # the right key id, another key
        for i in range(30):
            junk = [f"junk-{i}", stranger.token(pod=f"p-{i}", uid=f"u-{i}")][i % 2]
            assert (await post(PROGRESS, token=junk))[0] == 401
        assert reviews.calls == 1  # the first keys fetch only
        assert (await post(PROGRESS))[0] == 200
    run(test)


def test_a_paused_replica_answers_503_and_takes_nothing():
    async def test(post, made, reviews):
        made.set_active(False)
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


# ---- what a slow, idle or greedy client gets -------------------------------------------------
CLIENT = ssl.create_default_context(cadata=MATERIAL.ca_certs)


async def tls(port: int, source: str = "127.0.0.1"):
    """A raw TLS connection to the endpoint: (reader, writer)."""
    return await asyncio.open_connection("127.0.0.1", port, ssl=CLIENT,
                                         server_hostname="localhost", local_addr=(source, 0))


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the server sent before it closed the connection, which it must do in `seconds`."""
    return await asyncio.wait_for(reader.read(), seconds)


def head(length: int, token: str = "token-0") -> bytes:
    return (f"POST {PATH.format('ml', 'train')} HTTP/1.1\r\nHost: localhost\r\n"
            f"Authorization: Bearer {TOKENS[token]}\r\nContent-Length: {length}\r\n\r\n"
            ).encode()


def test_a_request_head_sent_a_byte_at_a_time_is_cut_off_at_the_header_deadline():
    async def test(post, made, keys, port):
        reader, writer = await tls(port)
        started = time.monotonic()
        writer.write(b"POST / HTTP/1.1\r\n")
        with_bytes = asyncio.ensure_future(closed_within(reader, 3.0))
        for byte in b"X-Slow: " + b"a" * 100:  # one byte every 0.1 s: 10 s in all
            if with_bytes.done():
                break
            writer.write(bytes([byte]))
            await asyncio.sleep(0.1)
        assert await with_bytes == b""
        # the header deadline (0.3 s), not the client's pace nor the idle time (1 s)
        assert time.monotonic() - started < 0.8
    run_with_port(test)


def test_a_body_that_comes_too_slowly_gets_408_and_the_connection_closes():
    async def test(post, made, keys, port):
        reader, writer = await tls(port)
        writer.write(head(200) + b'{"acceleratePodReport":')
        answer = await closed_within(reader, 3.0)
        assert answer.startswith(b"HTTP/1.1 408")
        assert made.pods_of(KEY, "job-uid")[0].report is None
    run_with_port(test)


def test_a_bad_token_is_refused_before_the_body_is_waited_for():
    async def test(post, made, keys, port):
        reader, writer = await tls(port)
        started = time.monotonic()
        writer.write(head(100).replace(TOKENS["token-0"].encode(), b"junk"))  # no body sent
        assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 401")
        assert time.monotonic() - started < 0.4  # not the body deadline (0.5 s)
        await closed_within(reader, 1.0)  # and closed: the handshake deadline (0.5 s)
    run_with_port(test)


def test_a_connection_that_never_starts_tls_is_closed_at_the_handshake_deadline():
    async def test(post, made, keys, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        assert await closed_within(reader, 3.0) == b""
        assert time.monotonic() - started < 1.5
    run_with_port(test)


def test_connections_past_the_caps_are_closed_before_any_tls_and_then_admitted_again():
    async def test(post, made, keys, port):
        one = [await tls(port) for _ in range(4)]  # 127.0.0.1's cap
        fifth, _ = await asyncio.open_connection("127.0.0.1", port)
        assert await closed_within(fifth, 0.3) == b""  # at once: no ServerHello, no deadline
        two = [await tls(port, "127.0.0.2") for _ in range(2)]  # the cap in all
        seventh, _ = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.3", 0))
        assert await closed_within(seventh, 0.3) == b""
        for _, writer in one + two:
            writer.close()
        await asyncio.sleep(0.1)
        assert (await post(PROGRESS))[0] == 200
    run_with_port(test)


def test_an_idle_connection_is_closed_after_the_keep_alive_and_any_refusal_at_once():
    async def test(post, made, keys, port):
        reader, writer = await tls(port)
        document = json.dumps(PROGRESS).encode()
        writer.write(head(len(document)) + document)
        assert (await reader.readuntil(b"taken")).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        await closed_within(reader, 3.0)
        assert time.monotonic() - started < 2.0  # idle 1 s, not aiohttp's default hour
        reader, writer = await tls(port)
        writer.write(head(len(document), "token-1") + document)  # progress from pod 1: 403
        answer = await closed_within(reader, 1.0)
        assert answer.startswith(b"HTTP/1.1 403") and b"Connection: close" in answer
    run_with_port(test)


def test_a_body_nested_past_the_parser_is_a_400_not_a_500():
    async def test(post, made, keys):
        assert (await post(None, raw=b"[" * 60_000))[0] == 400
        assert (await post(None, raw=b'{"acceleratePodReport":' + b"[" * 60_000))[0] == 400
    run(test)


def run_with_port(test):
    asyncio.run(serve(test))
