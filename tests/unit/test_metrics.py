"""The operator's Prometheus metrics: what a status change counts (pure), the calls the runtime
makes, and the /metrics endpoint served over real HTTP."""

from __future__ import annotations

import socket
import urllib.request
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from accelerate_operator.api import parse_job
from accelerate_operator.lifecycle import run_lifecycle
from accelerate_operator.metrics import (
    PHASES,
    Metrics,
    StatusChange,
    compute_status_change,
    count_jobs_from,
    count_phases,
    observe_pass,
    record_api_error,
    record_status_change,
    restart_reason,
    start_metrics_server,
)
from accelerate_operator.status import merge_patch
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.jobs import JobBuilder, pod

CREATED = datetime(2026, 1, 1, tzinfo=UTC)
NOW = CREATED + timedelta(seconds=42)


def running(**extra):
    return {"phase": "Running", "restarts": 0,
            "conditions": [{"type": "Created", "status": "True"},
                           {"type": "Running", "status": "True"}], **extra}


def sample(metrics: Metrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels or None)


def restarted_for(failed_pod) -> dict:
    """The status the planner writes when `failed_pod` stops a running group of two."""
    job, now = parse_job(JobBuilder().build()), NOW.replace(tzinfo=None)  # the pass's clock
    created = run_lifecycle(job, {}, [], now).status
    running = run_lifecycle(job, created, [pod("train", 0), pod("train", 1)], now).status
    return run_lifecycle(job, running, [pod("train", 0), failed_pod], now).status


@pytest.mark.parametrize(("failed_pod", "reason"), [
    (pod("train", 1, "Failed", exit_code=1, message="Traceback"), "Error"),
    (pod("train", 1, "Failed", exit_code=137, reason="OOMKilled"), "OOMKilled"),
    (replace(pod("train", 1), disruption="EvictionByEvictionAPI", deleting=True),
     "EvictionByEvictionAPI"),
    (replace(pod("train", 1), deleting=True), "PodDeleted"),
])
def test_a_restart_is_labelled_with_the_reason_the_planner_wrote(failed_pod, reason):
    status = restarted_for(failed_pod)
    assert status["lastFailureReason"] == reason
    change = compute_status_change({"restarts": 0}, status, CREATED, NOW)
    assert change.restart_reasons == (reason,)


@pytest.mark.parametrize("reason", [None, 7, "", "x" * 41, "Evicted: node low on memory"])
def test_a_missing_or_unbounded_reason_is_labelled_other(reason):
    assert restart_reason(reason) == "Other"


def test_a_pass_that_starts_the_job_counts_seconds_to_running_once():
    pending = {"phase": "Pending", "conditions": [{"type": "Created", "status": "True"}]}
    assert compute_status_change(pending, running(), CREATED, NOW) == StatusChange((), 42.0)
    assert compute_status_change(running(), running(), CREATED, NOW) == StatusChange()
    # Running again after a restart: the Running condition was there all along (False meanwhile)
    restarting = {**running(), "conditions": [{"type": "Running", "status": "False"}]}
    assert compute_status_change(restarting, running(), CREATED, NOW) == StatusChange()


def test_the_first_step_is_counted_once_not_again_after_a_restart():
    first = running(progress={"step": 3, "totalSteps": 10})
    assert compute_status_change(running(), first, CREATED, NOW) == StatusChange((), None, 42.0)
    assert compute_status_change(first, running(progress={"step": 5}), CREATED, NOW) == \
        StatusChange()
    assert compute_status_change(running(progress={"step": 0}),
                                 running(progress={"step": 1}), CREATED, NOW) == StatusChange()


def test_a_restart_is_counted_with_its_reason_and_two_at_once_count_twice():
    old = running()
    new = {**running(), "phase": "Restarting", "restarts": 2,
           "lastFailure": "pod j-1 failed (OOMKilled) with exit code 137",
           "lastFailureReason": "OOMKilled"}
    assert compute_status_change(old, new, CREATED, NOW).restart_reasons == ("OOMKilled",) * 2
    assert compute_status_change(new, new, CREATED, NOW).restart_reasons == ()


def test_record_status_change_moves_the_counters_and_histograms():
    metrics = Metrics()
    record_status_change(None, running(), CREATED, NOW, metrics)
    record_status_change(running(), running(progress={"step": 1}), CREATED,
                         NOW + timedelta(seconds=8), metrics)
    record_status_change(running(progress={"step": 1}),
                         running(progress={"step": 1}, restarts=1,
                                 lastFailure="pod j-0 was deleted",
                                 lastFailureReason="PodDeleted"), CREATED, NOW, metrics)
    assert sample(metrics, "accelerate_operator_restarts_total", reason="PodDeleted") == 1
    assert sample(metrics, "accelerate_operator_job_seconds_to_running_sum") == 42
    assert sample(metrics, "accelerate_operator_job_seconds_to_running_count") == 1
    assert sample(metrics, "accelerate_operator_job_seconds_to_first_step_sum") == 50
    assert sample(metrics, "accelerate_operator_job_seconds_to_first_step_bucket", le="60.0") == 1


def test_jobs_by_phase_counts_every_phase_and_resets_those_gone():
    metrics = Metrics()
    counts = count_phases([running(), running(), None, {"phase": "Succeeded"}, {"phase": "?"}])
    assert counts == {**dict.fromkeys(PHASES, 0), "Running": 2, "Pending": 1, "Succeeded": 1}
    jobs = [{"status": status} for status in (running(), running(), None,
                                              {"phase": "Succeeded"})]
    count_jobs_from(lambda: jobs, metrics)
    jobs[:] = [{"status": {"phase": "Succeeded"}}]
    assert {phase: sample(metrics, "accelerate_operator_jobs", phase=phase)
            for phase in PHASES} == {**dict.fromkeys(PHASES, 0.0), "Succeeded": 1.0}


def test_jobs_by_phase_can_be_counted_at_scrape_time_from_the_runtimes_store():
    metrics = Metrics()
    store = {"a": {"status": {"phase": "Running"}}}
    count_jobs_from(lambda: store.values(), metrics)
    assert sample(metrics, "accelerate_operator_jobs", phase="Running") == 1
    store["b"] = {"status": {"phase": "Running"}}
    store["a"] = {"status": {"phase": "Succeeded"}}
    assert (sample(metrics, "accelerate_operator_jobs", phase="Running"),
            sample(metrics, "accelerate_operator_jobs", phase="Succeeded")) == (1, 1)


def test_pass_and_api_error_calls():
    metrics = Metrics()
    observe_pass(0.003, metrics)
    observe_pass(-1, metrics)  # a clock step backwards is not a negative duration
    record_api_error("PATCH", 409, metrics)
    record_api_error("patch", 409, metrics)
    record_api_error("frobnicate", None, metrics)
    assert sample(metrics, "accelerate_operator_pass_duration_seconds_count") == 2
    assert sample(metrics, "accelerate_operator_pass_duration_seconds_sum") == 0.003
    assert sample(metrics, "accelerate_operator_api_errors_total", verb="patch", code="409") == 2
    assert sample(metrics, "accelerate_operator_api_errors_total", verb="other", code="0") == 1


def test_the_endpoint_serves_the_metrics_over_http():
    metrics = Metrics()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server, thread = start_metrics_server(port, addr="127.0.0.1", metrics=metrics)
    try:
        record_api_error("get", 500, metrics)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert {"accelerate_operator_jobs", "accelerate_operator_restarts",
            "accelerate_operator_job_seconds_to_running",
            "accelerate_operator_job_seconds_to_first_step",
            "accelerate_operator_pass_duration_seconds",
            "accelerate_operator_api_errors"} <= set(families)
    errors = [s for s in families["accelerate_operator_api_errors"].samples
              if s.name.endswith("_total")]
    assert [(s.labels, s.value) for s in errors] == [({"verb": "get", "code": "500"}, 1.0)]


def test_merge_patch_applies_a_status_merge_patch_as_the_api_server_does():
    old = {"phase": "Running", "progress": {"step": 3, "eta": "1m"}, "lastFailure": "x"}
    assert merge_patch(old, {"phase": "Restarting", "progress": {"eta": None, "step": 4},
                        "lastFailure": None, "restarts": 1}) == {
        "phase": "Restarting", "progress": {"step": 4}, "restarts": 1}
    assert old["progress"] == {"step": 3, "eta": "1m"}  # the input is left alone


def test_each_jobs_goodput_is_exported_from_its_status_at_scrape_time():
    metrics = Metrics()
    goodput = {"percent": 87.5, "interruptions": 2, "lastRecoverySeconds": 21.5,
               "lostSeconds": {"waiting": 3.0, "startup": 15.0, "recovery": 40.0,
                               "recomputed": 4.5, "bogus": 1.0}}
    store = {"a": {"metadata": {"namespace": "ml", "name": "llm"},
                   "status": {"phase": "Running", "goodput": goodput}},
             "b": {"metadata": {"namespace": "ml", "name": "new"}, "status": {}}}
    count_jobs_from(lambda: store.values(), metrics)
    job = {"namespace": "ml", "job": "llm"}
    assert sample(metrics, "accelerate_operator_job_goodput_ratio", **job) == 0.875
    assert sample(metrics, "accelerate_operator_job_interruptions", **job) == 2
    assert sample(metrics, "accelerate_operator_job_last_recovery_seconds", **job) == 21.5
    assert {cause: sample(metrics, "accelerate_operator_job_lost_seconds", cause=cause, **job)
            for cause in ("waiting", "startup", "recovery", "recomputed", "bogus")} == {
        "waiting": 3.0, "startup": 15.0, "recovery": 40.0, "recomputed": 4.5, "bogus": None}
    assert sample(metrics, "accelerate_operator_job_goodput_ratio", namespace="ml",
                  job="new") is None  # no goodput yet: no series
    del store["a"]  # a job gone takes its series with it
    assert sample(metrics, "accelerate_operator_job_goodput_ratio", **job) is None
