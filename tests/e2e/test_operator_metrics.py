"""End to end: the operator installed by the chart serves Prometheus metrics through its metrics
Service, and they move with real jobs: a job that runs and fails once moves jobs{phase},
restarts_total{reason}, the seconds-to-Running histogram and the pass duration histogram, and
shows as one interruption in its own goodput gauges.

Scraped through the API server's service proxy (`kubectl get --raw .../services/NAME:metrics/
proxy/metrics`), so no port-forward is needed."""

from __future__ import annotations

import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from devtools.cluster import kubectl, wait_for
from tests.helpers.jobs import apply_job, command_job, phase_is, wait_for_job

pytestmark = [pytest.mark.timeout(600)]

OPERATOR_NAMESPACE = os.environ.get("ACCELERATE_OPERATOR_NAMESPACE", "accelerate-system")
RELEASE = os.environ.get("ACCELERATE_OPERATOR_RELEASE", "accelerate-operator")


def scrape(kubeconfig: str) -> dict[tuple[str, tuple], float]:
    """Every sample of the operator's /metrics: {(name, sorted labels): value}."""
    text = kubectl("get", "--raw", f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/services/"
                   f"{RELEASE}-metrics:metrics/proxy/metrics", kubeconfig=kubeconfig).stdout
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_endpoint_serves_counters_that_move_with_jobs(kubeconfig, namespace):
    before = scrape(kubeconfig)
    assert ("accelerate_operator_jobs", (("phase", "Running"),)) in before, sorted(before)[:20]

    # One node that fails on the first attempt (exit 1), then succeeds: one restart, "Error".
    job = (command_job("metrics-restart", "import os, sys, time\n"
                       "if os.environ['ACCELERATE_JOB_ATTEMPT'] == '0': sys.exit(1)\n"
                       "time.sleep(2)", nodes=1)
           .run_policy(backoffLimit=2).build())
    apply_job(kubeconfig, namespace, job)
    done = wait_for_job(kubeconfig, namespace, "metrics-restart", phase_is("Succeeded"),
                        timeout=300)
    # The snippet reports no training step, so its goodput is 0 (only steps count): the gauge
    # must exist for the job and say what its status says.
    ratio = done["status"]["goodput"]["percent"] / 100

    def moved():
        after = scrape(kubeconfig)
        restarts = (value(after, "accelerate_operator_restarts_total", reason="Error")
                    - value(before, "accelerate_operator_restarts_total", reason="Error"))
        running = (value(after, "accelerate_operator_job_seconds_to_running_count")
                   - value(before, "accelerate_operator_job_seconds_to_running_count"))
        passes = (value(after, "accelerate_operator_pass_duration_seconds_count")
                  - value(before, "accelerate_operator_pass_duration_seconds_count"))
        succeeded = value(after, "accelerate_operator_jobs", phase="Succeeded")
        job = {"namespace": namespace, "job": "metrics-restart"}
        interruptions = value(after, "accelerate_operator_job_interruptions", **job)
        key = ("accelerate_operator_job_goodput_ratio", tuple(sorted(job.items())))
        goodput = after.get(key)
        return (restarts >= 1 and running >= 1 and passes >= 3 and succeeded >= 1
                and interruptions == 1 and goodput is not None and abs(goodput - ratio) < 0.01
                and (restarts, running, passes, succeeded, goodput))
    restarts, running, passes, succeeded, goodput = wait_for(
        moved, timeout=60, interval=2, description="the operator's counters to move")
    print(f"restarts(Error) +{restarts:.0f}, to-Running +{running:.0f}, passes +{passes:.0f}, "
          f"Succeeded jobs {succeeded:.0f}, the job's goodput {goodput:.1%}")
