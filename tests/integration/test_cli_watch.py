"""The CLI's watches against the REAL API server, with no operator: the test fabricates
AccelerateJobs and writes their status itself (`kubectl patch --subresource=status`), as the
operator would, and pods of its own for `logs -f`. `wait`, `status --watch` and `top` must follow
each change as the server sends it, `logs -f` must follow a pod's log and then its replacement.

The operator the chart deployed is scaled to zero meanwhile (as in test_operator_in_process.py),
so that nothing else writes these jobs' status or creates their pods."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from accelerate_trainer.contract import ATTEMPT_LABEL, JOB_NAME_LABEL

from devtools.cluster import create_namespace, delete_namespace, kubectl, wait_for
from devtools.images import PYTHON_IMAGE
from tests.helpers.jobs import JobBuilder

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ns(kubeconfig: str, deployed_operator_stopped: None) -> Iterator[str]:
    name = create_namespace(kubeconfig, prefix="cli-watch")
    yield name
    delete_namespace(kubeconfig, name)


def create_job(kubeconfig: str, namespace: str, name: str, nodes: int = 1) -> None:
    body = (JobBuilder(name, namespace).nodes(nodes).procs(1)
            .config(compute_environment="LOCAL_MACHINE", distributed_type="MULTI_CPU",
                    use_cpu=True, mixed_precision="no")
            .image(PYTHON_IMAGE).command("pass").for_server(namespace).build())
    kubectl("-n", namespace, "create", "-f", "-", kubeconfig=kubeconfig, input=json.dumps(body))


def set_status(kubeconfig: str, namespace: str, name: str, **status) -> None:
    kubectl("-n", namespace, "patch", "acceleratejob", name, "--subresource=status",
            "--type=merge", "-p", json.dumps({"status": status}), kubeconfig=kubeconfig)


def progress(step: int, total: int = 40, eta: str = "1m") -> dict:
    return {"step": step, "totalSteps": total, "summary": f"{step}/{total} "
            f"({step * 100 // total}%)", "eta": eta, "etaSeconds": 60}


def condition(type_: str, reason: str = "Test", message: str = "") -> list[dict]:
    return [{"type": type_, "status": "True", "reason": reason, "message": message,
             "lastTransitionTime": "2026-01-01T00:00:00Z"}]


class Cli:
    """`accelerate-job ...` of this checkout running in the background; its stdout read line by
    line as it comes (a pipe: no terminal, so rich draws no colours and no redraws)."""

    def __init__(self, kubeconfig: str, namespace: str, *args: str):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "operator"), str(ROOT / "trainer")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "accelerate_job", args[0], "--kubeconfig", kubeconfig, "-n",
             namespace, *args[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, text: str, timeout: float = 30) -> float:
        """Wait for a line containing `text`; returns when it came (time.monotonic())."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if text in line:
                return time.monotonic()
        raise AssertionError(f"no line with {text!r} within {timeout}s; got:\n"
                             + "\n".join(self.seen) + f"\nstderr: {self.stderr()}")

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read()

    def exit_code(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def test_wait_returns_as_soon_as_the_status_says_succeeded(kubeconfig, ns):
    create_job(kubeconfig, ns, "w")
    cli = Cli(kubeconfig, ns, "wait", "w", "--timeout", "120s")
    try:
        time.sleep(3)  # the watch is open; the job is still Pending
        assert cli.proc.poll() is None
        set_status(kubeconfig, ns, "w", phase="Running", conditions=condition("Running"))
        time.sleep(1)
        assert cli.proc.poll() is None
        set_status(kubeconfig, ns, "w", phase="Succeeded", conditions=condition("Succeeded"))
        patched = time.monotonic()  # the write is done once kubectl returns (it takes ~1 s)
        came = cli.expect("condition met: Succeeded")
        assert cli.exit_code() == 0
        # a watch hears the change at once; the old client polled every 2 s
        assert came - patched < 1.5, came - patched
    finally:
        cli.stop()


def test_wait_exits_1_with_the_reason_when_the_job_fails(kubeconfig, ns):
    create_job(kubeconfig, ns, "wf")
    cli = Cli(kubeconfig, ns, "wait", "wf", "--timeout", "120s")
    try:
        time.sleep(2)
        set_status(kubeconfig, ns, "wf", phase="Failed", conditions=condition(
            "Failed", "BackoffLimitExceeded", "pod wf-0 failed with exit code 1"))
        assert cli.exit_code() == 1
        assert "failed (BackoffLimitExceeded): pod wf-0 failed with exit code 1" in cli.stderr()
    finally:
        cli.stop()


def test_status_watch_shows_each_progress_then_ends_with_the_job(kubeconfig, ns):
    create_job(kubeconfig, ns, "s")
    cli = Cli(kubeconfig, ns, "status", "s", "--watch")
    try:
        cli.expect("Phase:        Pending")
        set_status(kubeconfig, ns, "s", phase="Running", readyNodes="1/1", progress=progress(10))
        cli.expect("10/40 (25%)")
        set_status(kubeconfig, ns, "s", progress=progress(30, eta="20s"))
        cli.expect("30/40 (75%)")
        set_status(kubeconfig, ns, "s", phase="Succeeded", progress=progress(40, eta="0s"))
        cli.expect("Phase:        Succeeded")
        assert cli.exit_code() == 0
        assert not any("\x1b[" in line for line in cli.seen)  # no terminal: no ANSI codes
    finally:
        cli.stop()


def test_top_shows_every_job_live_as_it_is_created_and_changes(kubeconfig, ns):
    create_job(kubeconfig, ns, "alpha")
    cli = Cli(kubeconfig, ns, "top")
    try:
        cli.expect("alpha")
        create_job(kubeconfig, ns, "beta")
        cli.expect("beta")
        set_status(kubeconfig, ns, "beta", phase="Running", progress=progress(12, eta="1m20s"))
        cli.expect("12/40 (30%)")
        kubectl("-n", ns, "delete", "acceleratejob", "alpha", "--wait=false",
                kubeconfig=kubeconfig)

        def table_without_alpha() -> bool:
            cli.expect("NAME")
            rows = []
            while True:  # the rest of this table
                try:
                    line = cli.lines.get(timeout=2)
                except queue.Empty:
                    break
                if not line:
                    break
                rows.append(line)
            return bool(rows) and all("alpha" not in row for row in rows)
        wait_for(table_without_alpha, timeout=30, interval=0,
                 description="a table without the deleted job")
    finally:
        cli.stop()


def test_get_and_top_with_a_see_the_jobs_of_every_namespace(kubeconfig, ns):
    other = create_namespace(kubeconfig, prefix="cli-watch-other")
    try:
        create_job(kubeconfig, ns, "gamma")
        create_job(kubeconfig, other, "gamma")
        listing = Cli(kubeconfig, ns, "get", "-A", "-o", "wide")
        assert listing.exit_code() == 0, listing.stderr()
        rows = [line.split() for line in iter(lambda: listing.lines.get(timeout=10), None)]
        assert rows[0][:2] == ["NAMESPACE", "NAME"] and "TOPOLOGY" in rows[0]
        assert [ns, "gamma"] in [row[:2] for row in rows] and [other, "gamma"] in [
            row[:2] for row in rows]
        cli = Cli(kubeconfig, ns, "top", "-A")
        try:
            cli.expect(f"{other}")
            set_status(kubeconfig, other, "gamma", phase="Running", progress=progress(30))
            cli.expect("30/40 (75%)")
        finally:
            cli.stop()
    finally:
        delete_namespace(kubeconfig, other)


def create_pod(kubeconfig: str, namespace: str, job: str, index: int, attempt: int,
               script: str) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": f"{job}-{index}", "namespace": namespace,
                        "labels": {JOB_NAME_LABEL: job, ATTEMPT_LABEL: str(attempt)}},
           "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "trainer", "image": PYTHON_IMAGE,
                                    "imagePullPolicy": "IfNotPresent",
                                    "command": ["python3", "-u", "-c", script]}]}}
    kubectl("-n", namespace, "create", "-f", "-", kubeconfig=kubeconfig, input=json.dumps(pod))


def test_logs_follow_streams_a_pod_then_its_replacement_until_the_job_finishes(kubeconfig, ns):
    create_job(kubeconfig, ns, "lg")
    set_status(kubeconfig, ns, "lg", phase="Running")
    cli = Cli(kubeconfig, ns, "logs", "lg", "--follow")
    try:
        create_pod(kubeconfig, ns, "lg", 0, 0,
                   "import time\nfor i in range(3): print('first', i); time.sleep(1)\n"
                   "raise SystemExit(1)")
        cli.expect("first 2", timeout=120)
        kubectl("-n", ns, "wait", "--for=jsonpath={.status.phase}=Failed", "pod/lg-0",
                "--timeout=60s", kubeconfig=kubeconfig)
        kubectl("-n", ns, "delete", "pod", "lg-0", "--wait=true", kubeconfig=kubeconfig)
        set_status(kubeconfig, ns, "lg", phase="Restarting", restarts=1)
        create_pod(kubeconfig, ns, "lg", 0, 1, "print('second attempt'); print('done')")
        cli.expect("lg-0 restarted (attempt 1)", timeout=120)
        cli.expect("done", timeout=60)
        kubectl("-n", ns, "wait", "--for=jsonpath={.status.phase}=Succeeded", "pod/lg-0",
                "--timeout=60s", kubeconfig=kubeconfig)
        set_status(kubeconfig, ns, "lg", phase="Succeeded")
        assert cli.exit_code(timeout=30) == 0
    finally:
        cli.stop()
