"""Failures of the operator and of the control plane: the operator killed while it creates a
job's pods, and the API server restarted under a running job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from devtools.cluster import ROOT, kubectl, wait_for
from tests.helpers.jobs import apply_job, command_job, phase_is, wait_for_job
from tests.helpers.operator import OPERATOR_NAMESPACE, active_operator

EXTERNAL = os.environ.get("ACCELERATE_OPERATOR_EXTERNAL_CLUSTER") == "1"


def job_pods(kubeconfig: str, namespace: str, job: str) -> list[dict]:
    out = kubectl("-n", namespace, "get", "pods", "-l", f"accelerate-operator.io/job-name={job}",
                  "-o", "json", kubeconfig=kubeconfig)
    return json.loads(out.stdout)["items"]


def test_operator_killed_while_creating_pods_creates_nothing_twice(kubeconfig, namespace):
    nodes = 12
    # The active replica (the chart runs two; the standby takes over when it is gone).
    old, _ = wait_for(lambda: active_operator(kubeconfig), timeout=60, description="the operator")
    apply_job(kubeconfig, namespace,
              command_job("restart", "import time; time.sleep(600)", nodes=nodes).build())
    # Kill it as soon as the first pods appear: some are created, some are not yet.
    wait_for(lambda: job_pods(kubeconfig, namespace, "restart"), timeout=60, interval=0.05,
             description="the first pod")
    kubectl("-n", OPERATOR_NAMESPACE, "delete", "pod", old, "--grace-period=0", "--force",
            kubeconfig=kubeconfig)
    wait_for(lambda: active_operator(kubeconfig)[0] != old, timeout=120,
             description="another replica to take over")
    running = wait_for_job(kubeconfig, namespace, "restart", phase_is("Running"), timeout=180)
    pods = job_pods(kubeconfig, namespace, "restart")
    assert sorted(p["metadata"]["name"] for p in pods) == sorted(
        f"restart-{i}" for i in range(nodes))
    assert {p["metadata"]["labels"]["accelerate-operator.io/attempt"] for p in pods} == {"0"}
    assert running["status"].get("restarts", 0) == 0
    assert running["status"]["readyNodes"] == f"{nodes}/{nodes}"


def alive(pid: int) -> bool:
    """Running, not a zombie: a daemon whose parent exited is reaped late, or never, by the
    container's init, so /proc/<pid> can outlive the process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def apiserver_pid() -> int:
    """The API server of the local cluster: its pid file, or, when that names a process that
    is gone (a second start that lost the port to the first), the process running this cache's
    kube-apiserver binary."""
    cache = Path(os.environ.get("ACCELERATE_OPERATOR_CACHE",
                                Path.home() / ".cache" / "accelerate-operator"))
    pid = int((cache / "cluster" / "run" / "kube-apiserver.pid").read_text().split()[0])
    if alive(pid):
        return pid
    found = subprocess.run(["pgrep", "-f", f"^{cache}/bin/[^ ]*/kube-apiserver "],
                           capture_output=True, text=True).stdout.split()
    live = [int(p) for p in found if alive(int(p))]
    assert len(live) == 1, f"expected one local kube-apiserver, found {live}"
    return live[0]


@pytest.mark.skipif(EXTERNAL, reason="restarts the local control plane; an external cluster's "
                                     "API server is not ours to restart")
def test_api_server_restart_during_a_running_job(kubeconfig, namespace):
    script = "import time; time.sleep(25)"
    apply_job(kubeconfig, namespace, command_job("survive", script).build())
    wait_for_job(kubeconfig, namespace, "survive", phase_is("Running"), timeout=90)

    pid = apiserver_pid()
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not alive(pid), timeout=60,
             description="the API server to stop")
    time.sleep(3)  # the job's pods finish meanwhile or soon after; nobody can report it yet
    subprocess.run([str(ROOT / "hack" / "local-cluster.sh"), "up"], check=True,
                   capture_output=True, timeout=300)

    done = wait_for_job(kubeconfig, namespace, "survive", phase_is("Succeeded"), timeout=180,
                        description="the job to succeed after the API server came back")
    assert done["status"].get("restarts", 0) == 0
    # A job submitted after the restart is served too: the operator's watches recovered.
    apply_job(kubeconfig, namespace, command_job("after", "print('ok')").build())
    wait_for_job(kubeconfig, namespace, "after", phase_is("Succeeded"), timeout=120)


def test_a_fail_closed_webhook_that_is_down_is_named_on_the_job_and_the_job_runs_once_it_is_back(
        kubeconfig, namespace):
    """An admission webhook with failurePolicy Fail whose service has no endpoint (Kueue's,
    Gatekeeper's or Kyverno's while its controller restarts) refuses every pod with a 500. The
    operator retries, names the webhook in a Warning event on the job, and creates the pods once
    the webhook is gone."""
    webhook = f"down-{namespace}"[:63]
    config = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": webhook},
        "webhooks": [{
            "name": "mpod.down.accelerate-operator.test",
            "clientConfig": {"service": {"namespace": namespace, "name": "no-endpoints",
                                         "path": "/mutate", "port": 443}},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["pods"]}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "failurePolicy": "Fail", "sideEffects": "None", "timeoutSeconds": 2,
            "admissionReviewVersions": ["v1"]}]}
    kubectl("apply", "-f", "-", input=json.dumps(config), kubeconfig=kubeconfig)
    try:
        apply_job(kubeconfig, namespace, command_job("gated", "print('ok')").build())

        def warning():
            events = json.loads(kubectl(
                "-n", namespace, "get", "events", "-o", "json", "--field-selector",
                "involvedObject.name=gated,reason=ReconcileFailing",
                kubeconfig=kubeconfig).stdout)["items"]
            return events[0] if events else None

        event = wait_for(warning, timeout=60, description="the ReconcileFailing warning")
        assert event["type"] == "Warning"
        assert "mpod.down.accelerate-operator.test" in event["message"], event["message"]
        assert not job_pods(kubeconfig, namespace, "gated")
    finally:
        kubectl("delete", "mutatingwebhookconfiguration", webhook, "--ignore-not-found",
                kubeconfig=kubeconfig)
    # The operator's backoff is at most 60 s; the pods come on its next try.
    done = wait_for_job(kubeconfig, namespace, "gated", phase_is("Succeeded"), timeout=150,
                        description="the job to run once the webhook is gone")
    assert done["status"].get("restarts", 0) == 0
