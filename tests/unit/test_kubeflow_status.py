"""transformers' KubeflowCallback progress (KEP-2779's trainerStatus) read into our progress
report (accelerate_trainer.kubeflow_status): the validation, the mapping of a whole run, what
the operator makes of the result, and what a real tiny `transformers.Trainer` run posts to an
HTTPS endpoint with its token and CA, with no code of ours in the script."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from accelerate_operator.progress import build_progress_status
from accelerate_operator.report_checks import Refused, parse_body
from accelerate_trainer.contract import MAX_BODY_BYTES, format_progress_line
from accelerate_trainer.kubeflow_status import (
    BadReport,
    KubeflowProgress,
    TrainerStatus,
    trainer_status,
)

from tests.helpers.reports import pushed_progress


def body(**status) -> bytes:
    return json.dumps({"trainerStatus": status}).encode()


def parse_trainer_status(raw: bytes) -> TrainerStatus:
    """A POST body's trainerStatus as the report endpoint reads it (report_checks.parse_body
    checks the body, then kubeflow_status.trainer_status the object)."""
    return trainer_status(json.loads(raw)["trainerStatus"])


def metrics(**values) -> list[dict[str, str]]:
    return [{"name": name, "value": str(value)} for name, value in values.items()]


def test_a_step_report_as_transformers_sends_it_is_parsed():
    status = parse_trainer_status(body(
        progressPercentage=40, estimatedRemainingSeconds=12, lastUpdatedTime="2026-01-01T00:00:00",
        metrics=metrics(loss=0.5, learning_rate=0.001, current_step=4, total_steps=10,
                        current_epoch=0.4)))
    assert status == TrainerStatus(40.0, 12, {"loss": 0.5, "learning_rate": 0.001,
                                              "current_step": 4.0, "total_steps": 10.0,
                                              "current_epoch": 0.4})


@pytest.mark.parametrize(("raw", "reason"), [
    (b"{not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[]", "not an object with 'trainerStatus'"),
    (json.dumps({"trainerStatus": 5}).encode(), "trainerStatus is not an object"),
    (b" " * (MAX_BODY_BYTES + 1), "over"),
])
def test_bad_bodies_are_refused_by_the_endpoint_with_the_reason(raw, reason):
    with pytest.raises(Refused, match=reason):
        parse_body(raw)


@pytest.mark.parametrize(("raw", "reason"), [
    (body(progressPercentage=101), "outside 0-100"),
    (body(progressPercentage=-1), "outside 0-100"),
    (body(progressPercentage="NaN"), "finite"),
    (body(progressPercentage=True), "not a number"),
    (body(estimatedRemainingSeconds=-5), "out of range"),
    (body(estimatedRemainingSeconds=10**12), "out of range"),
    (body(metrics={"loss": 1}), "list"),
    (body(metrics=[{"name": "loss", "value": "inf"}]), "finite"),
    (body(metrics=[{"name": "loss", "value": "abc"}]), "not a number"),
    (body(metrics=[{"value": "1"}]), "{name, value}"),
    (body(metrics=[{"name": "a b\n", "value": "1"}]), "plain name"),
    (body(metrics=metrics(current_step=-1)), "step count"),
    (body(metrics=metrics(current_step=1.5)), "step count"),
    (body(metrics=metrics(total_steps=10**13)), "step count"),
    (body(metrics=[{"name": f"m{i}", "value": "1"} for i in range(33)]), "at most 32"),
])
def test_bad_trainer_statuses_are_refused_with_the_reason(raw, reason):
    with pytest.raises(BadReport, match=reason.replace("{", r"\{").replace("}", r"\}")):
        parse_trainer_status(raw)
    with pytest.raises(Refused, match=reason.replace("{", r"\{").replace("}", r"\}")):
        parse_body(raw)  # the endpoint's 400 says the same


def test_a_whole_run_becomes_lines_from_0_to_total_with_eta_0_at_the_end():
    state = KubeflowProgress()
    begin = state.build_report(parse_trainer_status(body(
        progressPercentage=0, metrics=metrics(total_steps=10))))
    step = state.build_report(parse_trainer_status(body(
        progressPercentage=40, estimatedRemainingSeconds=12,
        metrics=metrics(loss=0.51234567, learning_rate=0.001, grad_norm=1.5, current_step=4,
                        total_steps=10, current_epoch=0.4))))
    # on_train_end sends only the logged metrics: no step counts
    end = state.build_report(parse_trainer_status(body(
        progressPercentage=100, estimatedRemainingSeconds=0,
        metrics=metrics(train_runtime=3.2, train_samples_per_second=708.68, epoch=1.0))))
    assert begin == {"step": 0, "total_steps": 10, "epoch": None, "loss": None,
                     "samples_per_second": None, "eta_seconds": None, "metrics": None}
    assert step == {"step": 4, "total_steps": 10, "epoch": 0.4, "loss": 0.512346,
                    "samples_per_second": None, "eta_seconds": 12,
                    "metrics": {"loss": 0.512346, "learning_rate": 0.001, "grad_norm": 1.5}}
    assert end == {"step": 10, "total_steps": 10, "epoch": 1.0, "loss": None,
                   "samples_per_second": 708.68, "eta_seconds": 0,
                   "metrics": {"train_runtime": 3.2, "train_samples_per_second": 708.68}}


def test_a_report_without_any_step_prints_nothing_and_a_step_past_the_total_is_refused():
    state = KubeflowProgress()
    assert state.build_report(parse_trainer_status(body(progressPercentage=50))) is None
    with pytest.raises(BadReport, match="past total_steps"):
        state.build_report(parse_trainer_status(body(
            metrics=metrics(current_step=11, total_steps=10))))


def test_the_operator_reads_a_mapped_report_into_status_progress_with_its_metrics():
    report = KubeflowProgress().build_report(parse_trainer_status(body(
        progressPercentage=40, estimatedRemainingSeconds=75,
        metrics=metrics(loss=0.5, learning_rate=0.001, current_step=4, total_steps=10,
                        current_epoch=0.4))))
    parsed = pushed_progress("noise\n" + format_progress_line(report))
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert build_progress_status(parsed, now) == {
        "step": 4, "totalSteps": 10, "epoch": 0.4, "loss": 0.5, "etaSeconds": 75,
        "eta": "1m15s", "summary": "4/10 (40%)", "updateTime": "2026-01-01T00:00:00Z",
        "metrics": {"loss": 0.5, "learning_rate": 0.001}}
