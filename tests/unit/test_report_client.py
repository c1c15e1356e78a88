"""The pod's report client (accelerate_trainer.report_client) and what the supervisor's Pusher
does with each answer, against a real HTTPS stand-in for the operator's endpoint
(tests/helpers/report_endpoint.py): the bearer token is re-read after the kubelet rotates it, the
endpoint's certificate and host name are checked against the pod's CA file (and a rotated CA is
used), a kept-alive connection the server closed is opened again, 429/503 wait their
Retry-After, the newest report replaces one that waits, a failed launch's exit is sent until it
is taken, and each distinct refusal is said once."""

from __future__ import annotations

import os
import shutil
import ssl
import time
from pathlib import Path

import pytest
from accelerate_trainer import report_push
from accelerate_trainer.contract import ENV_REPORT_URL, NEXT_REPORT_SECONDS, REPORT_BODY_KEY
from accelerate_trainer.report_client import (
    RETRY_AFTER_MAX,
    Answer,
    BadReportURL,
    ReportClient,
    parse_retry_after,
    read_answer,
)
from accelerate_trainer.report_push import Pusher, Reports, Snapshot, encode

from tests.helpers.report_endpoint import DROP, PATH, ReportEndpoint

REPORT = encode(Snapshot({"step": 3}, 1000.0))


@pytest.fixture
def servers():
    started: list[ReportEndpoint] = []
    yield started
    for server in started:
        server.stop()


def serve(servers, cert, answers=None) -> ReportEndpoint:
    servers.append(ReportEndpoint(cert, answers))
    return servers[-1]


def volume(directory: Path, ca: Path | None, token: str = "token-1") -> Path:
    """The pod's projected volume, written as the kubelet swaps files: a new file each time
    (the CA only when `ca` is given)."""
    directory.mkdir(exist_ok=True)
    for name, write in (("token", lambda p: p.write_text(token + "\n")),
                        ("ca.crt", lambda p: shutil.copy(ca, p))):
        if name == "ca.crt" and ca is None:
            continue
        fresh = directory / f".{name}.new"
        write(fresh)
        os.replace(fresh, directory / name)
    return directory


def test_a_report_goes_with_the_token_read_again_after_rotation_on_one_connection(
        tmp_path, pki, servers):
    server = serve(servers, pki.cert)
    client = ReportClient(server.url(), volume(tmp_path / "report", pki.ca))
    assert client.post_report(REPORT).status == 200
    volume(tmp_path / "report", None, token="token-2")  # the kubelet renewed it
    assert client.post_report(REPORT).status == 200
    assert [headers["Authorization"] for _, headers, _ in server.requests] == [
        "Bearer token-1", "Bearer token-2"]
    path, _, body = server.requests[0]
    assert path == PATH and body == {REPORT_BODY_KEY: {
        "progress": {"step": 3}, "lastOutputTime": "1970-01-01T00:16:40.000Z"}}
    assert server.connections == 1
    volume(tmp_path / "report", pki.ca, token="token-2")  # the CA file swapped: verified anew
    assert client.post_report(REPORT).status == 200
    assert server.connections == 2


def test_an_endpoint_the_ca_did_not_sign_or_named_otherwise_is_refused_until_the_ca_rotates(
        tmp_path, pki, servers):
    other_ca = serve(servers, pki.cert_other_ca)
    client = ReportClient(other_ca.url(), volume(tmp_path / "report", pki.ca))
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        client.post_report(REPORT)
    other_host = serve(servers, pki.cert_other_host)
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        ReportClient(other_host.url(), tmp_path / "report").post_report(REPORT)
    assert other_ca.requests == [] and other_host.requests == []
    volume(tmp_path / "report", pki.other_ca)  # the operator's CA rotated: the file changes
    assert client.post_report(REPORT).status == 200
    assert len(other_ca.requests) == 1


def test_a_connection_the_server_closed_is_opened_again(tmp_path, pki, servers):
    server = serve(servers, pki.cert, [(200, {}), DROP, (200, {"Connection": "close"})])
    client = ReportClient(server.url(), volume(tmp_path / "report", pki.ca))
    assert [client.post_report(REPORT).status for _ in range(3)] == [200, 200, 200]
    assert server.connections == 3  # kept alive, dropped, closed by its answer
    assert len(server.requests) == 4  # the dropped one was sent again


def test_the_env_names_the_endpoint_and_a_bad_url_is_said(tmp_path, pki):
    directory = volume(tmp_path / "report", pki.ca)
    url = "https://svc.ns.svc:8443" + PATH
    assert ReportClient.from_env({}, str(directory)) is None
    assert ReportClient.from_env({ENV_REPORT_URL: url}, str(tmp_path)) is None  # no token
    client = ReportClient.from_env({ENV_REPORT_URL: url}, str(directory))
    assert (client.host, client.port, client.path) == ("svc.ns.svc", 8443, PATH)
    with pytest.raises(BadReportURL, match=ENV_REPORT_URL):
        ReportClient.from_env({ENV_REPORT_URL: "http://svc.ns.svc" + PATH}, str(directory))
    assert [parse_retry_after(v) for v in ("2", "0.5", "-1", "9999", "soon", None)] == [
        2.0, 0.5, 0.0, RETRY_AFTER_MAX, None, None]


def test_the_next_report_time_of_an_answer_is_kept_within_its_bounds():
    low, high = NEXT_REPORT_SECONDS
    bodies = [b'{"message": "taken", "nextReportSeconds": 12}', b'{"nextReportSeconds": 0.2}',
              b'{"nextReportSeconds": 9999}', b'{"nextReportSeconds": "12"}',
              b'{"nextReportSeconds": true}', b'{"nextReportSeconds": NaN}',
              b'{"nextReportSeconds": 1' + b"0" * 400 + b"}", b"not json", b"[12]"]
    assert [read_answer(200, body, None).next_report for body in bodies] == [
        12.0, low, high, None, None, None, None, None, None]
    assert read_answer(200, bodies[0], None).message == "taken"
    assert read_answer(503, b"not json", "2") == Answer(503, "not json", 2.0)


# ---- what the Pusher does with each answer -------------------------------------------------

@pytest.fixture
def fast(monkeypatch):
    """Progress may go at every push, and a backoff is short: the answers decide."""
    monkeypatch.setattr(report_push, "PUSH_SECONDS", 0.0)
    monkeypatch.setattr(report_push, "QUIET_SECONDS", 0.0)
    monkeypatch.setattr(report_push, "BACKOFF_SECONDS", 0.05)
    monkeypatch.setattr(report_push, "BACKOFF_MAX_SECONDS", 0.2)


def pusher_for(server: ReportEndpoint, tmp_path: Path, ca: Path, progress: bool = True):
    reports = Reports(progress=progress)
    return reports, Pusher(reports, ReportClient(server.url(), volume(tmp_path / "r", ca)))


def step(reports: Reports, number: int) -> None:
    reports.feed(1, f'ACCELERATE_PROGRESS {{"step": {number}}}\n'.encode(), time.time())


def test_retry_after_is_waited_and_the_newest_report_replaces_the_one_that_waited(
        tmp_path, pki, servers, fast):
    server = serve(servers, pki.cert, [(429, {"Retry-After": "1"})])
    reports, pusher = pusher_for(server, tmp_path, pki.ca)
    step(reports, 1)
    pusher.push(final=False)
    step(reports, 2)
    step(reports, 3)
    pusher.push(final=False)  # within Retry-After: nothing is sent
    assert [r["progress"] for r in server.reports()] == [{"step": 1}]
    time.sleep(1.05)
    pusher.push(final=False)
    pusher.push(final=False)  # taken: nothing new to send
    assert [r["progress"] for r in server.reports()] == [{"step": 1}, {"step": 3}]


def test_the_pace_an_answer_gives_holds_back_the_next_progress(tmp_path, pki, servers):
    server = serve(servers, pki.cert, [(200, {}, {"nextReportSeconds": 12})])
    reports, pusher = pusher_for(server, tmp_path, pki.ca)
    step(reports, 1)
    pusher.push(final=False)
    step(reports, 2)
    pusher.push(final=False)  # not PUSH_SECONDS later: 12 s
    assert [r["progress"] for r in server.reports()] == [{"step": 1}]
    assert reports.pace == 12.0


def test_a_failed_launchs_exit_is_sent_until_it_is_taken(tmp_path, pki, servers, fast, capsys):
    server = serve(servers, pki.cert, [(503, {"Retry-After": "0"}), (503, {}), (502, {}),
                                       (429, {"Retry-After": "0.1"})])
    reports, pusher = pusher_for(server, tmp_path, pki.ca, progress=False)
    reports.launched(4)
    reports.ended(4, 1, time.time())
    deadline = time.monotonic() + 10
    while len(server.requests) < 5 and time.monotonic() < deadline:
        pusher.push(final=False)
        time.sleep(0.01)
    for _ in range(20):
        pusher.push(final=False)  # taken: not sent again
    assert [r["exit"]["attempt"] for r in server.reports()] == [4] * 5
    said = capsys.readouterr().err
    assert said.count("answered 503") == 1 and "answered 502" in said
    assert "takes reports again" in said


def test_each_distinct_refusal_is_said_once_and_newer_reports_still_go(
        tmp_path, pki, servers, fast, capsys):
    server = serve(servers, pki.cert, [(401, {}), (401, {}), (413, {}), (401, {}), (200, {}),
                                       (401, {})])
    reports, pusher = pusher_for(server, tmp_path, pki.ca)
    for number in range(1, 7):
        step(reports, number)
        pusher.push(final=False)
        pusher.push(final=False)  # a refused report is not sent again
    assert [r["progress"]["step"] for r in server.reports()] == [1, 2, 3, 4, 5, 6]
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" answered ")[1][:3] for line in lines if " answered " in line] == [
        "401", "413", "401"]  # said again only after a report was taken in between
    assert all("training goes on" in line for line in lines if " answered " in line)
