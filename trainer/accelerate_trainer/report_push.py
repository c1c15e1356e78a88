"""What pod 0's supervisor (supervise.py) tells the operator, and how: the report it picks out of
the launcher's output (`Reports`, encoded by `encode`), and the thread that pushes it (`Pusher`).

Why push: reading rank 0's log through the API server and the kubelet every 5 s cost about 8 ms
of control-plane CPU per second per running job, and more the more a job prints. Here the pod
says what happened, at most once every PUSH_SECONDS, in one HTTPS POST to the report endpoint
the operator serves (contract.py, "the report endpoint"; report_client.py). The pod holds no API
credential: its token's audience is the operator's, and the operator decides who may report
what (a live pod of the job; progress only from pod 0).

What is pushed: the newest `ACCELERATE_PROGRESS {json}` line on either stream (the script's own,
or accelerate_trainer.progress's) and when it came, when anything was last written, and the
library versions the training runs with (versions.py; the operator shows them in
status.trainer): the one channel from the trainer to the operator, which reads no pod log.
(transformers' KubeflowCallback posts its trainerStatus to the same endpoint itself: the
operator gives pod 0 KUBEFLOW_TRAINER_SERVER_URL, _TOKEN and _CA_CERT.) The first progress goes
at once (unless a push was tried in the last QUIET_SECONDS): `kubectl get` shows a new group's
first step soon. After it, a push happens when the progress changed and the pace has passed
since the last one; while output goes on with no new progress, every HEARTBEAT_SECONDS (or the
pace, when longer); once output has paused QUIET_SECONDS (stall detection then sees the true
last sign of life); and at the end. The pace is what the operator's last 200 said
(contract.NEXT_REPORT_KEY: when it next writes the job's progress, so a report is written as it
comes), PUSH_SECONDS until it says. A pod restarted in place (supervise.py) reports a failed
launch (`Reports.ended`) at once, tried until the endpoint takes it. What the endpoint
answers, and what is tried again when (Retry-After, backoff), is Pusher's; a failed push is said
once on stderr and never stops the training.

Why no `kubernetes` package: this runs in the user's training image, which need not have it (nor
its pydantic, which may clash with the user's pins); it makes one kind of request, a POST to
the operator, with the standard library (report_client.py).
"""

from __future__ import annotations

import http.client
import json
import math
import random
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

from . import root_cause
from .contract import MAX_BODY_BYTES, PROGRESS_LINE, PROGRESS_PREFIX
from .report_client import REQUEST_TIMEOUT, Answer, ReportClient

# At most one push per this while the progress changes, until the operator sets the pace
# (contract.NEXT_REPORT_KEY); slower than the 5 s that KEP-2779's clients keep to.
PUSH_SECONDS = 8.0
# While output goes on with the same progress (or the pace, when longer: at most 15 s): well
# under the smallest stallTimeoutSeconds (30), so a job that prints is never taken for a stalled
# one.
HEARTBEAT_SECONDS = 10.0
QUIET_SECONDS = 3.0        # output paused this long: say when it last came
TICK_SECONDS = 0.5
# A push that got no answer (or a 5xx with no Retry-After) is tried again after this, doubling
# up to the max, with jitter (backoff()): an operator failing over is back within seconds.
BACKOFF_SECONDS, BACKOFF_MAX_SECONDS = 1.0, 10.0
RETRIED = (429, 503)  # the endpoint is busy or not the active replica: Retry-After
REFUSED = (400, 401, 403, 404, 413)  # this report or this pod is refused: not sent again
MAX_PARTIAL_LINE = 64 * 1024
# A report is at most what the endpoint takes (MAX_BODY_BYTES, less room for the body around
# it); the short fields are kept when the script's progress object (its metrics) would exceed it.
MAX_REPORT_BYTES = MAX_BODY_BYTES - 1024
CORE_FIELDS = ("step", "total_steps", "epoch", "loss", "samples_per_second", "eta_seconds")
_PREFIX = PROGRESS_PREFIX.encode()
# A failed launch's message: its last lines on stderr.
TAIL_BYTES, TAIL_LINES, TAIL_CHARS = 8192, 12, 1500
STDERR = 2


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
        self.pace = PUSH_SECONDS  # seconds between progress pushes: the operator's, once said
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
            current, pushed, pace = self.current, self._pushed, self.pace
            since = math.inf if self._tried_at is None else now - self._tried_at
        if current.exit is not None and current.exit != pushed.exit:
            return current
        new_progress = current.progress != pushed.progress
        new_output = current.last_output != pushed.last_output
        if not (new_progress or new_output):
            return None
        quiet = current.last_output is not None and wall - current.last_output >= QUIET_SECONDS
        first = new_progress and pushed.progress is None and since >= QUIET_SECONDS
        if final or first or (since >= pace and (new_progress or quiet)) \
                or since >= max(HEARTBEAT_SECONDS, pace):
            return current
        return None

    def tried(self, snapshot: Snapshot, now: float, ok: bool,
              next_report: float | None = None) -> None:
        """A push of `snapshot` at `now`, taken (`ok`) or not; `next_report`: the pace the
        operator's answer set (report_client bounds it)."""
        with self._lock:
            self._tried_at = now
            if ok:
                self._pushed = snapshot
            if next_report is not None:
                self.pace = next_report


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
            self.reports.tried(snapshot, now, ok=True, next_report=answer.next_report)
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
