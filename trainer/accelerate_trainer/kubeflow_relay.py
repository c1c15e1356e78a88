"""Zero-code progress for `transformers.Trainer`: a relay on 127.0.0.1 inside pod 0 that turns
transformers' Kubeflow progress POSTs into our `ACCELERATE_PROGRESS {json}` log lines.

Why a relay in the pod, not an endpoint in the operator: since transformers 5, `TrainingArguments`
adds its `KubeflowCallback` whenever `KUBEFLOW_TRAINER_SERVER_URL` is set, and rank 0 then POSTs
`{"trainerStatus": {progressPercentage, estimatedRemainingSeconds, metrics: [{name, value}],
lastUpdatedTime}}` there, at most every 5 s, with the bearer token read from the file
`KUBEFLOW_TRAINER_SERVER_TOKEN` names. Served by the operator, that endpoint would need TLS, a
projected token with its own audience, a TokenReview per request and a check that the caller is a
pod of the job it writes, or a pod of one job could write another job's status. Served on the pod's
own loopback, only processes of this pod can reach it, and what it accepts only becomes a line of
this pod's output, which pod 0's supervisor (supervise.py) pushes like any other progress line
and the operator validates again into status.progress. The script gets no API access at all.

How it runs: `accelerate-trainer` execs the launcher (or, on pod 0, the supervisor that runs it),
so a thread would die at the exec. `start_relay` (on node 0 only; the supervisor calls it, with
its output pipe as `stdout`) binds the socket itself, so the port is known before the launch, and
hands it to `python -m accelerate_trainer.kubeflow_relay`, a small process of its own that writes
its lines to that stdout and ends when its parent ends. It is not started when
`DISABLE_KUBEFLOW_INTEGRATION=TRUE` (transformers' own switch), when the user set
`KUBEFLOW_TRAINER_SERVER_URL` themselves, or when transformers is not installed.

Bad input is answered with an HTTP error and dropped, never printed: bodies over MAX_BODY bytes,
malformed JSON, a wrong token, percentages outside 0-100, negative or absurd step counts and ETAs,
non-finite metric values. This module imports only the standard library and the contract: it
starts in well under a second, before the training does.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import math
import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, TextIO

from .contract import format_progress_line

log = logging.getLogger("accelerate_trainer")

ENV_SERVER_URL = "KUBEFLOW_TRAINER_SERVER_URL"
ENV_SERVER_TOKEN = "KUBEFLOW_TRAINER_SERVER_TOKEN"
ENV_DISABLE = "DISABLE_KUBEFLOW_INTEGRATION"

MAX_BODY = 64 * 1024          # a real report is a few hundred bytes
MAX_METRICS = 32              # transformers sends about ten
MAX_METRIC_NAME = 64
MAX_STEPS = 10**12            # far past any real run; past it a number is garbage
MAX_ETA_SECONDS = 10 * 365 * 86400
METRIC_NAME = re.compile(r"^[A-Za-z0-9_./-]{1,64}$")
# transformers' names for what our progress line carries as fields of its own.
STEP_METRIC = "current_step"
TOTAL_METRIC = "total_steps"
EPOCH_METRICS = ("current_epoch", "epoch")
SAMPLES_METRICS = ("samples_per_second", "train_samples_per_second")
# Bookkeeping, not metrics: already carried as step/total/epoch.
NOT_METRICS = {STEP_METRIC, TOTAL_METRIC, "current_epoch", "epoch", "total_flos"}


class BadReport(ValueError):
    """A POST the relay drops; the message is what the HTTP answer says."""


@dataclass(frozen=True)
class TrainerStatus:
    """One validated `trainerStatus` body."""
    progress_percentage: float | None
    eta_seconds: int | None
    metrics: dict[str, float] = field(default_factory=dict)


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool):
        raise BadReport(f"{name} is not a number")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise BadReport(f"{name} is not a number") from None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadReport(f"{name} is not a finite number")
    return float(value)


def parse_trainer_status(body: bytes) -> TrainerStatus:
    """Validate one POST body. Raises BadReport naming what is wrong; pure."""
    if len(body) > MAX_BODY:
        raise BadReport(f"body over {MAX_BODY} bytes")
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise BadReport("body is not JSON") from None
    status = document.get("trainerStatus") if isinstance(document, dict) else None
    if not isinstance(status, dict):
        raise BadReport("body has no trainerStatus object")
    percentage = None
    if status.get("progressPercentage") is not None:
        percentage = _finite(status["progressPercentage"], "progressPercentage")
        if not 0 <= percentage <= 100:
            raise BadReport("progressPercentage outside 0-100")
    eta = None
    if status.get("estimatedRemainingSeconds") is not None:
        eta_value = _finite(status["estimatedRemainingSeconds"], "estimatedRemainingSeconds")
        if not 0 <= eta_value <= MAX_ETA_SECONDS:
            raise BadReport("estimatedRemainingSeconds out of range")
        eta = int(eta_value)
    raw_metrics = status.get("metrics") or []
    if not isinstance(raw_metrics, list) or len(raw_metrics) > MAX_METRICS:
        raise BadReport(f"metrics is not a list of at most {MAX_METRICS} entries")
    metrics: dict[str, float] = {}
    for entry in raw_metrics:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise BadReport("a metric is not {name, value}")
        name = entry["name"]
        if not METRIC_NAME.match(name):
            raise BadReport(f"metric name {name[:MAX_METRIC_NAME]!r} is not a plain name")
        metrics[name] = _finite(entry.get("value"), f"metric {name}")
    for name in (STEP_METRIC, TOTAL_METRIC):
        if name in metrics and not (0 <= metrics[name] <= MAX_STEPS
                                    and metrics[name] == int(metrics[name])):
            raise BadReport(f"metric {name} is not a step count")
    return TrainerStatus(percentage, eta, metrics)


class RelayState:
    """What one run has reported so far: transformers' last POST (at train end) carries no step
    counts, so the relay remembers the latest ones to print 100 % as total/total."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.total_steps: int | None = None

    def build_report(self, status: TrainerStatus) -> dict[str, Any] | None:
        """The progress report (contract.format_progress_line's input) for one POST, or None
        when it says nothing a progress line can carry (no step known yet). Raises BadReport when
        it contradicts itself (a step past the total)."""
        metrics = status.metrics
        total = int(metrics[TOTAL_METRIC]) if TOTAL_METRIC in metrics else self.total_steps
        step = int(metrics[STEP_METRIC]) if STEP_METRIC in metrics else None
        if step is None and status.progress_percentage is not None and total:
            # train begin (0 %) and train end (100 %) come without a step
            if status.progress_percentage == 100:
                step = total
            elif status.progress_percentage == 0 and self.step is None:
                step = 0
            else:
                step = self.step
        if step is None:
            return None
        if total is not None and total > 0 and step > total:
            raise BadReport("current_step is past total_steps")
        self.step, self.total_steps = step, (total or None)
        epoch = next((metrics[name] for name in EPOCH_METRICS if name in metrics), None)
        samples = next((metrics[name] for name in SAMPLES_METRICS if name in metrics), None)
        eta = 0 if total and step >= total else status.eta_seconds
        # six significant digits, as transformers itself logs them: a short line
        extra = {name: float(f"{value:.6g}") for name, value in metrics.items()
                 if name not in NOT_METRICS}
        return {
            "step": step,
            "total_steps": self.total_steps,
            "epoch": round(epoch, 4) if epoch is not None else None,
            "loss": extra.get("loss"),
            "samples_per_second": round(samples, 2) if samples is not None else None,
            "eta_seconds": eta,
            "metrics": extra or None,
        }


def _make_handler(token: str, state: RelayState, stream: TextIO, lock: threading.Lock):
    expected = f"Bearer {token}".encode()

    class Handler(BaseHTTPRequestHandler):
        timeout = 10  # a client that sends half a request is dropped, not waited for forever

        def _answer(self, code: int, message: str) -> None:
            body = json.dumps({"message": message}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            given = (self.headers.get("Authorization") or "").encode()
            if not hmac.compare_digest(given, expected):
                self._answer(401, "missing or wrong bearer token")
                return
            try:
                length = int(self.headers.get("Content-Length") or "-1")
            except ValueError:
                length = -1
            if length < 0:
                self._answer(411, "Content-Length required")
                return
            if length > MAX_BODY:
                self.close_connection = True
                self._answer(413, f"body over {MAX_BODY} bytes")
                return
            try:
                status = parse_trainer_status(self.rfile.read(length))
                with lock:
                    report = state.build_report(status)
            except BadReport as error:
                self._answer(400, str(error))
                return
            if report is not None:
                with lock:  # one write per line: the ranks share this stdout
                    stream.write(format_progress_line(report))
                    stream.flush()
            self._answer(200, "ok")

        def do_GET(self) -> None:  # noqa: N802
            self._answer(405, "POST a trainerStatus")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            """Quiet: the pod's log is the training's, and the operator reads it."""

    return Handler


def build_server(sock: socket.socket, token: str, stream: TextIO) -> HTTPServer:
    """An HTTP server on an already bound and listening socket."""
    server = HTTPServer(sock.getsockname()[:2], _make_handler(token, RelayState(), stream,
                                                               threading.Lock()),
                        bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    return server


def _exit_with_parent(parent: int) -> None:
    """The relay outlives nothing: when the launcher it was started for is gone, so is it."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def serve(sock: socket.socket, token: str, stream: TextIO, parent: int | None = None) -> None:
    server = build_server(sock, token, stream)
    if parent is not None:
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    server.serve_forever()


def is_disabled(environ: Mapping[str, str]) -> bool:
    """transformers' own switch, read as transformers reads it."""
    return environ.get(ENV_DISABLE, "FALSE").upper() == "TRUE"


def start_relay(environ: Mapping[str, str], *, node_rank: int, python: str = sys.executable,
                token_dir: str | None = None, stdout: int | None = None) -> dict[str, str]:
    """Start the relay for this pod and return the env the launch needs to reach it
    ({} when it is not wanted here, or cannot start: progress lines printed by the script
    itself keep working either way). `stdout`: where its lines go (a file descriptor; the
    supervisor's pipe), else this process's stdout."""
    if node_rank != 0 or is_disabled(environ) or environ.get(ENV_SERVER_URL):
        return {}
    import importlib.util
    if importlib.util.find_spec("transformers") is None:
        return {}
    token = secrets.token_urlsafe(32)
    try:
        handle, token_file = tempfile.mkstemp(prefix="kubeflow-relay-", suffix=".token",
                                               dir=token_dir)
        with os.fdopen(handle, "w") as file:
            file.write(token)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        port = sock.getsockname()[1]
        subprocess.Popen(
            [python, "-m", "accelerate_trainer.kubeflow_relay", "--fd", str(sock.fileno()),
             "--token-file", token_file, "--parent", str(os.getpid())],
            pass_fds=(sock.fileno(),), stdin=subprocess.DEVNULL, stdout=stdout, close_fds=True,
        )
        sock.close()  # the relay holds its own copy
    except OSError as error:
        log.warning("transformers progress relay not started (%s); progress lines the script "
                    "prints itself still reach the job's status", error)
        return {}
    log.info("transformers' KubeflowCallback reports progress to the relay on 127.0.0.1:%d",
             port)
    return {ENV_SERVER_URL: f"http://127.0.0.1:{port}/", ENV_SERVER_TOKEN: token_file}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accelerate_trainer.kubeflow_relay")
    parser.add_argument("--fd", type=int, required=True, help="a bound, listening TCP socket")
    parser.add_argument("--token-file", required=True)
    parser.add_argument("--parent", type=int, help="exit when this process is gone")
    args = parser.parse_args(argv)
    with open(args.token_file, encoding="utf-8") as file:
        token = file.read().strip()
    sock = socket.socket(fileno=args.fd)
    serve(sock, token, sys.stdout, parent=args.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
