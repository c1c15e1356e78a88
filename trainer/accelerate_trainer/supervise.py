"""`python -m accelerate_trainer.supervise -- ARGV...`: run ARGV (the launcher) as a child, pass
its output through unchanged, report rank 0's progress and signs of life to the operator, and
restart the launcher in place when the operator asks for a new attempt.

Why push: reading rank 0's log through the API server and the kubelet every 5 s cost about 8 ms
of control-plane CPU per second per running job, and more the more a job prints. Here the pod
says what happened, at most once every PUSH_SECONDS, in one HTTPS POST to the report endpoint
the operator serves (contract.py, "the report endpoint"; report_client.py). The pod holds no API
credential: its token's audience is the operator's, and the operator decides who may report
what (a live pod of the job; progress only from pod 0).

Why the parent of the launcher, not a process beside it: a container ends when its first process
does, and a process beside it would be killed with output not yet copied (the last lines of a
traceback). accelerate-trainer execs this module on pod 0; it starts the launcher with stdout and
stderr on pipes, copies every byte to the container's own as it arrives, forwards the signals
Kubernetes sends (SIGTERM: checkpoint and stop), and exits with the launcher's code after the last
push.

What is pushed: the newest `ACCELERATE_PROGRESS {json}` line on either stream (the script's own,
or accelerate_trainer.progress's) and when it came, when anything was last written, and the
library versions the training runs with (versions.py; the operator shows them in
status.trainer): the one channel from the trainer to the operator, which reads no pod log.
(transformers' KubeflowCallback posts its trainerStatus to the same endpoint itself: the
operator gives pod 0 KUBEFLOW_TRAINER_SERVER_URL, _TOKEN and _CA_CERT.) The first progress goes
at once (unless a push was tried in the last QUIET_SECONDS): `kubectl get` shows a new group's
first step soon. After it, a push happens when the progress changed and PUSH_SECONDS have
passed since the last one; while output goes on with no new progress, every HEARTBEAT_SECONDS;
once output has paused QUIET_SECONDS (stall detection then sees the true last sign of life); and
at the end. What the endpoint answers, and what is
tried again when (Retry-After, backoff), is Pusher's; a failed push is said once on stderr and
never stops the training.

In-place restarts (spec.runPolicy.restartInPlace, `Supervisor`): every pod of such a job runs
under this module. When its launcher ends with a non-zero code, the pod does not end: it reports
the exit (attempt, code, last lines of stderr) at once, tried until the endpoint takes it, and
waits up to HOLD_SECONDS for the operator, which counts the restart against backoffLimit and
writes the next attempt onto every pod of the group (contract.RUN_ATTEMPT_ANNOTATION, seen here
through the downward API). Each pod then stops whatever of the last attempt still runs (its
ranks may hang in a collective on the dead one: NCCL does), and launches the new attempt with
ACCELERATE_JOB_ATTEMPT set and ACCELERATE_RESUME_FROM at the newest complete checkpoint: no pod
is deleted, scheduled or pulled again. Why the operator decides and not torchrun's
`--max_restarts`: each restart is counted, with its cause, before it happens; a rank is the
same pod's whatever the rendezvous; and a pod or node lost still takes the group restart.

Why no `kubernetes` package: this runs in the user's training image, which need not have it (nor
its pydantic, which may clash with the user's pins); it makes one kind of request, a POST to
the operator, with the standard library (report_client.py).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

from . import cgroup_memory, root_cause
from .checkpoints import find_resume_checkpoint
from .command import DEFAULT_RENDEZVOUS_TIMEOUT, ENV_RENDEZVOUS_TIMEOUT
from .contract import (
    ENV_CHECKPOINT_DIR,
    ENV_JOB_ATTEMPT,
    ENV_JOB_NAME,
    ENV_NODE_RANK,
    ENV_NUM_NODES,
    ENV_REPORT_URL,
    MAX_BODY_BYTES,
    PROGRESS_LINE,
    PROGRESS_PREFIX,
    REPORT_DIR,
    REPORT_TOKEN_FILE,
    RUN_ATTEMPT_FILE,
)
from .error_files import ENV_LAUNCH_REPORT, read_json
from .report_client import REQUEST_TIMEOUT, Answer, BadReportURL, ReportClient
from .termination import write_termination_message
from .versions import read_versions

# At most one push per this while the progress changes: the freshness a user sees (progress in
# `kubectl get` under 10 s old), and slower than the 5 s that KEP-2779's clients keep to.
PUSH_SECONDS = 8.0
# While output goes on with the same progress: well under the smallest stallTimeoutSeconds (30),
# so a job that prints is never taken for a stalled one.
HEARTBEAT_SECONDS = 10.0
QUIET_SECONDS = 3.0        # output paused this long: say when it last came
TICK_SECONDS = 0.5
# A push that got no answer (or a 5xx with no Retry-After) is tried again after this, doubling
# up to the max, with jitter (backoff()): an operator failing over is back within seconds.
BACKOFF_SECONDS, BACKOFF_MAX_SECONDS = 1.0, 10.0
RETRIED = (429, 503)  # the endpoint is busy or not the active replica: Retry-After
REFUSED = (400, 401, 403, 404, 413)  # this report or this pod is refused: not sent again
DRAIN_QUIET_SECONDS = 0.25  # after the launcher ended: its last bytes are copied when quiet
DRAIN_MAX_SECONDS = 2.0
MAX_PARTIAL_LINE = 64 * 1024
# A report is at most what the endpoint takes (MAX_BODY_BYTES, less room for the body around
# it); the short fields are kept when the script's progress object (its metrics) would exceed it.
MAX_REPORT_BYTES = MAX_BODY_BYTES - 1024
CORE_FIELDS = ("step", "total_steps", "epoch", "loss", "samples_per_second", "eta_seconds")
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                     signal.SIGUSR1, signal.SIGUSR2)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_PREFIX = PROGRESS_PREFIX.encode()
# In-place restarts (Supervisor): how often the attempt file is read while a launch runs or
# waits, and how long a pod whose launch failed waits for the operator's next attempt before it
# ends (the pod then fails, and the operator restarts the whole group as for any failed pod).
ATTEMPT_POLL_SECONDS = 0.2
HOLD_SECONDS = 60.0
# A launch that failed only because a peer went away (root_cause.PEER_LOST) says so this much
# later, in a job of several pods: the pod whose rank died (killed for memory, by a signal)
# reports within a second or two, so the job's failure opens with it, not with this symptom.
PEER_SETTLE_SECONDS = 5.0
# A failed launch's message: its last lines on stderr.
TAIL_BYTES, TAIL_LINES, TAIL_CHARS = 8192, 12, 1500
STDERR = 2
RESUME_ENV = "ACCELERATE_RESUME_FROM"
# torchrun's --rdzv-id, read from the env by its parser (accelerate does not pass one).
RDZV_ID_ENV = "PET_RDZV_ID"


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
    exit: Mapping[str, Any] | None = None  # a failed launch the pod waits on (contract.py)
    attempt: int | None = None  # the launch's attempt: its progress is that attempt's
    # Restarted in place: the last step the attempt before printed, and when (contract.py).
    previous: Mapping[str, Any] | None = None
    versions: Mapping[str, str] | None = None  # pod 0's: the libraries it trains with


def _stamp(moment: float | None) -> str | None:
    if moment is None:
        return None
    return datetime.fromtimestamp(moment, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def encode(snapshot: Snapshot) -> str:
    """The report (contract.py) as JSON, cut to MAX_REPORT_BYTES: metrics go first."""
    when, progress_time = _stamp(snapshot.last_output), _stamp(snapshot.progress_time)
    ended: dict[str, Any] = {"exit": dict(snapshot.exit)} if snapshot.exit is not None else {}
    for key in ("attempt", "previous", "versions"):
        if getattr(snapshot, key) is not None:
            ended[key] = getattr(snapshot, key)
    for progress in (snapshot.progress,
                     {k: v for k, v in (snapshot.progress or {}).items() if k in CORE_FIELDS}):
        report = {"progress": progress, "lastOutputTime": when, **ended}
        if progress is not None and progress_time is not None:
            report["progressTime"] = progress_time
        value = json.dumps(report, separators=(",", ":"))
        if len(value.encode()) <= MAX_REPORT_BYTES:
            return value
    return json.dumps({"progress": None, "lastOutputTime": when, **ended},
                      separators=(",", ":"))


class Reports:
    """What the output has shown and what of it was pushed; fed by the pump threads, read by
    the pusher's. `progress` False (a pod other than 0): only a failed launch is reported."""

    def __init__(self, progress: bool = True,
                 versions: Mapping[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        self._partial: dict[int, bytes] = {}
        self.current = Snapshot(None, None, versions=versions)
        self._pushed = Snapshot(None, None)
        self._tried_at: float | None = None  # monotonic
        self.progress = progress
        self._tail = b""  # the newest bytes on stderr: a failed launch's message
        self.wake = threading.Event()  # set when a report must go at once

    def ended(self, attempt: int, code: int, now: float,
              cause: root_cause.RootCause | None = None) -> None:
        """The launch of `attempt` failed with `code` at wall time `now`: report it at once, with
        the last lines it wrote on stderr (a traceback, torchrun's summary) and its root cause
        (root_cause.py) where one is known."""
        ended = {"attempt": attempt, "exitCode": code, "time": _stamp(now),
                 "message": self.tail(), **(cause.report() if cause else {})}
        with self._lock:
            self.current = replace(self.current, exit=ended)
        self.wake.set()

    def tail(self) -> str:
        """The last lines the launch wrote on stderr."""
        lines = self._tail.decode("utf-8", "replace").strip().splitlines()[-TAIL_LINES:]
        return "\n".join(lines)[-TAIL_CHARS:]

    def launched(self, attempt: int) -> None:
        """A new launch runs: the last one's failure and progress are no longer news."""
        with self._lock:
            current = self.current
            if current.attempt in (None, attempt):
                self.current = replace(current, exit=None, attempt=attempt)
            else:
                step = (current.progress or {}).get("step")
                previous = {"attempt": current.attempt, "step": step,
                            "progressTime": _stamp(current.progress_time)} \
                    if step is not None else current.previous
                self.current = Snapshot(None, current.last_output, None, None, attempt,
                                        previous, current.versions)
        self._tail = b""

    def feed(self, stream: int, chunk: bytes, now: float) -> None:
        """Bytes the launcher wrote on `stream` at wall time `now`."""
        if stream == STDERR:
            self._tail = (self._tail + chunk)[-TAIL_BYTES:]
        if not self.progress:
            return
        data = self._partial.pop(stream, b"") + chunk
        lines = data.split(b"\n")
        self._partial[stream] = lines.pop()[-MAX_PARTIAL_LINE:]
        report = None
        if _PREFIX in data:
            for line in lines:
                report = parse_progress_line(line) or report
        with self._lock:
            current = self.current
            self.current = (replace(current, progress=report, last_output=now,
                                    progress_time=now) if report is not None
                            else replace(current, last_output=now))

    def due(self, now: float, wall: float, final: bool = False) -> Snapshot | None:
        """What to push now (monotonic `now`, wall clock `wall`), or None (the module's rule)."""
        with self._lock:
            current, pushed = self.current, self._pushed
            since = math.inf if self._tried_at is None else now - self._tried_at
        if current.exit is not None and current.exit != pushed.exit:
            return current
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


def backoff(failures: int) -> float:
    """Seconds before the next try after `failures` unanswered ones in a row: doubling from
    BACKOFF_SECONDS up to BACKOFF_MAX_SECONDS, with jitter, so the pods of many jobs that lost
    the endpoint together (a failover) do not come back together."""
    return min(BACKOFF_MAX_SECONDS, BACKOFF_SECONDS * 2 ** min(failures, 16)) \
        * random.uniform(0.5, 1.0)


class Pusher(threading.Thread):
    """Pushes what Reports says is due, every TICK_SECONDS, until stopped; then once more.
    Reports.due gives the newest snapshot, so one that waits (Retry-After, backoff) is replaced
    by a newer one, never queued behind it. Answers (contract.py): 200 taken; 429 and 503 tried
    again after their Retry-After, no answer at all after a backoff; a refusal (400, 401, 403,
    404, 413) is not sent again, what comes after it is. Each distinct failure is said once on
    stderr, until a report is taken again; none stops the training."""

    def __init__(self, reports: Reports, client: ReportClient | None):
        super().__init__(name="report-pusher", daemon=True)
        self.reports, self.client = reports, client
        self._stop_event = threading.Event()
        self._lock = threading.Lock()  # finish() pushes from the main thread
        self._retry_at = 0.0  # monotonic: no try before (Retry-After, backoff)
        self._failures = 0  # tries in a row with no answer, or a 5xx: the backoff's exponent
        self._said: set[str] = set()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.reports.wake.wait(TICK_SECONDS)
            self.reports.wake.clear()
            if not self._stop_event.is_set():
                self.push(final=False)

    def finish(self) -> None:
        self._stop_event.set()
        self.reports.wake.set()
        if self.is_alive():
            self.join(REQUEST_TIMEOUT * 2 + TICK_SECONDS)
        self.push(final=True)

    def push(self, final: bool) -> None:
        """Push the due snapshot, if any; `final` (the launcher ended): now, whatever waits."""
        with self._lock:
            now = time.monotonic()
            if self.client is None or (not final and now < self._retry_at):
                return
            snapshot = self.reports.due(now, time.time(), final=final)
            if snapshot is None:
                return
            try:
                answer = self.client.post_report(encode(snapshot))
            except (OSError, http.client.HTTPException) as error:
                self._unanswered(snapshot, now, type(error).__name__, f"got no answer ({error})")
                return
            self._answered(snapshot, now, answer)

    def _answered(self, snapshot: Snapshot, now: float, answer: Answer) -> None:
        status = answer.status
        said = f"answered {status}" + (f" ({answer.message})" if answer.message else "")
        if status == 200:
            self.reports.tried(snapshot, now, ok=True)
            self._retry_at, self._failures = 0.0, 0
            if self._said:
                say(f"the operator's report endpoint takes reports again ({self.client.url})")
            self._said.clear()
        elif status in REFUSED:
            # Not the endpoint's state but this report's or this pod's: the same report would be
            # refused again. It counts as sent; newer ones still go.
            self.reports.tried(snapshot, now, ok=True)
            self._say_once(str(status), f"{said}; that report is not sent again")
        elif status in RETRIED and answer.retry_after is not None:
            self.reports.tried(snapshot, now, ok=False)
            self._retry_at = now + answer.retry_after
            self._say_once(str(status), f"{said}; trying again in {answer.retry_after:.0f}s")
        else:
            self._unanswered(snapshot, now, str(status), said)

    def _unanswered(self, snapshot: Snapshot, now: float, key: str, said: str) -> None:
        self.reports.tried(snapshot, now, ok=False)
        delay = backoff(self._failures)
        self._failures += 1
        self._retry_at = now + delay
        self._say_once(key, f"{said}; trying again in {delay:.0f}s and backing off")

    def _say_once(self, key: str, said: str) -> None:
        if key not in self._said:
            self._said.add(key)
            say(f"report to {self.client.url} {said}; training goes on")


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
    process the launcher left behind, so wait for quiet, not for the end of the pipes."""
    deadline = time.monotonic() + DRAIN_MAX_SECONDS
    while time.monotonic() < deadline and any(p.is_alive() for p in pumps):
        newest = max(p.last_read for p in pumps)
        if time.monotonic() - newest >= DRAIN_QUIET_SECONDS:
            return
        time.sleep(DRAIN_QUIET_SECONDS / 5)


def exit_code(returncode: int) -> int:
    """The launcher's exit code as a shell would give it: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


class Attempts:
    """The attempt the operator wants this pod's processes to run: RUN_ATTEMPT_FILE, the
    downward API's copy of the pod's RUN_ATTEMPT_ANNOTATION (the kubelet refreshes it about
    0.2 s after the operator writes it). None of it when the pod has no such file: an older
    operator's pod, or spec.runPolicy.restartInPlace false; a failed launch then ends the pod."""

    def __init__(self, path: str):
        self.path = path

    def read(self) -> int | None:
        try:
            with open(self.path, encoding="utf-8") as file:
                return int(file.read().strip())
        except (OSError, ValueError):
            return None

    def newer(self, attempt: int) -> int | None:
        value = self.read()
        return value if value is not None and value > attempt else None


@dataclass
class Launch:
    """What each attempt runs: the launcher's argv and env, and where checkpoints are, to resume
    an attempt after the first from the newest complete one."""

    argv: Sequence[str]
    env: dict[str, str]
    checkpoint_dir: str | None = None

    def env_for(self, attempt: int, first: bool) -> dict[str, str]:
        """The env of `attempt`: ACCELERATE_JOB_ATTEMPT, a rendezvous id of its own (a launcher
        of the next attempt that reaches the last one's store, not yet stopped, waits under
        another prefix instead of joining it), and, after the first, the checkpoint to resume."""
        env = {**self.env, ENV_JOB_ATTEMPT: str(attempt),
               RDZV_ID_ENV: f"{self.env.get(ENV_JOB_NAME, 'job')}-{attempt}"}
        if not first and self.checkpoint_dir:
            env.pop(RESUME_ENV, None)
            resume = find_resume_checkpoint(self.checkpoint_dir)
            if resume is not None:
                env[RESUME_ENV] = str(resume)
                say(f"attempt {attempt} resumes from {resume}")
        return env


class Supervisor:
    """Runs the launches of one pod (the module's docstring) and says how they ended."""

    def __init__(self, launch: Launch, node_rank: int, attempts: Attempts | None,
                 versions: Mapping[str, str] | None = None):
        self.launch, self.attempts = launch, attempts
        self.reports = Reports(progress=node_rank == 0, versions=versions)
        self.node_rank = node_rank
        self.child: subprocess.Popen | None = None
        self.stopping = False  # Kubernetes asked the pod to stop: no launch after this one
        self.stop_signal = signal.SIGTERM  # the signal it asked with
        self.pending: list[int] = []  # stop signals that came while no launcher ran
        # Where the launcher's hook says why it failed (error_files.py), the container's memory
        # counters when the launch began, and the root cause of the last failed launch.
        self.launch_report = os.path.join(tempfile.gettempdir(),
                                          f"accelerate-trainer-launch-{os.getpid()}.json")
        self.memory: cgroup_memory.MemoryState | None = None
        self.cause: root_cause.RootCause | None = None

    def signal(self, received: int) -> None:
        if received in STOP_SIGNALS:
            self.stopping, self.stop_signal = True, received
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(received)
        elif received in STOP_SIGNALS:
            # No launcher runs, or one is being started (Popen has forked but not returned):
            # the next one gets it as soon as it exists, or it would train on past the stop.
            self.pending.append(received)

    def start(self, attempt: int, first: bool, out: int, err: int) -> bool:
        argv = list(self.launch.argv)
        env = {**self.launch.env_for(attempt, first), ENV_LAUNCH_REPORT: self.launch_report}
        with contextlib.suppress(OSError):
            os.unlink(self.launch_report)
        self.memory, self.cause = cgroup_memory.read(), None
        try:
            self.child = subprocess.Popen(argv, env=env, stdout=out, stderr=err)
        except OSError as error:
            say(f"cannot run {argv[0]!r} ({error.strerror})")
            return False
        while self.pending:
            self.child.send_signal(self.pending.pop(0))
        self.reports.launched(attempt)
        return True

    def wait(self, attempt: int) -> int | None:
        """Until the launcher ends (its exit code) or the operator asks for a newer attempt
        (None: the launcher is stopped first, with everything it started)."""
        assert self.child is not None
        while True:
            try:
                return exit_code(self.child.wait(timeout=ATTEMPT_POLL_SECONDS))
            except subprocess.TimeoutExpired:
                pass
            if self.attempts is not None and not self.stopping \
                    and self.attempts.newer(attempt) is not None:
                stop_tree(self.child.pid)
                self.child.wait()
                return None

    def explain(self) -> root_cause.RootCause | None:
        """Why the launch that just ended failed (root_cause.py)."""
        after = cgroup_memory.read()
        limit = (after or self.memory or cgroup_memory.MemoryState(0, None)).limit
        timeout = self.launch.env.get(ENV_RENDEZVOUS_TIMEOUT) or str(DEFAULT_RENDEZVOUS_TIMEOUT)
        return root_cause.from_launch(read_json(self.launch_report),
                                      oom_kills=cgroup_memory.kills_between(self.memory, after),
                                      memory_limit=limit, rendezvous_timeout=timeout)

    def settle(self, attempt: int) -> int | None:
        """After a launch that failed only because a peer went away, in a job of several pods:
        wait PEER_SETTLE_SECONDS before saying so (the constant's comment). A newer attempt the
        operator asks for meanwhile is returned: this failure is then no news."""
        lost = self.cause is not None and self.cause.reason == root_cause.PEER_LOST
        if not lost or int(self.launch.env.get(ENV_NUM_NODES) or 1) < 2:
            return None
        deadline = time.monotonic() + PEER_SETTLE_SECONDS
        while time.monotonic() < deadline and not self.stopping:
            newer = self.attempts.newer(attempt) if self.attempts is not None else None
            if newer is not None:
                return newer
            time.sleep(ATTEMPT_POLL_SECONDS)
        return None

    def hold(self, attempt: int, code: int) -> int | None:
        """After a failed launch: report it, then wait for the operator's next attempt (None:
        it did not come within HOLD_SECONDS, or the pod is being stopped)."""
        assert self.attempts is not None
        self.reports.ended(attempt, code, time.time(), self.cause)
        deadline = time.monotonic() + HOLD_SECONDS
        while time.monotonic() < deadline and not self.stopping:
            newer = self.attempts.newer(attempt)
            if newer is not None:
                return newer
            time.sleep(ATTEMPT_POLL_SECONDS)
        say(f"no new attempt from the operator within {HOLD_SECONDS:.0f}s; ending the pod")
        return None

    def run(self, attempt: int, out: int, err: int) -> int:
        """Launch `attempt`, and the next ones the operator asks for; the last exit code."""
        first = True
        while self.start(attempt, first, out, err):
            code = self.wait(attempt)
            first = False
            if code:
                self.cause = self.explain()
                code = None if self.settle(attempt) is not None else code
            if code is None:  # the operator moved on while this attempt ran
                stop_orphans()
                attempt = self.attempts.read() or attempt + 1  # type: ignore[union-attr]
                say(f"restarting in place as attempt {attempt}")
                continue
            if self.stopping:
                return stop_leftovers(self.stop_signal, code)
            if code == 0 or self.attempts is None:
                return code
            say(f"attempt {attempt} ended with exit code {code}; waiting for the operator")
            newer = self.hold(attempt, code)
            if newer is None:
                return code
            stop_orphans()
            attempt = newer
            say(f"restarting in place as attempt {attempt}")
        return 127


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent_pid(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    return children


def stop_tree(pid: int, children: dict[int, list[int]] | None = None) -> None:
    """SIGKILL `pid` and every process under it. torchrun starts each rank in a session of its
    own, so a process group would miss them; /proc's parent links do not. No checkpoint is
    possible here anyway: a rank of the group has already ended, and saving takes every rank."""
    children = _children() if children is None else children
    doomed, todo = [], [pid]
    while todo:
        current = todo.pop()
        doomed.append(current)
        todo.extend(children.get(current, ()))
    for victim in doomed:
        try:
            os.kill(victim, signal.SIGKILL)
        except OSError:
            pass


def stop_orphans() -> None:
    """Ranks a failed launcher left behind are this process's children once it is PID 1 (the
    container's first process): stopped, and reaped, before the next attempt."""
    if os.getpid() != 1:
        return
    children = _children()
    for orphan in children.get(1, ()):
        stop_tree(orphan, children)
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def stop_leftovers(signal_number: int, code: int) -> int:
    """The pod is being stopped and its launcher has ended: the processes it left behind get the
    stop signal too, and are waited for; the last one's exit code is the pod's. accelerate's
    simple launcher (one process on one machine) passes no signal on and dies of SIGTERM at once,
    leaving the script, which would die with this process (PID 1) before it could save. The
    kubelet's SIGKILL at the end of the pod's grace period bounds the wait."""
    if os.getpid() != 1:
        return code
    leftovers = _children().get(1, [])
    for pid in leftovers:
        with contextlib.suppress(OSError):
            os.kill(pid, signal_number)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return code
        if pid in leftovers:
            code = exit_code(os.waitstatus_to_exitcode(status))


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return int(file.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def supervise(launch: Launch, client: ReportClient | None, node_rank: int = 0,
              attempts: Attempts | None = None,
              versions: Mapping[str, str] | None = None) -> int:
    """Run the launch under this supervisor (the module's docstring); returns its exit code.
    `versions` go in pod 0's reports."""
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    supervisor = Supervisor(launch, node_rank, attempts, versions)
    for number in FORWARDED_SIGNALS:
        signal.signal(number, lambda received, _frame: supervisor.signal(received))
    pumps = [Pump(out_read, sys.stdout.fileno(), supervisor.reports),
             Pump(err_read, sys.stderr.fileno(), supervisor.reports)]
    pusher = Pusher(supervisor.reports, client)
    for thread in (*pumps, pusher):
        thread.start()
    told = attempts.read() if attempts is not None else None
    attempt = told if told is not None else int(launch.env.get(ENV_JOB_ATTEMPT) or 0)
    try:
        code = supervisor.run(attempt, out_write, err_write)
    finally:
        os.close(out_write)
        os.close(err_write)
    drain(pumps)
    pusher.finish()
    if code and supervisor.cause is not None:
        write_termination_message(termination_text(supervisor.cause, supervisor.reports.tail()))
    return code


def termination_text(cause: root_cause.RootCause, tail: str) -> str:
    """The pod's last word after a failed launch: the root cause first, then its last lines."""
    return f"{cause.text}\n\n{tail}"


def command(argv: Sequence[str], python: str = sys.executable) -> list[str]:
    """The argv that runs `argv` under this supervisor."""
    return [python, "-m", "accelerate_trainer.supervise", "--", *argv]


def wanted(environ: Mapping[str, str], node_rank: int) -> bool:
    """A pod made by an operator that gave it somewhere to report: pod 0 reports progress, and
    every pod restarted in place (an attempt file) reports a failed launch."""
    if not (environ.get(ENV_REPORT_URL)
            and os.path.isfile(os.path.join(REPORT_DIR, REPORT_TOKEN_FILE))):
        return False
    return node_rank == 0 or os.path.isfile(os.path.join(REPORT_DIR, RUN_ATTEMPT_FILE))


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="accelerate-trainer: %(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        say("usage: python -m accelerate_trainer.supervise -- PROGRAM [ARGS...]")
        return 2
    try:
        client = ReportClient.from_env(os.environ)
    except BadReportURL as error:
        say(f"{error}; progress is not reported to the operator")
        client = None
    else:
        if client is None:
            say("no report endpoint in this pod's env: progress is not reported to the operator")
    attempt_file = os.path.join(REPORT_DIR, RUN_ATTEMPT_FILE)
    attempts = Attempts(attempt_file) if os.path.isfile(attempt_file) else None
    launch = Launch(args, dict(os.environ), os.environ.get(ENV_CHECKPOINT_DIR))
    node_rank = int(os.environ.get(ENV_NODE_RANK) or 0)
    # The versions of this interpreter's path, which has the requirements the job installed.
    versions = read_versions() if node_rank == 0 else None
    return supervise(launch, client, node_rank, attempts, versions)


if __name__ == "__main__":
    sys.exit(main())
