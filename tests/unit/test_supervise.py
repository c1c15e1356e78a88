"""Pod 0's supervisor (accelerate_trainer.supervise): a real child process's output passes through
unchanged, its progress and last output reach a real HTTPS stand-in for the operator's report
endpoint (with the token, over TLS checked against the pod's CA), signals reach the child, its
exit code is the container's, and a refused or impossible report never stops the training. The
client's own checks (token rotation, CA rotation, retries) are test_report_client.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from accelerate_operator.progress import parse_report
from accelerate_trainer.contract import MAX_BODY_BYTES, NEXT_REPORT_SECONDS
from accelerate_trainer.processes import _children
from accelerate_trainer.pumps import Pump, catch_up, drain
from accelerate_trainer.report_push import (
    HEARTBEAT_SECONDS,
    MAX_REPORT_BYTES,
    PUSH_SECONDS,
    QUIET_SECONDS,
    STDERR,
    Reports,
    Snapshot,
    encode,
)
from accelerate_trainer.supervise import Launch, Supervisor

from tests.helpers.report_endpoint import PATH, ReportEndpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def endpoint(pki):
    """`endpoint(answers, cert)`: a report endpoint stand-in, stopped after the test."""
    started = []

    def start(answers=None, cert=None):
        started.append(ReportEndpoint(cert or pki.cert, answers))
        started[-1].ca = pki.ca  # what the pods are given
        return started[-1]

    yield start
    for server in started:
        server.stop()


DRIVER = """
import os, sys
from accelerate_trainer.supervise import Attempts, Launch, supervise
from accelerate_trainer.report_client import ReportClient
client = ReportClient(sys.argv[1], directory=sys.argv[2])
attempts = os.path.join(sys.argv[2], "attempt")
attempts = Attempts(attempts) if os.path.exists(attempts) else None
launch = Launch(sys.argv[3:], dict(os.environ), os.environ.get("ACCELERATE_CHECKPOINT_DIR"))
sys.exit(supervise(launch, client, int(os.environ.get("NODE_RANK", "0")), attempts))
"""


def report_dir(tmp_path: Path, ca: Path) -> Path:
    """The pod's projected report volume: the token and the endpoint's CA."""
    (tmp_path / "token").write_text("secret-token\n")
    shutil.copy(ca, tmp_path / "ca.crt")
    return tmp_path


def run_supervised(server: ReportEndpoint, tmp_path: Path, script: str, env: dict | None = None,
                   **kwargs) -> subprocess.Popen:
    report_dir(tmp_path, server.ca)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'trainer'}:{ROOT / 'operator'}",
           "DISABLE_KUBEFLOW_INTEGRATION": "TRUE", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, server.url(), str(tmp_path),
         sys.executable, "-u", "-c", script], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, **kwargs)


PRINTS = r"""
import sys, time
sys.stdout.write("starting\n")
for step in (1, 2, 3):
    sys.stderr.write(f"\r{step}/3 [00:01<00:02, 1.00it/s]")
    print(f'ACCELERATE_PROGRESS {{"step": {step}, "total_steps": 3}}')
    time.sleep(0.1)
print("done")
sys.exit(3)
"""


def test_output_passes_through_and_the_last_report_and_exit_code_arrive(tmp_path, endpoint):
    server = endpoint()
    child = run_supervised(server, tmp_path, PRINTS)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 3
    assert out.splitlines()[0] == "starting" and out.splitlines()[-1] == "done"
    assert '"step": 3' in out and "3/3 [00:01<00:02" in err  # unchanged, each on its stream
    path, headers, _ = server.requests[-1]
    assert path == PATH
    assert headers["Authorization"] == "Bearer secret-token"
    assert headers["Content-Type"] == "application/json"
    last = server.reports()[-1]
    assert last["progress"] == {"step": 3, "total_steps": 3}
    assert last["lastOutputTime"].endswith("Z")
    assert len(server.requests) <= 2  # the first sign of life, then the last report
    assert server.connections == 1  # kept alive


def test_sigterm_reaches_the_child_and_its_exit_code_is_the_containers(tmp_path, endpoint):
    server = endpoint()
    script = ("import signal, sys, time\n"
              "def stop(*_):\n"
              "    print('checkpoint saved')\n"
              "    sys.exit(83)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    child = run_supervised(server, tmp_path, script)
    assert child.stdout.readline() == "ready\n"
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 83 and "checkpoint saved" in out


def test_a_stop_signal_that_comes_while_the_launcher_starts_still_reaches_it():
    """Kubernetes may stop the pod at any moment, also while Popen has forked the launcher but
    not yet returned it: the launcher must still get the signal, not train on past the stop."""
    supervisor = Supervisor(Launch([sys.executable, "-c", STOPS], dict(os.environ)), 1, None)
    supervisor.signal(signal.SIGTERM)  # before the child exists
    read, write = os.pipe()
    started = time.monotonic()
    code = supervisor.run(0, write, write)
    os.close(write)
    os.close(read)
    # Stopped at once: by its handler, or by the signal itself if it came before the handler.
    assert code in (83, 128 + signal.SIGTERM) and time.monotonic() - started < 30, code


SAVES_ON_SIGTERM = ("import pathlib, signal, sys, time\n"
                    "def stop(*_):\n"
                    "    pathlib.Path(sys.argv[1]).write_text('saved')\n"
                    "    sys.exit(83)\n"
                    "signal.signal(signal.SIGTERM, stop)\n"
                    "print('ready', flush=True)\n"
                    "time.sleep(60)\n")


def test_a_one_process_launch_stopped_in_a_pod_saves_and_says_so(tmp_path):
    """accelerate's simple launcher (one process on one machine) passes no signal on and dies of
    SIGTERM at once, leaving the script behind. The supervisor, the container's first process
    (here PID 1 of a PID namespace of its own, as in a pod), passes the stop on to the script and
    waits for it: the script saves, and its exit code is the pod's."""
    script, saved = tmp_path / "train.py", tmp_path / "saved"
    script.write_text(SAVES_ON_SIGTERM)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "trainer"), "ACCELERATE_USE_CPU": "1"}
    child = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m",
         "accelerate_trainer.supervise", "--", sys.executable, "-m",
         "accelerate.commands.accelerate_cli", "launch", "--cpu", "--num_processes", "1",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         str(script), str(saved)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        (supervisor,) = _children()[child.pid]  # unshare's child: PID 1 inside
        os.kill(supervisor, signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert saved.read_text() == "saved", err[-3000:]
    assert child.returncode == 83, err[-3000:]


class SlowReports(Reports):
    """Reports that take `delay` seconds to take each chunk of stderr, as on a loaded node."""

    def __init__(self, delay: float):
        super().__init__(progress=False)
        self.delay = delay

    def feed(self, stream: int, chunk: bytes, now: float) -> None:
        time.sleep(self.delay)
        super().feed(STDERR, chunk, now)


@pytest.mark.parametrize("wait, delay", [(catch_up, 0.05), (drain, 0.4)])
def test_a_launchs_last_lines_are_fed_before_its_exit_is_reported(wait, delay):
    """The launcher's end can be seen before its last bytes are read from the pipe; an exit
    reported then, or the pod's termination message written, would lack its traceback. Both
    waits (catch_up before an exit report, drain at the pod's end) last until every byte
    written is fed, however long feeding takes: drain's quiet alone ends after 0.25 s without
    a read, while the last chunk may still be being fed."""
    reports = SlowReports(delay)
    source, sink = os.pipe()
    with open(os.devnull, "wb") as devnull:
        pump = Pump(source, devnull.fileno(), reports)
        pump.start()

        def launcher() -> None:
            for _ in range(50):
                os.write(sink, b"x" * 1000 + b"\n")
            os.write(sink, b"RuntimeError: rank 3 failed\n")

        writer = threading.Thread(target=launcher)
        writer.start()
        writer.join()
        wait([pump])
        assert reports.tail().endswith("RuntimeError: rank 3 failed")
        os.close(sink)
        pump.join(5)
    os.close(source)


STOPS = ("import signal, sys, time\n"
         "def stop(*_):\n"
         "    print('checkpoint saved', flush=True)\n"
         "    sys.exit(83)\n"
         "signal.signal(signal.SIGTERM, stop)\n"
         "time.sleep(60)\n")


def test_a_child_killed_by_a_signal_exits_as_a_shell_would_say(tmp_path, endpoint):
    child = run_supervised(endpoint(), tmp_path, "import os, signal\n"
                           "os.kill(os.getpid(), signal.SIGKILL)\n")
    child.communicate(timeout=30)
    assert child.returncode == 128 + signal.SIGKILL


def test_a_refused_push_is_said_once_and_the_training_goes_on(tmp_path, endpoint):
    server = endpoint([(403, {})] * 10)
    child = run_supervised(server, tmp_path, PRINTS)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 3 and out.splitlines()[-1] == "done"
    assert 1 <= len(server.requests) <= 2  # the first report (if any), then the last
    assert err.count("answered 403") == 1 and "refused 403" in err


def test_an_endpoint_whose_certificate_the_pods_ca_did_not_sign_gets_nothing(tmp_path, endpoint,
                                                                            pki):
    server = endpoint(cert=pki.cert_other_ca)
    child = run_supervised(server, tmp_path, PRINTS)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 3 and out.splitlines()[-1] == "done"
    assert server.requests == []
    assert err.count("got no answer (") == 1 and "CERTIFICATE_VERIFY_FAILED" in err


# ---- when a push is due (Reports.due) -----------------------------------------------------


def fed(text: str, wall: float) -> Reports:
    reports = Reports()
    reports.feed(1, text.encode(), wall)
    return reports


def test_new_progress_is_pushed_at_once_then_at_most_every_push_interval():
    reports = fed('ACCELERATE_PROGRESS {"step": 1}\n', wall=1000.0)
    first = reports.due(now=0.0, wall=1000.0)
    assert first is not None and first.progress == {"step": 1}
    reports.tried(first, 0.0, ok=True)
    reports.feed(1, b'ACCELERATE_PROGRESS {"step": 2}\n', 1001.0)
    assert reports.due(now=1.0, wall=1001.0) is None
    assert reports.due(now=PUSH_SECONDS, wall=1000.0 + PUSH_SECONDS).progress == {"step": 2}


def test_the_operator_sets_the_pace_of_progress_and_the_heartbeat_follows_it():
    reports = fed('ACCELERATE_PROGRESS {"step": 1}\n', wall=1000.0)
    reports.tried(reports.due(now=0.0, wall=1000.0), 0.0, ok=True, next_report=12.0)
    reports.feed(1, b'ACCELERATE_PROGRESS {"step": 2}\n', 1011.0)
    assert reports.due(now=PUSH_SECONDS, wall=1000.0 + PUSH_SECONDS) is None
    assert reports.due(now=HEARTBEAT_SECONDS, wall=1000.0 + HEARTBEAT_SECONDS) is None
    second = reports.due(now=12.0, wall=1012.0)
    assert second is not None and second.progress == {"step": 2}
    reports.tried(second, 12.0, ok=True)  # an answer without a pace keeps the last one
    reports.feed(1, b'ACCELERATE_PROGRESS {"step": 3}\n', 1013.0)
    assert reports.due(now=12.0 + PUSH_SECONDS, wall=1012.0 + PUSH_SECONDS) is None
    assert reports.due(now=24.0, wall=1024.0).progress == {"step": 3}


def test_the_first_progress_goes_soon_after_heartbeats_with_the_time_its_line_came():
    reports = fed("loading the model\n", wall=1000.0)
    reports.tried(reports.due(now=0.0, wall=1000.0), 0.0, ok=True)
    reports.feed(1, b'ACCELERATE_PROGRESS {"step": 1}\n', 1004.0)
    # Not PUSH_SECONDS after the heartbeat: the group's first step shows soon.
    first = reports.due(now=QUIET_SECONDS, wall=1000.0 + QUIET_SECONDS + 1)
    assert first is not None and first.progress == {"step": 1}
    reports.tried(first, QUIET_SECONDS, ok=True)
    reports.feed(1, b"more output\n", 1006.0)  # the step keeps the time its line came
    assert reports.current.progress_time == 1004.0
    report = json.loads(encode(reports.current))
    assert report["progressTime"] == "1970-01-01T00:16:44.000Z"
    assert report["lastOutputTime"] == "1970-01-01T00:16:46.000Z"


def test_output_without_progress_is_a_heartbeat_and_a_pause_is_said_once():
    reports = fed("loading data\n", wall=1000.0)
    reports.tried(reports.due(now=0.0, wall=1000.0), 0.0, ok=True)
    reports.feed(1, b"still loading\n", 1000.0 + PUSH_SECONDS)
    # Output goes on: nothing before the heartbeat is due.
    assert reports.due(now=PUSH_SECONDS + 0.5, wall=1000.5 + PUSH_SECONDS) is None
    # It paused QUIET_SECONDS: its last output is pushed, so stall detection times from it.
    quiet = reports.due(now=PUSH_SECONDS + QUIET_SECONDS,
                        wall=1000.0 + PUSH_SECONDS + QUIET_SECONDS)
    assert quiet is not None and quiet.last_output == 1000.0 + PUSH_SECONDS
    reports.tried(quiet, PUSH_SECONDS + QUIET_SECONDS, ok=True)
    assert reports.due(now=100.0, wall=1100.0) is None  # nothing new: nothing to push
    assert max(HEARTBEAT_SECONDS, NEXT_REPORT_SECONDS[1]) * 2 <= 30  # the least stallTimeoutSeconds


def test_a_failed_push_is_tried_again_later_and_the_end_is_always_pushed():
    reports = fed('ACCELERATE_PROGRESS {"step": 1}\n', wall=1000.0)
    snapshot = reports.due(now=0.0, wall=1000.0)
    reports.tried(snapshot, 0.0, ok=False)
    assert reports.due(now=1.0, wall=1001.0) is None
    assert reports.due(now=1.0, wall=1001.0, final=True) == snapshot


def test_pod_0s_reports_carry_the_versions_it_trains_with_through_restarts():
    versions = {"python": "3.11.9", "accelerate": "1.15.0"}
    reports = Reports(versions=versions)
    reports.launched(0)
    reports.feed(1, b"starting\n", 1000.0)
    first = encode(reports.current)
    reports.launched(1)  # restarted in place: the same pod, the same libraries
    assert json.loads(first)["versions"] == json.loads(encode(reports.current))["versions"]
    assert parse_report(first).versions == versions  # as the operator reads it
    assert "versions" not in json.loads(encode(Reports(progress=False).current))


def test_a_report_too_big_for_the_endpoint_keeps_its_core_fields():
    metrics = {f"metric_{i}": 0.123456789 for i in range(4000)}  # more than the endpoint takes
    value = encode(Snapshot({"step": 4, "total_steps": 8, "loss": 0.5, "metrics": metrics},
                            1000.0))
    assert len(value) <= MAX_REPORT_BYTES < MAX_BODY_BYTES
    assert json.loads(value)["progress"] == {"step": 4, "total_steps": 8, "loss": 0.5}


@pytest.mark.parametrize("line", [
    'ACCELERATE_PROGRESS {"step": -1}', 'ACCELERATE_PROGRESS {"step": true}',
    'ACCELERATE_PROGRESS {"step": 1.5}', "ACCELERATE_PROGRESS [1]", 'ACCELERATE_PROGRESS {"ste',
])
def test_a_line_that_is_not_a_valid_report_is_not_pushed(line):
    reports = fed("x\n" + line + "\n", wall=time.time())
    assert reports.current.progress is None


# ---- in-place restarts: the attempt file stands in for the downward API's copy of the
# operator's annotation, written here as the operator would.

ATTEMPTS = r"""
import os, sys, time
attempt = os.environ["ACCELERATE_JOB_ATTEMPT"]
print(f"attempt {attempt} rdzv {os.environ['PET_RDZV_ID']} "
      f"resume {os.environ.get('ACCELERATE_RESUME_FROM')}", flush=True)
if attempt == "4":
    sys.stderr.write("Traceback (most recent call last):\nRuntimeError: rank 3 failed\n")
    sys.exit(1)
if attempt == "5":
    time.sleep(60)  # a rank hanging in a collective on the dead one
"""


def wait_for(predicate, seconds: float = 30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_a_failed_launch_is_reported_and_the_next_attempt_runs_in_the_same_pod(tmp_path,
                                                                              endpoint):
    server = endpoint()
    (tmp_path / "attempt").write_text("4")
    checkpoints = tmp_path / "ckpt" / "checkpoints" / "checkpoint_20"
    checkpoints.mkdir(parents=True)
    (checkpoints / "COMPLETE").write_text("attempt 4")
    child = run_supervised(server, tmp_path, ATTEMPTS, env={
        "NODE_RANK": "1", "ACCELERATE_JOB_NAME": "train",
        "ACCELERATE_CHECKPOINT_DIR": str(tmp_path / "ckpt")})
    ended = wait_for(lambda: [r["exit"] for r in server.reports() if "exit" in r])[0]
    assert ended["attempt"] == 4 and ended["exitCode"] == 1 and ended["time"].endswith("Z")
    assert server.reports()[0]["attempt"] == 4
    assert ended["message"].endswith("RuntimeError: rank 3 failed")
    assert server.reports()[0]["progress"] is None  # a pod other than 0 reports no progress
    (tmp_path / "attempt").write_text("5")  # the operator's next attempt
    wait_for(lambda: child.poll() is None and len(server.requests) >= 1)
    time.sleep(1.0)
    (tmp_path / "attempt").write_text("6")  # attempt 5 hangs: the operator moves on again
    (checkpoints / "COMPLETE").unlink()
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0
    assert out.splitlines() == [
        "attempt 4 rdzv train-4 resume None",
        f"attempt 5 rdzv train-5 resume {checkpoints}",
        "attempt 6 rdzv train-6 resume None",
    ]
    assert len(server.requests) == 1  # only the failure: no heartbeats from pod 1


def test_without_an_operator_answer_the_pod_ends_with_the_launchs_code(tmp_path, endpoint):
    server = endpoint()
    (tmp_path / "attempt").write_text("4")
    script = "import sys; sys.exit(7)"
    child = run_supervised(server, tmp_path, script, env={"NODE_RANK": "0"})
    wait_for(lambda: server.requests)
    child.send_signal(signal.SIGTERM)  # the operator deleting the pod
    child.communicate(timeout=30)
    assert child.returncode == 7
    assert server.reports()[-1]["exit"]["exitCode"] == 7


RANK_1_RAISES = """
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("labels missing in batch 3")
dist.barrier()
"""


def test_a_failed_launch_reports_the_first_failing_ranks_own_error(tmp_path, endpoint):
    """A real `accelerate launch` of 2 CPU ranks with the launch hook, as accelerate-trainer
    runs it: the exit report carries rank 1's exception, not torchrun's summary."""
    from accelerate_trainer.error_files import HOOK_DIR

    server = endpoint()
    (tmp_path / "attempt").write_text("0")
    (tmp_path / "config.yaml").write_text("distributed_type: MULTI_GPU\nuse_cpu: true\n")
    (tmp_path / "train.py").write_text(RANK_1_RAISES)
    report_dir(tmp_path, server.ca)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'trainer'}:{HOOK_DIR}", "NODE_RANK": "0",
           "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
              "--config_file", str(tmp_path / "config.yaml"), "--num_processes", "2",
              "--multi_gpu", "--main_process_port", "29613", "--monitor_interval", "0.1",
              str(tmp_path / "train.py")]
    child = subprocess.Popen([sys.executable, "-c", DRIVER, server.url(), str(tmp_path),
                              *launch], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        ended = wait_for(lambda: [r["exit"] for r in server.reports() if "exit" in r], 120)[0]
    finally:
        child.send_signal(signal.SIGTERM)
        child.communicate(timeout=60)
    assert ended["exitCode"] == 1 and ended["rank"] == 1
    assert ended["rootCause"].splitlines()[0] == "ValueError: labels missing in batch 3"
    assert 'raise ValueError("labels missing in batch 3")' in ended["rootCause"]
    assert ended["message"]  # the launch's last lines are still there, after it


def test_the_termination_message_puts_the_root_cause_first(tmp_path):
    from accelerate_trainer.root_cause import RootCause
    from accelerate_trainer.supervise import termination_text
    from accelerate_trainer.termination import write_termination_message

    log = tmp_path / "termination-log"
    write_termination_message(termination_text(RootCause("KeyError: 'labels'"), "the tail"), log)
    assert not log.exists()  # no kubelet made it: nothing is written
    log.write_text("")
    write_termination_message(termination_text(RootCause("KeyError: 'labels'"), "the tail"), log)
    assert log.read_text().splitlines() == ["KeyError: 'labels'", "", "the tail"]


def test_a_launch_that_only_lost_a_peer_lets_the_other_pods_report_first(tmp_path, monkeypatch):
    """In a job of several pods, a launch that failed because a peer went away waits before it
    reports (the pod whose rank died goes first), and is no news once the operator moved on; in
    a job of one pod, or for a failure of its own, nothing waits."""
    from accelerate_trainer import root_cause as causes
    from accelerate_trainer import supervise as module

    monkeypatch.setattr(module, "PEER_SETTLE_SECONDS", 0.6)
    attempt_file = tmp_path / "attempt"
    attempt_file.write_text("0")
    lost = causes.RootCause("rank 0 lost a peer", 0, None, causes.PEER_LOST)

    def supervisor(nodes: str, cause) -> module.Supervisor:
        made = module.Supervisor(module.Launch(["x"], {"NUM_NODES": nodes}), 0,
                                 module.Attempts(str(attempt_file)))
        made.cause = cause
        return made

    started = time.monotonic()
    assert supervisor("2", lost).settle(0) is None
    assert time.monotonic() - started >= 0.6  # waited the settle time
    started = time.monotonic()
    assert supervisor("1", lost).settle(0) is None
    assert supervisor("2", causes.RootCause("ValueError: boom", 1)).settle(0) is None
    assert time.monotonic() - started < 0.1
    attempt_file.write_text("1")  # the operator restarted the group meanwhile
    assert supervisor("2", lost).settle(0) == 1


def test_a_long_termination_message_keeps_the_whole_root_cause_where_the_operator_cuts():
    """The operator keeps a message's last MAX_MESSAGE_CHARS (pod_state, keep_end): the
    supervisor's own message fits it, the cause whole first and the tail cut from its start."""
    from accelerate_trainer.contract import MAX_MESSAGE_CHARS, printable_text
    from accelerate_trainer.root_cause import RootCause
    from accelerate_trainer.supervise import termination_text

    cause = "Traceback (most recent call last):\n" + "  frame\n" * 120 + "KeyError: 'labels'"
    tail = "".join(f"line {n}\n" for n in range(400)) + "the last line"
    text = termination_text(RootCause(cause), tail)
    assert len(text) == MAX_MESSAGE_CHARS
    kept = printable_text(text, MAX_MESSAGE_CHARS, keep_end=True)  # what the operator keeps
    assert kept.startswith(cause + "\n\n[...]") and kept.endswith("the last line")
