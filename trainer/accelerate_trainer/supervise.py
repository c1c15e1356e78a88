"""`python -m accelerate_trainer.supervise -- ARGV...`: run ARGV (the launcher) as a child, pass
its output through unchanged, and push rank 0's progress and signs of life onto this pod.

Why push: reading rank 0's log through the API server and the kubelet every 5 s cost about 8 ms
of control-plane CPU per second per running job, and more the more a job prints. Here the pod
says what happened, at most once every PUSH_SECONDS, by patching one annotation
(contract.REPORT_ANNOTATION) onto its own pod, which the operator's pod watch already brings.
Who may write what is the API server's business: a Role per job lets the pod's service account
patch only pod `<job>-0`, and the chart's ValidatingAdmissionPolicy lets that patch come only
from the pod itself (its bound token) and change only that annotation, up to MAX_REPORT_BYTES.

Why the parent of the launcher, not a process beside it: a container ends when its first process
does, and a process beside it would be killed with output not yet copied (the last lines of a
traceback). accelerate-trainer execs this module on pod 0; it starts the launcher with stdout and
stderr on pipes, copies every byte to the container's own as it arrives, forwards the signals
Kubernetes sends (SIGTERM: checkpoint and stop), and exits with the launcher's code after the last
push.

What is pushed: the newest `ACCELERATE_PROGRESS {json}` line on either stream (the script's own,
accelerate_trainer.progress's, or the Kubeflow relay's) and when it came, and when anything was
last written. The first progress goes at once (unless a push was tried in the last
QUIET_SECONDS): `kubectl get` shows a new group's first step soon. After it, a push happens when
the progress changed and PUSH_SECONDS have passed since the last one; while output goes on with
no new progress, every HEARTBEAT_SECONDS; once output has paused QUIET_SECONDS (stall detection
then sees the true last sign of life); and at the end. A failed push is said once on stderr and
tried again later; it never stops the training.

Why http.client and not the `kubernetes` package: this runs in the user's training image, which
need not have `kubernetes` (nor its pydantic, which may clash with the user's pins); it makes one
kind of request, a JSON merge patch of one pod, with the projected token (re-read for every push:
the kubelet rotates it) over one kept-alive TLS connection checked against the cluster's CA.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .contract import (
    ENV_REPORT_NAMESPACE,
    ENV_REPORT_POD,
    MAX_REPORT_BYTES,
    PROGRESS_LINE,
    PROGRESS_PREFIX,
    REPORT_ANNOTATION,
    REPORT_CA_FILE,
    REPORT_DIR,
    REPORT_TOKEN_FILE,
)
from .kubeflow_relay import start_relay

# At most one push per this while the progress changes. Each push and the status write it
# brings cost the control plane about 30 ms of CPU (docs/performance.md), so this is the
# freshness a user sees (progress in `kubectl get` under 10 s old) at the lowest cost.
PUSH_SECONDS = 8.0
# While output goes on with the same progress: well under the smallest stallTimeoutSeconds (30),
# so a job that prints is never taken for a stalled one.
HEARTBEAT_SECONDS = 10.0
QUIET_SECONDS = 3.0        # output paused this long: say when it last came
TICK_SECONDS = 0.5
REQUEST_TIMEOUT = 5.0
DRAIN_QUIET_SECONDS = 0.25  # after the launcher ended: its last bytes are copied when quiet
DRAIN_MAX_SECONDS = 2.0
MAX_PARTIAL_LINE = 64 * 1024
# The short fields kept when a report with its metrics would exceed MAX_REPORT_BYTES.
CORE_FIELDS = ("step", "total_steps", "epoch", "loss", "samples_per_second", "eta_seconds")
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                     signal.SIGUSR1, signal.SIGUSR2)
_PREFIX = PROGRESS_PREFIX.encode()


def say(message: str) -> None:
    print(f"accelerate-trainer: {message}", file=sys.stderr, flush=True)


def parse_progress_line(line: bytes) -> dict[str, Any] | None:
    """The report one output line carries, from its last `ACCELERATE_PROGRESS {` on (a print
    after a tqdm bar, which ends with no newline, shares the bar's line), or None when it is not
    a valid one: a JSON object with a whole, non-negative step."""
    start = line.rfind(_PREFIX + b" {")
    if start < 0:
        return None
    match = PROGRESS_LINE.match(line[start:].decode("utf-8", "replace").rstrip())
    if match is None:
        return None
    try:
        report = json.loads(match.group(1))
    except ValueError:
        return None
    step = report.get("step") if isinstance(report, dict) else None
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) \
            or step < 0 or step != int(step):
        return None
    return report


@dataclass(frozen=True)
class Snapshot:
    progress: Mapping[str, Any] | None
    last_output: float | None  # wall clock
    progress_time: float | None = None  # wall clock: when the progress line came


def _stamp(moment: float | None) -> str | None:
    if moment is None:
        return None
    return datetime.fromtimestamp(moment, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def encode(snapshot: Snapshot) -> str:
    """The annotation's value (contract.py), cut to MAX_REPORT_BYTES: metrics go first."""
    when, progress_time = _stamp(snapshot.last_output), _stamp(snapshot.progress_time)
    for progress in (snapshot.progress,
                     {k: v for k, v in (snapshot.progress or {}).items() if k in CORE_FIELDS}):
        report = {"progress": progress, "lastOutputTime": when}
        if progress is not None and progress_time is not None:
            report["progressTime"] = progress_time
        value = json.dumps(report, separators=(",", ":"))
        if len(value.encode()) <= MAX_REPORT_BYTES:
            return value
    return json.dumps({"progress": None, "lastOutputTime": when}, separators=(",", ":"))


class Reports:
    """What the output has shown and what of it was pushed; fed by the pump threads, read by
    the pusher's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._partial: dict[int, bytes] = {}
        self.current = Snapshot(None, None)
        self._pushed = Snapshot(None, None)
        self._tried_at: float | None = None  # monotonic

    def feed(self, stream: int, chunk: bytes, now: float) -> None:
        """Bytes the launcher wrote on `stream` at wall time `now`."""
        data = self._partial.pop(stream, b"") + chunk
        lines = data.split(b"\n")
        self._partial[stream] = lines.pop()[-MAX_PARTIAL_LINE:]
        report = None
        if _PREFIX in data:
            for line in lines:
                report = parse_progress_line(line) or report
        with self._lock:
            current = self.current
            self.current = (Snapshot(report, now, now) if report is not None
                            else Snapshot(current.progress, now, current.progress_time))

    def due(self, now: float, wall: float, final: bool = False) -> Snapshot | None:
        """What to push now (monotonic `now`, wall clock `wall`), or None (the module's rule)."""
        with self._lock:
            current, pushed = self.current, self._pushed
            since = math.inf if self._tried_at is None else now - self._tried_at
        new_progress = current.progress != pushed.progress
        new_output = current.last_output != pushed.last_output
        if not (new_progress or new_output):
            return None
        quiet = current.last_output is not None and wall - current.last_output >= QUIET_SECONDS
        first = new_progress and pushed.progress is None and since >= QUIET_SECONDS
        if final or first or (since >= PUSH_SECONDS and (new_progress or quiet)) \
                or since >= HEARTBEAT_SECONDS:
            return current
        return None

    def tried(self, snapshot: Snapshot, now: float, ok: bool) -> None:
        with self._lock:
            self._tried_at = now
            if ok:
                self._pushed = snapshot


class PushRefused(Exception):
    """The API server answered a push with an error."""


class PodPatcher:
    """Merge-patches the report annotation onto one pod over a kept-alive TLS connection."""

    def __init__(self, namespace: str, pod: str, host: str, port: int,
                 directory: str = REPORT_DIR, context: ssl.SSLContext | None = None,
                 connection: type[http.client.HTTPConnection] = http.client.HTTPSConnection):
        self.path = f"/api/v1/namespaces/{namespace}/pods/{pod}"
        self.host, self.port, self.directory = host, port, directory
        self.context = context
        self._connection_type = connection
        self._connection: http.client.HTTPConnection | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PodPatcher | None:
        """The patcher the operator's env and volume describe, or None when they are not all
        there (a pod made by something else, or an older operator): nothing is pushed."""
        pod, namespace = environ.get(ENV_REPORT_POD), environ.get(ENV_REPORT_NAMESPACE)
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        token = os.path.join(REPORT_DIR, REPORT_TOKEN_FILE)
        if not (pod and namespace and host and port and os.path.isfile(token)):
            return None
        context = ssl.create_default_context(cafile=os.path.join(REPORT_DIR, REPORT_CA_FILE))
        return cls(namespace, pod, host, int(port), context=context)

    def patch(self, annotation: str) -> None:
        """One push; raises OSError, http.client.HTTPException or PushRefused. A connection the
        server closed while idle is opened again once."""
        with open(os.path.join(self.directory, REPORT_TOKEN_FILE), encoding="utf-8") as file:
            token = file.read().strip()
        body = json.dumps({"metadata": {"annotations": {REPORT_ANNOTATION: annotation}}})
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json",
                   "Content-Type": "application/merge-patch+json"}
        for attempt in (1, 2):
            connection = self._connect()
            try:
                connection.request("PATCH", self.path, body, headers)
                response = connection.getresponse()
                answer = response.read(MAX_REPORT_BYTES * 4)
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt == 2:
                    raise
                continue
            if response.status >= 300:
                raise PushRefused(_refusal(response.status, answer))
            return

    def _connect(self) -> http.client.HTTPConnection:
        if self._connection is None:
            kwargs = {"context": self.context} if self.context is not None else {}
            self._connection = self._connection_type(self.host, self.port,
                                                     timeout=REQUEST_TIMEOUT, **kwargs)
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def _refusal(status: int, answer: bytes) -> str:
    """The API server's own message (a Status object), else the HTTP status."""
    try:
        message = json.loads(answer).get("message")
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}" + (f": {message}" if message else "")


class Pusher(threading.Thread):
    """Pushes what Reports says is due, every TICK_SECONDS, until stopped; then once more."""

    def __init__(self, reports: Reports, patcher: PodPatcher | None):
        super().__init__(name="report-pusher", daemon=True)
        self.reports, self.patcher = reports, patcher
        self._stop_event = threading.Event()
        self._failing = False

    def run(self) -> None:
        while not self._stop_event.wait(TICK_SECONDS):
            self.push(final=False)

    def finish(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(REQUEST_TIMEOUT * 2 + TICK_SECONDS)
        self.push(final=True)

    def push(self, final: bool) -> None:
        now = time.monotonic()
        snapshot = self.reports.due(now, time.time(), final=final)
        if snapshot is None or self.patcher is None:
            return
        try:
            self.patcher.patch(encode(snapshot))
        except (OSError, http.client.HTTPException, PushRefused) as error:
            self.reports.tried(snapshot, now, ok=False)
            if not self._failing:
                say(f"could not report progress to pod {self.patcher.path.rpartition('/')[2]} "
                    f"({error}); training goes on, the next report tries again")
            self._failing = True
            return
        self.reports.tried(snapshot, now, ok=True)
        if self._failing:
            say("reporting progress again")
        self._failing = False


class Pump(threading.Thread):
    """Copies one pipe to one of the container's streams as bytes arrive, feeding Reports."""

    def __init__(self, source: int, target: int, reports: Reports):
        super().__init__(name=f"pump-{target}", daemon=True)
        self.source, self.target, self.reports = source, target, reports
        self.last_read = time.monotonic()

    def run(self) -> None:
        while True:
            try:
                chunk = os.read(self.source, 65536)
            except InterruptedError:
                continue
            except OSError:
                return
            if not chunk:
                return
            self.last_read = time.monotonic()
            _write_all(self.target, chunk)
            self.reports.feed(self.target, chunk, time.time())


def _write_all(fd: int, data: bytes) -> None:
    """Never raises: the container's stream going away must not block or kill the training."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except InterruptedError:
            continue
        except OSError:
            return


def drain(pumps: Sequence[Pump]) -> None:
    """After the launcher ended: wait until its last bytes are copied. A pipe may stay open in a
    process the launcher left behind (the relay ends only after this one), so wait for quiet,
    not for the end of the pipes."""
    deadline = time.monotonic() + DRAIN_MAX_SECONDS
    while time.monotonic() < deadline and any(p.is_alive() for p in pumps):
        newest = max(p.last_read for p in pumps)
        if time.monotonic() - newest >= DRAIN_QUIET_SECONDS:
            return
        time.sleep(DRAIN_QUIET_SECONDS / 5)


def exit_code(returncode: int) -> int:
    """The launcher's exit code as a shell would give it: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def supervise(argv: Sequence[str], environ: Mapping[str, str],
              patcher: PodPatcher | None) -> int:
    """Run `argv` under this supervisor (the module's docstring); returns its exit code."""
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    env = dict(environ)
    # transformers' KubeflowCallback posts to the relay, whose lines come through the pipe.
    env.update(start_relay(env, node_rank=0, stdout=out_write))
    try:
        child = subprocess.Popen(list(argv), env=env, stdout=out_write, stderr=err_write)
    except OSError as error:
        say(f"cannot run {argv[0]!r} ({error.strerror})")
        return 127
    finally:
        os.close(out_write)
        os.close(err_write)
    for number in FORWARDED_SIGNALS:
        signal.signal(number, lambda received, _frame: child.send_signal(received))
    reports = Reports()
    pumps = [Pump(out_read, sys.stdout.fileno(), reports),
             Pump(err_read, sys.stderr.fileno(), reports)]
    pusher = Pusher(reports, patcher)
    for thread in (*pumps, pusher):
        thread.start()
    returncode = child.wait()
    drain(pumps)
    pusher.finish()
    return exit_code(returncode)


def command(argv: Sequence[str], python: str = sys.executable) -> list[str]:
    """The argv that runs `argv` under this supervisor."""
    return [python, "-m", "accelerate_trainer.supervise", "--", *argv]


def wanted(environ: Mapping[str, str], node_rank: int) -> bool:
    """Pod 0, made by an operator that gave it somewhere to report."""
    return node_rank == 0 and bool(environ.get(ENV_REPORT_POD)) \
        and os.path.isfile(os.path.join(REPORT_DIR, REPORT_TOKEN_FILE))


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="accelerate-trainer: %(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        say("usage: python -m accelerate_trainer.supervise -- PROGRAM [ARGS...]")
        return 2
    patcher = PodPatcher.from_env(os.environ)
    if patcher is None:
        say("no report channel in this pod's env: progress is not reported to the operator")
    return supervise(args, os.environ, patcher)


if __name__ == "__main__":
    sys.exit(main())
