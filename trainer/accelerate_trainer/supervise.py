"""`python -m accelerate_trainer.supervise -- ARGV...`: run ARGV (the launcher) as a child, pass
its output through unchanged, report rank 0's progress and signs of life to the operator, and
restart the launcher in place when the operator asks for a new attempt.

What is reported, when, and how it is pushed (one HTTPS POST to the operator's report endpoint,
no API credential): report_push.py. How the processes a launch leaves behind are stopped, this
being the container's PID 1: processes.py.

Why the parent of the launcher, not a process beside it: a container ends when its first process
does, and a process beside it would be killed with output not yet copied (the last lines of a
traceback). accelerate-trainer execs this module on pod 0; it starts the launcher with stdout and
stderr on pipes, copies every byte to the container's own as it arrives, forwards the signals
Kubernetes sends (SIGTERM: checkpoint and stop), and exits with the launcher's code after the last
push.

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

Why the standard library only: this runs in the user's training image, which must gain no
dependency (nor clash with the user's pins).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
    MAX_MESSAGE_CHARS,
    REPORT_DIR,
    REPORT_TOKEN_FILE,
    RUN_ATTEMPT_FILE,
)
from .error_files import ENV_LAUNCH_REPORT, read_json
from .processes import exit_code, stop_leftovers, stop_orphans, stop_tree
from .pumps import Pump, catch_up, drain
from .report_client import BadReportURL, ReportClient
from .report_push import Pusher, Reports, say
from .termination import write_termination_message
from .versions import read_versions

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                     signal.SIGUSR1, signal.SIGUSR2)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# In-place restarts (Supervisor): how often the attempt file is read while a launch runs or
# waits, and how long a pod whose launch failed waits for the operator's next attempt before it
# ends (the pod then fails, and the operator restarts the whole group as for any failed pod).
ATTEMPT_POLL_SECONDS = 0.2
HOLD_SECONDS = 60.0
# A launch that failed only because a peer went away (root_cause.PEER_LOST) says so this much
# later, in a job of several pods: the pod whose rank died (killed for memory, by a signal)
# reports within a second or two, so the job's failure opens with it, not with this symptom.
PEER_SETTLE_SECONDS = 5.0
RESUME_ENV = "ACCELERATE_RESUME_FROM"
# torchrun's --rdzv-id, read from the env by its parser (accelerate does not pass one).
RDZV_ID_ENV = "PET_RDZV_ID"


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
        self.pumps: Sequence[Pump] = ()  # the threads copying the launcher's output (supervise)

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
        catch_up(self.pumps)
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
    # accelerate-trainer blocks them across its exec of this module (hold_stops_across_exec):
    # one that came meanwhile is taken now, by the handlers above.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    pumps = [Pump(out_read, sys.stdout.fileno(), supervisor.reports),
             Pump(err_read, sys.stderr.fileno(), supervisor.reports)]
    supervisor.pumps = pumps
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


def termination_text(cause: root_cause.RootCause, tail: str,
                     limit: int = MAX_MESSAGE_CHARS) -> str:
    """The pod's last word after a failed launch: the root cause first, whole, then as many of
    its last lines as fit in `limit`, the operator's cap: it keeps a message's end, so a longer
    one would lose the cause."""
    head = cause.text[:limit]
    room = limit - len(head) - 2
    mark = "[...]"
    if room <= len(mark):
        return head
    kept = tail if len(tail) <= room else mark + tail[-(room - len(mark)):]
    return f"{head}\n\n{kept}"


def command(argv: Sequence[str], python: str = sys.executable) -> list[str]:
    """The argv that runs `argv` under this supervisor."""
    return [python, "-m", "accelerate_trainer.supervise", "--", *argv]


def wanted(environ: Mapping[str, str], node_rank: int, pid: int) -> bool:
    """Where the launcher runs under this supervisor: a pod made by an operator that gave it
    somewhere to report (pod 0 reports progress, every pod restarted in place, with an attempt
    file, reports a failed launch), and wherever the trainer is its container's PID 1 (`pid`).
    The kernel drops a signal PID 1 has no handler for, and torch's agent handles SIGTERM only
    once it starts the ranks: a launcher exec'd as PID 1 held its pod for the whole grace
    period when stopped while importing torch or waiting in the rendezvous. Under the
    supervisor it is not PID 1, so the stop ends it at once (143), and once the ranks run they
    get the SIGTERM the supervisor passes on, as under a plain `accelerate launch`."""
    if pid == 1:
        return True
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
        if client is None and int(os.environ.get(ENV_NODE_RANK) or 0) == 0:
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
