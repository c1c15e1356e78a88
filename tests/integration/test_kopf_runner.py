"""The operator's kopf handlers run in-process with kopf's own test runner
(`kopf.testing.KopfRunner`, as `kopf run -m accelerate_operator.handlers --standalone`) against
the real API server: a two-node job gets its ConfigMap, Service and pods, a pod deleted by hand
restarts the group under a new attempt, the job ends Succeeded, and the runner exits cleanly with
no error logged. The chart's operator is scaled to zero meanwhile."""

from __future__ import annotations

from kopf.testing import KopfRunner

from devtools.cluster import kubectl, wait_for
from tests.helpers.jobs import apply_job, command_job, phase_is, wait_for_job
from tests.integration.test_operator_in_process import (  # noqa: F401 - a fixture
    children,
    deployed_operator_paused,
)

RUN_15_SECONDS = "import time; time.sleep(15)"


def test_kopf_runs_the_handlers_a_deleted_pod_restarts_the_group_and_the_job_succeeds(
        kubeconfig, namespace, deployed_operator_paused):  # noqa: F811
    args = ["run", "-m", "accelerate_operator.handlers", "--standalone", "-n", namespace]
    with KopfRunner(args, timeout=240) as runner:
        apply_job(kubeconfig, namespace, command_job("inproc", RUN_15_SECONDS, nodes=2).build())
        wait_for(lambda: {"pod/inproc-0", "pod/inproc-1"} <= children(kubeconfig, namespace),
                 timeout=60, description="the job's pods")
        wait_for_job(kubeconfig, namespace, "inproc", phase_is("Running"), timeout=120)
        kubectl("-n", namespace, "delete", "pod", "inproc-1", "--wait=false",
                kubeconfig=kubeconfig)
        restarted = wait_for_job(kubeconfig, namespace, "inproc",
                                 lambda job: (job.get("status") or {}).get("attempt") == 1,
                                 timeout=60)
        done = wait_for_job(kubeconfig, namespace, "inproc", phase_is("Succeeded", "Failed"),
                            timeout=180)
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output
    assert restarted["status"]["restarts"] == 1
    assert done["status"]["phase"] == "Succeeded", done["status"]
    assert "Traceback" not in runner.output, runner.output
