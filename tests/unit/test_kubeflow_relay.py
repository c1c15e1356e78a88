"""The in-pod relay that turns transformers' KubeflowCallback POSTs into our progress lines: the
validation (pure), the HTTP server (real POSTs, bad ones included), the process the trainer
starts before its exec, and a real tiny `transformers.Trainer` run reporting through it with no
code of ours in the script."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest
from accelerate_operator.progress import build_progress_status
from accelerate_trainer.contract import PROGRESS_LINE
from accelerate_trainer.kubeflow_relay import (
    MAX_BODY,
    BadReport,
    RelayState,
    TrainerStatus,
    build_server,
    parse_trainer_status,
    start_relay,
)

from tests.helpers.reports import pushed_progress

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret"


def body(**status) -> bytes:
    return json.dumps({"trainerStatus": status}).encode()


def metrics(**values) -> list[dict[str, str]]:
    return [{"name": name, "value": str(value)} for name, value in values.items()]


# ---- validation (pure) ------------------------------------------------------------------------

def test_a_step_report_as_transformers_sends_it_is_parsed():
    status = parse_trainer_status(body(
        progressPercentage=40, estimatedRemainingSeconds=12, lastUpdatedTime="2026-01-01T00:00:00",
        metrics=metrics(loss=0.5, learning_rate=0.001, current_step=4, total_steps=10,
                        current_epoch=0.4)))
    assert status == TrainerStatus(40.0, 12, {"loss": 0.5, "learning_rate": 0.001,
                                              "current_step": 4.0, "total_steps": 10.0,
                                              "current_epoch": 0.4})


@pytest.mark.parametrize(("raw", "reason"), [
    (b"{not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[]", "no trainerStatus"),
    (json.dumps({"trainerStatus": 5}).encode(), "no trainerStatus"),
    (body(progressPercentage=101), "outside 0-100"),
    (body(progressPercentage=-1), "outside 0-100"),
    (body(progressPercentage="NaN"), "finite"),
    (body(progressPercentage=True), "not a number"),
    (body(estimatedRemainingSeconds=-5), "out of range"),
    (body(estimatedRemainingSeconds=10**12), "out of range"),
    (body(metrics={"loss": 1}), "list"),
    (body(metrics=[{"name": "loss", "value": "inf"}]), "finite"),
    (body(metrics=[{"name": "loss", "value": "abc"}]), "not a number"),
    (body(metrics=[{"value": "1"}]), "{name, value}"),
    (body(metrics=[{"name": "a b\n", "value": "1"}]), "plain name"),
    (body(metrics=metrics(current_step=-1)), "step count"),
    (body(metrics=metrics(current_step=1.5)), "step count"),
    (body(metrics=metrics(total_steps=10**13)), "step count"),
    (body(metrics=[{"name": f"m{i}", "value": "1"} for i in range(33)]), "at most 32"),
    (b" " * (MAX_BODY + 1), "over"),
])
def test_bad_bodies_are_refused_with_the_reason(raw, reason):
    with pytest.raises(BadReport, match=reason.replace("{", r"\{").replace("}", r"\}")):
        parse_trainer_status(raw)


def test_a_whole_run_becomes_lines_from_0_to_total_with_eta_0_at_the_end():
    state = RelayState()
    begin = state.build_report(parse_trainer_status(body(
        progressPercentage=0, metrics=metrics(total_steps=10))))
    step = state.build_report(parse_trainer_status(body(
        progressPercentage=40, estimatedRemainingSeconds=12,
        metrics=metrics(loss=0.51234567, learning_rate=0.001, grad_norm=1.5, current_step=4,
                        total_steps=10, current_epoch=0.4))))
    # on_train_end sends only the logged metrics: no step counts
    end = state.build_report(parse_trainer_status(body(
        progressPercentage=100, estimatedRemainingSeconds=0,
        metrics=metrics(train_runtime=3.2, train_samples_per_second=708.68, epoch=1.0))))
    assert begin == {"step": 0, "total_steps": 10, "epoch": None, "loss": None,
                     "samples_per_second": None, "eta_seconds": None, "metrics": None}
    assert step == {"step": 4, "total_steps": 10, "epoch": 0.4, "loss": 0.512346,
                    "samples_per_second": None, "eta_seconds": 12,
                    "metrics": {"loss": 0.512346, "learning_rate": 0.001, "grad_norm": 1.5}}
    assert end == {"step": 10, "total_steps": 10, "epoch": 1.0, "loss": None,
                   "samples_per_second": 708.68, "eta_seconds": 0,
                   "metrics": {"train_runtime": 3.2, "train_samples_per_second": 708.68}}


def test_a_report_without_any_step_prints_nothing_and_a_step_past_the_total_is_refused():
    state = RelayState()
    assert state.build_report(parse_trainer_status(body(progressPercentage=50))) is None
    with pytest.raises(BadReport, match="past total_steps"):
        state.build_report(parse_trainer_status(body(
            metrics=metrics(current_step=11, total_steps=10))))


def test_the_operator_reads_a_relay_line_into_status_progress_with_its_metrics():
    from accelerate_trainer.contract import format_progress_line
    report = RelayState().build_report(parse_trainer_status(body(
        progressPercentage=40, estimatedRemainingSeconds=75,
        metrics=metrics(loss=0.5, learning_rate=0.001, current_step=4, total_steps=10,
                        current_epoch=0.4))))
    parsed = pushed_progress("noise\n" + format_progress_line(report))
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert build_progress_status(parsed, now) == {
        "step": 4, "totalSteps": 10, "epoch": 0.4, "loss": 0.5, "etaSeconds": 75,
        "eta": "1m15s", "summary": "4/10 (40%)", "updateTime": "2026-01-01T00:00:00Z",
        "metrics": {"loss": 0.5, "learning_rate": 0.001}}


# ---- the HTTP server: real POSTs -----------------------------------------------------------

@pytest.fixture
def relay():
    """A relay server on a loopback socket in a thread; yields (url, its output)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    out = io.StringIO()
    server = build_server(sock, TOKEN, out)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/", out
    server.shutdown()
    server.server_close()


def post(url: str, data: bytes, token: str | None = TOKEN,
         headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, data=data, method="POST", headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token
                                               else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_a_good_post_answers_200_and_prints_one_progress_line(relay):
    url, out = relay
    code, _ = post(url, body(progressPercentage=50, estimatedRemainingSeconds=9,
                             metrics=metrics(current_step=5, total_steps=10, loss=0.25)))
    assert code == 200
    line, = out.getvalue().splitlines()
    assert json.loads(PROGRESS_LINE.match(line).group(1)) == {
        "step": 5, "total_steps": 10, "loss": 0.25, "eta_seconds": 9,
        "metrics": {"loss": 0.25}}


@pytest.mark.parametrize(("data", "token", "code", "message"), [
    (body(progressPercentage=1), None, 401, "bearer token"),
    (body(progressPercentage=1), "wrong", 401, "bearer token"),
    (b"{oops", TOKEN, 400, "not JSON"),
    (body(progressPercentage=250, metrics=metrics(current_step=1, total_steps=2)), TOKEN, 400,
     "outside 0-100"),
    (body(metrics=metrics(current_step=1, total_steps=2, loss="nan")), TOKEN, 400, "finite"),
    (b"x" * (MAX_BODY + 1), TOKEN, 413, "over"),
])
def test_bad_posts_are_answered_with_an_error_and_print_nothing(relay, data, token, code,
                                                                 message):
    url, out = relay
    answer, text = post(url, data, token)
    assert (answer, message in json.loads(text)["message"]) == (code, True)
    assert out.getvalue() == ""
    # and the relay still serves good reports afterwards
    assert post(url, body(metrics=metrics(current_step=1, total_steps=2)))[0] == 200
    assert "ACCELERATE_PROGRESS" in out.getvalue()


def test_a_get_is_refused(relay):
    url, out = relay
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(url, timeout=5)
    assert error.value.code == 405 and out.getvalue() == ""


# ---- when it starts, as a process of its own -------------------------------------------------

@pytest.mark.parametrize(("environ", "node_rank"), [
    ({"DISABLE_KUBEFLOW_INTEGRATION": "true"}, 0),
    ({"KUBEFLOW_TRAINER_SERVER_URL": "https://mine.example/"}, 0),
    ({}, 1),
])
def test_the_relay_is_not_started_when_switched_off_set_by_the_user_or_off_node_0(
        environ, node_rank):
    assert start_relay(environ, node_rank=node_rank) == {}


LAUNCHER = """
import json, os, sys
from accelerate_trainer.kubeflow_relay import start_relay
env = start_relay(os.environ, node_rank=0, token_dir=sys.argv[1])
print("RELAY_ENV " + json.dumps(env), flush=True)
os.execvpe(sys.executable, [sys.executable, *sys.argv[2:]], {**os.environ, **env})
"""


def launch_with_relay(tmp_path: Path, *argv: str, timeout: float = 240,
                      **env: str) -> subprocess.CompletedProcess:
    """What accelerate-trainer does on node 0: start the relay, then exec the training."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "trainer"),
                                                            str(ROOT / "operator")]),
               "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env}
    environ.pop("KUBEFLOW_TRAINER_SERVER_URL", None)
    return subprocess.run([sys.executable, "-c", LAUNCHER, str(tmp_path), *argv], env=environ,
                          capture_output=True, text=True, timeout=timeout, check=False)


POSTER = """
import json, os, urllib.request
token = open(os.environ["KUBEFLOW_TRAINER_SERVER_TOKEN"]).read().strip()
data = json.dumps({"trainerStatus": {"progressPercentage": 30, "metrics": [
    {"name": "current_step", "value": "3"}, {"name": "total_steps", "value": "10"}]}}).encode()
request = urllib.request.Request(os.environ["KUBEFLOW_TRAINER_SERVER_URL"], data=data,
    headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
print("POSTED", urllib.request.urlopen(request, timeout=5).status, flush=True)
"""


def test_the_relay_process_outlives_the_exec_prints_to_the_same_stdout_and_ends_with_it(
        tmp_path):
    result = launch_with_relay(tmp_path, "-c", POSTER, timeout=60)
    # run() returns at EOF on stdout: the relay, which shares it, has ended with its parent
    lines = result.stdout.splitlines()
    env = json.loads(lines[0].removeprefix("RELAY_ENV "))
    assert env["KUBEFLOW_TRAINER_SERVER_URL"].startswith("http://127.0.0.1:")
    assert Path(env["KUBEFLOW_TRAINER_SERVER_TOKEN"]).parent == tmp_path
    assert "POSTED 200" in lines
    assert 'ACCELERATE_PROGRESS {"step": 3, "total_steps": 10}' in lines


# ---- a real transformers.Trainer, unmodified ---------------------------------------------------

def progress_reports(stdout: str) -> list[dict]:
    return [json.loads(m.group(1)) for m in PROGRESS_LINE.finditer(stdout)]


# The script run with none of our packages importable (the venv has them installed): what it
# reports comes from transformers' own callback, not from code of ours in the script.
WITHOUT_OUR_PACKAGES = (
    "import runpy, sys; sys.modules.update(dict.fromkeys(("
    "'accelerate_trainer', 'accelerate_operator', 'accelerate_job'))); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def test_an_unmodified_transformers_trainer_reports_through_the_relay(tmp_path):
    from transformers.integrations import integration_utils
    assert "kubeflow" in integration_utils.INTEGRATION_TO_CALLBACK  # transformers >= 5
    result = launch_with_relay(tmp_path, "-c", WITHOUT_OUR_PACKAGES,
                               str(ROOT / "examples" / "trainer_example.py"),
                               "--max-steps", "12", "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    reports = progress_reports(result.stdout)
    assert reports[0] == {"step": 0, "total_steps": 12}
    last = reports[-1]
    assert (last["step"], last["total_steps"], last["eta_seconds"]) == (12, 12, 0)
    assert last["epoch"] == 1.0 and last["samples_per_second"] > 0
    steps = [report["step"] for report in reports]
    assert steps == sorted(steps)
    status = build_progress_status(pushed_progress(result.stdout), datetime.now(UTC))
    assert status["summary"] == "12/12 (100%)" and status["eta"] == "0s"


def test_disable_kubeflow_integration_still_switches_it_off(tmp_path):
    result = launch_with_relay(tmp_path, "-c", "print('TRAINED')", timeout=60,
                               DISABLE_KUBEFLOW_INTEGRATION="TRUE")
    assert result.stdout.splitlines() == ["RELAY_ENV {}", "TRAINED"]
