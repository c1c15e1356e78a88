"""The operator's own entry point (`python -m accelerate_operator`, kopf underneath) run as a
process of this host against the real API server, for one namespace: kopf's liveness endpoint
answers with the operator's probe, a job gets its children, a rendered ConfigMap deleted by hand
comes back, the job succeeds with nothing of kopf written on it (no finalizer, no annotation),
its status owned by the operator as one field (the CRD's atomic status: managedFields holds
`f:status`, not every leaf), and SIGTERM stops it cleanly.

The operator the chart deployed is scaled to zero meanwhile, so that only this one acts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

from devtools.cluster import kubectl, wait_for
from tests.helpers.jobs import apply_job, command_job, phase_is, wait_for_job

RUN_20_SECONDS = "import time; time.sleep(20)"


def children(kubeconfig: str, namespace: str) -> set[str]:
    out = kubectl("-n", namespace, "get", "configmaps,services,pods", "-l",
                  "accelerate-operator.io/job-name=inproc", "-o", "name", kubeconfig=kubeconfig)
    return set(out.stdout.split())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as answer:
            return json.loads(answer.read())
    except OSError:
        return None


def test_operator_process_creates_children_recreates_a_deleted_one_and_stops_on_sigterm(
        kubeconfig, namespace, deployed_operator_stopped, tmp_path):
    port = free_port()
    log = tmp_path / "operator.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "accelerate_operator", "--namespace", namespace,
             "--liveness-port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "KUBECONFIG": kubeconfig,
                                                    "ACCELERATE_OPERATOR_REPORT_PORT": "0"})
    try:
        wait_for(lambda: (health(port) or {}).get("jobs"), timeout=60,
                 description="kopf's liveness endpoint to answer with the operator's probe")
        apply_job(kubeconfig, namespace, command_job("inproc", RUN_20_SECONDS, nodes=2).build())
        expected = {"configmap/inproc-accelerate-config", "service/inproc", "pod/inproc-0",
                    "pod/inproc-1"}
        wait_for(lambda: expected <= children(kubeconfig, namespace), timeout=60,
                 description="the job's ConfigMap, Service and pods")
        kubectl("-n", namespace, "delete", "configmap", "inproc-accelerate-config",
                kubeconfig=kubeconfig)
        wait_for(lambda: "configmap/inproc-accelerate-config" in children(kubeconfig, namespace),
                 timeout=30, description="the deleted ConfigMap to be recreated")
        done = wait_for_job(kubeconfig, namespace, "inproc", phase_is("Succeeded", "Failed"),
                            timeout=180)
        probe = health(port)["jobs"]
        assert probe["jobs"] == 1 and probe["paused"] is False and probe["passes"] >= 3, probe
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    output = log.read_text()
    assert done["status"]["phase"] == "Succeeded", done["status"]
    stored = json.loads(kubectl("-n", namespace, "get", "acceleratejob", "inproc", "-o", "json",
                                "--show-managed-fields", kubeconfig=kubeconfig).stdout)
    status_owned = [entry["fieldsV1"] for entry in stored["metadata"]["managedFields"]
                    if entry.get("subresource") == "status"]
    assert status_owned == [{"f:status": {}}], status_owned
    assert not done["metadata"].get("finalizers"), done["metadata"]
    assert not [a for a in done["metadata"].get("annotations") or {} if "kopf" in a], done[
        "metadata"]
    assert code == 0, output
    assert "Traceback" not in output, output
    assert "stopped" in output.splitlines()[-1], output
