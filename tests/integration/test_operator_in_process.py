"""The operator's kopf handlers run in this process with kopf.testing.KopfRunner, against the real
API server (model: nolar/kopf examples/09-testing/test_example_09.py): a job gets its children,
a rendered ConfigMap deleted by hand comes back, and the job succeeds.

The operator the chart deployed is scaled to zero meanwhile, so that only this one acts."""

from __future__ import annotations

import os
from collections.abc import Iterator

import kubernetes
import pytest
from kopf.testing import KopfRunner

from devtools.cluster import kubectl, wait_for
from tests.helpers.jobs import apply_job, command_job, phase_is, wait_for_job

OPERATOR_NAMESPACE = os.environ.get("ACCELERATE_OPERATOR_NAMESPACE", "accelerate-system")
OPERATOR_SELECTOR = "app.kubernetes.io/name=accelerate-operator"
RUN_20_SECONDS = "import time; time.sleep(20)"


def operator_pods(kubeconfig: str) -> list[str]:
    out = kubectl("-n", OPERATOR_NAMESPACE, "get", "pods", "-l", OPERATOR_SELECTOR, "-o",
                  "name", kubeconfig=kubeconfig)
    return out.stdout.split()


@pytest.fixture
def deployed_operator_paused(kubeconfig: str) -> Iterator[None]:
    deployment = kubectl("-n", OPERATOR_NAMESPACE, "get", "deployment", "-l", OPERATOR_SELECTOR,
                         "-o", "name", kubeconfig=kubeconfig).stdout.split()[0]
    replicas = kubectl("-n", OPERATOR_NAMESPACE, "get", deployment, "-o",
                       "jsonpath={.spec.replicas}", kubeconfig=kubeconfig).stdout or "1"
    kubectl("-n", OPERATOR_NAMESPACE, "scale", deployment, "--replicas=0", kubeconfig=kubeconfig)
    try:
        wait_for(lambda: not operator_pods(kubeconfig), timeout=120,
                 description="the deployed operator to stop")
        yield
    finally:
        kubectl("-n", OPERATOR_NAMESPACE, "scale", deployment, f"--replicas={replicas}",
                kubeconfig=kubeconfig)
        kubectl("-n", OPERATOR_NAMESPACE, "rollout", "status", deployment, "--timeout=180s",
                kubeconfig=kubeconfig)


def children(kubeconfig: str, namespace: str) -> set[str]:
    out = kubectl("-n", namespace, "get", "configmaps,services,pods", "-l",
                  "accelerate-operator.io/job-name=inproc", "-o", "name", kubeconfig=kubeconfig)
    return set(out.stdout.split())


def test_handlers_in_process_create_children_recreate_a_deleted_one_and_finish_the_job(
        kubeconfig, namespace, deployed_operator_paused, monkeypatch):
    # kopf logs in through the kubernetes client, whose default kubeconfig path was fixed from
    # $KUBECONFIG when it was imported (before the session fixture set it).
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", kubeconfig)
    argv = ["run", "--standalone", "--namespace", namespace, "-m", "accelerate_operator.handlers"]
    with KopfRunner(argv, timeout=300) as runner:
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
    assert done["status"]["phase"] == "Succeeded", done["status"]
    assert runner.exit_code == 0 and runner.exception is None
    assert "Traceback" not in runner.output
