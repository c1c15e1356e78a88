"""Progress: the trainer's `ACCELERATE_PROGRESS {json}` lines (throttled, rank 0 only, ETA from the
recent step rate), picked out of the output by the supervisor into pod 0's report, and the
operator's reading of that report (decide.read_progress) into status.progress (at most one write
per the progress write interval); the trainer's library versions, in the same report, into
status.trainer once per group. No pod log is read."""

from __future__ import annotations

import io
import json
from datetime import datetime, timedelta

import pytest
from accelerate_operator.decide import (
    Readings,
    _changed,
    activity,
    build_status_write,
    read_progress,
)
from accelerate_operator.pod_state import PodState
from accelerate_operator.progress import (
    build_progress_status,
    build_trainer_status,
    format_duration,
    parse_report,
    progress_changed,
)
from accelerate_operator.report_settings import PROGRESS_WRITE_SECONDS
from accelerate_operator.status import merge_patch
from accelerate_trainer.contract import MAX_BODY_BYTES
from accelerate_trainer.progress import ProgressReporter, ProgressTracker, is_reporting_rank
from accelerate_trainer.versions import read_versions

from tests.helpers.jobs import JobBuilder
from tests.helpers.passes import snapshot
from tests.helpers.reports import pushed, pushed_progress

NOW = datetime(2026, 1, 2, 3, 4, 5)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reporter(**kwargs):
    stream, clock = io.StringIO(), Clock()
    return ProgressReporter(stream=stream, clock=clock, enabled=True, **kwargs), stream, clock


def lines(stream: io.StringIO) -> list[dict]:
    out = []
    for line in stream.getvalue().splitlines():
        prefix, _, payload = line.partition(" ")
        assert prefix == "ACCELERATE_PROGRESS"
        out.append(json.loads(payload))
    return out


# ---- trainer side -------------------------------------------------------------------------


def test_reporter_prints_first_step_then_at_most_every_two_seconds_and_always_the_last():
    progress, stream, clock = reporter()
    for step in range(1, 11):
        progress.report(step=step, total_steps=10, epoch=0, loss=2.0, samples_per_second=8)
        clock.now += 0.5
    assert [line["step"] for line in lines(stream)] == [1, 5, 9, 10]


def test_reporter_line_carries_every_field_and_an_eta_from_the_recent_rate():
    progress, stream, clock = reporter()
    progress.report(step=0, total_steps=40)
    clock.now += 10.0
    progress.report(step=10, total_steps=40, epoch=1, loss=1.23456789, samples_per_second=12.345)
    assert lines(stream)[-1] == {
        "step": 10, "total_steps": 40, "epoch": 1.0, "loss": 1.234568,
        "samples_per_second": 12.35, "eta_seconds": 30,
    }


def test_eta_uses_the_last_minute_only_so_a_slow_start_does_not_skew_it():
    progress, stream, clock = reporter()
    progress.report(step=0, total_steps=1000)
    clock.now += 300  # a slow first step (compilation, data download)
    for step in range(1, 101):
        progress.report(step=step, total_steps=1000)
        clock.now += 1.0
    assert lines(stream)[-1]["eta_seconds"] == pytest.approx(900, abs=20)


def test_reporter_drops_non_finite_values_and_a_restart_resets_the_rate():
    progress, stream, clock = reporter()
    progress.report(step=50, total_steps=100, loss=float("nan"))
    clock.now += 5
    progress.report(step=3, total_steps=100, loss=float("inf"))  # a restarted run
    assert lines(stream) == [{"step": 50, "total_steps": 100}, {"step": 3, "total_steps": 100}]


@pytest.mark.parametrize("env, reports", [({}, True), ({"RANK": "0"}, True),
                                          ({"RANK": "3"}, False)])
def test_only_global_rank_zero_reports(env, reports):
    assert is_reporting_rank(env) is reports


def test_reporter_on_another_rank_prints_nothing():
    stream = io.StringIO()
    ProgressReporter(stream=stream, enabled=False).report(step=1, total_steps=2)
    assert stream.getvalue() == ""


def test_tracker_reports_what_accelerator_log_gives_it():
    progress, stream, clock = reporter(min_interval=0)
    tracker = ProgressTracker(total_steps=20, reporter=progress)
    assert tracker.name == "accelerate-operator"
    assert tracker.requires_logging_directory is False
    tracker.log({"loss": 0.5, "epoch": 2, "lr": 1e-3}, step=20)
    tracker.log({"loss": 0.4})  # no step: nothing to report
    assert lines(stream) == [{"step": 20, "total_steps": 20, "epoch": 2.0, "loss": 0.5,
                              "eta_seconds": 0}]


def test_tracker_works_inside_a_real_accelerator(capsys, monkeypatch):
    from accelerate import Accelerator

    monkeypatch.delenv("RANK", raising=False)
    accelerator = Accelerator(cpu=True, log_with=[ProgressTracker(total_steps=3)])
    accelerator.init_trackers("unit-test")
    accelerator.log({"loss": 1.5, "epoch": 0}, step=3)
    accelerator.end_training()
    report = pushed_progress(capsys.readouterr().out)
    assert report == {"step": 3, "total_steps": 3, "epoch": 0.0, "loss": 1.5, "eta_seconds": 0}


# ---- operator side ------------------------------------------------------------------------


def test_the_last_valid_line_wins_and_garbage_is_skipped():
    log = "\n".join([
        'ACCELERATE_PROGRESS {"step": 4, "total_steps": 40}',
        "STEP step=5 loss=1.0 epoch=0",
        'ACCELERATE_PROGRESS {"step": 8, "total_steps": 40, "loss": 2.5}',
        'ACCELERATE_PROGRESS {"step": 9, "total_ste',  # cut by the tail
        'ACCELERATE_PROGRESS {"step": -1}',
        'ACCELERATE_PROGRESS ["step", 10]',
    ])
    assert pushed_progress(log) == {"step": 8, "total_steps": 40, "loss": 2.5}


def test_no_progress_line_means_none():
    assert pushed_progress("") is None
    assert pushed_progress("RANK_INFO rank=0\nSTEP step=1 loss=2 epoch=0\n") is None


def test_progress_status_matches_the_crd_fields():
    report = {"step": 12, "total_steps": 40, "epoch": 0.0, "loss": 2.345678,
              "samples_per_second": 81.5, "eta_seconds": 80}
    assert build_progress_status(report, NOW) == {
        "step": 12, "totalSteps": 40, "epoch": 0.0, "loss": 2.345678, "samplesPerSecond": 81.5,
        "etaSeconds": 80, "eta": "1m20s", "summary": "12/40 (30%)",
        "updateTime": "2026-01-02T03:04:05Z",
    }


def test_progress_status_without_a_total_or_eta_keeps_what_it_has():
    assert build_progress_status({"step": 7, "loss": "bad"}, NOW) == {
        "step": 7, "summary": "step 7", "updateTime": "2026-01-02T03:04:05Z",
    }


def test_the_last_step_has_zero_eta_and_a_full_summary():
    progress = build_progress_status({"step": 40, "total_steps": 40, "eta_seconds": 3}, NOW)
    assert (progress["eta"], progress["etaSeconds"], progress["summary"]) == ("0s", 0,
                                                                             "40/40 (100%)")


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (45, "45s"), (60, "1m"), (80, "1m20s"), (3600, "1h"), (3725, "1h02m"),
    (86400 + 7200, "1d2h"), (-5, "0s"),
])
def test_durations_are_as_short_as_kubectl_ages(seconds, text):
    assert format_duration(seconds) == text


def test_only_a_changed_report_is_worth_abuild_status_write():
    old = build_progress_status({"step": 3, "total_steps": 9}, NOW)
    later = build_progress_status({"step": 3, "total_steps": 9}, datetime(2027, 1, 1))
    assert not progress_changed(old, later)
    assert progress_changed(old, build_progress_status({"step": 4, "total_steps": 9}, NOW))
    assert progress_changed(None, old)


def test_a_trainer_line_parses_back_on_the_operator_side():
    progress, stream, clock = reporter()
    progress.report(step=5, total_steps=10, epoch=1, loss=0.25, samples_per_second=3)
    status = build_progress_status(pushed_progress("noise\n" + stream.getvalue()), NOW)
    assert status["summary"] == "5/10 (50%)" and status["loss"] == 0.25


# ---- the trainer's versions ---------------------------------------------------------------


def test_the_trainer_reads_versions_from_metadata_without_importing_torch():
    import sys

    had_torch = "torch" in sys.modules
    versions = read_versions()
    assert versions["python"].count(".") == 2
    assert {"accelerate", "torch", "transformers", "accelerate-operator"} <= set(versions)
    assert ("torch" in sys.modules) == had_torch


def test_the_reported_versions_are_read_and_nonsense_is_dropped():
    report = json.dumps({"lastOutputTime": "2026-01-02T03:04:05Z", "versions": {
        "torch": "2.6.0", "bad": 3, "long": "x" * 100}})
    assert parse_report(report).versions == {"torch": "2.6.0"}
    assert parse_report('{"lastOutputTime": "2026-01-02T03:04:05Z"}').versions is None


def test_trainer_status_names_the_group_image_and_versions_dropping_an_earlier_groups():
    assert build_trainer_status({"accelerate": "1.15.0"}, 2, "img:1") == {
        "attempt": 2, "image": "img:1", "versions": {"accelerate": "1.15.0"}}
    later = build_trainer_status({"accelerate": "1.16.0"}, 3, "img:1",
                                 {"versions": {"accelerate": "1.15.0", "deepspeed": "0.17.0"}})
    assert later["versions"] == {"deepspeed": None, "accelerate": "1.16.0"}  # a merge patch


def running_body(status: dict) -> dict:
    body = JobBuilder("llm").build()
    body["status"] = {"phase": "Running", "attempt": 1, **status}
    return body


def rank0(report: str | None = None, phase: str = "Running") -> PodState:
    return PodState(name="llm-0", index=0, attempt=1, phase=phase, ready=True, report=report)


def running(body: dict, pods=(), *, clock: float = 0.0, next_write: float = 0.0):
    """The pass's Snapshot of a running job: pod 0's report and the progress-write pacing the
    JobState keeps (the time the next write is allowed, set after the last one)."""
    return snapshot(body, NOW, status=body["status"], pods=tuple(pods) or (rank0(),),
                    clock=clock, next_progress_write=next_write)


def write(seen) -> dict | None:
    """The status write of a pass whose lifecycle changed nothing."""
    readings, _ = read_progress(seen)
    return build_status_write(seen.status, seen.status, readings, NOW, NOW)


IMAGE = JobBuilder().build()["spec"]["template"]["spec"]["containers"][0]["image"]
VERSIONED = json.dumps({"lastOutputTime": "2026-01-02T03:04:05Z", "attempt": 1,
                        "versions": {"accelerate": "1.15.0"}})


def test_the_versions_come_in_pod_0s_report_and_are_written_once_per_group():
    written = write(running(running_body({}), [rank0(VERSIONED)]))
    # Written with the rest of the pass's status, in its one write (goodput rides along).
    assert written.pop("goodput")["ledger"]["segment"] == "Training"  # a running job's first
    assert written == {"trainer": {"attempt": 1, "image": IMAGE,
                                   "versions": {"accelerate": "1.15.0"}}}
    # This group's versions are known: nothing to write.
    assert write(running(running_body({"trainer": {"attempt": 1}}), [rank0(VERSIONED)])) is None


def test_a_report_without_versions_writes_none_and_the_lifecycle_never_writes_them():
    report = json.dumps({"lastOutputTime": "2026-01-02T03:04:05Z"})
    assert write(running(running_body({}), [rank0(report)])) is None
    old = {"phase": "Running", "trainer": {"attempt": 0}}
    assert _changed(old, {"phase": "Running", "trainer": {"attempt": 1}}) is None


def test_a_pushed_report_is_written_with_the_status_only_when_it_changed():
    report = pushed('ACCELERATE_PROGRESS {"step": 3, "total_steps": 10}\n')
    seen = running(running_body({"trainer": {"attempt": 1}}), [rank0(report)])
    first = write(seen)
    assert first["progress"]["step"] == 3 and first["progress"]["totalSteps"] == 10
    assert activity(seen).last_step == 3
    assert activity(seen).last_activity == datetime(2026, 1, 2, 3, 4, 5)
    # The step's own time (when pod 0 saw its line) times the job's goodput.
    assert read_progress(seen)[0].step_time == datetime(2026, 1, 2, 3, 4, 5)
    again = running(running_body({"trainer": {"attempt": 1}, "progress": first["progress"]}),
                    [rank0(report)])
    assert write(again) is None


def test_progress_is_written_at_most_once_per_interval_however_often_the_pod_reports():
    body = running_body({"trainer": {"attempt": 1}})
    first, _ = read_progress(running(body, [rank0(pushed('ACCELERATE_PROGRESS {"step": 1}\n'))],
                                     clock=10.0))
    assert first.progress["step"] == 1
    next_write = 10.0 + PROGRESS_WRITE_SECONDS  # as the pass records it once written
    body["status"]["progress"] = build_progress_status({"step": 1}, NOW)
    step_2 = [rank0(pushed('ACCELERATE_PROGRESS {"step": 2}\n'))]
    held, due = read_progress(running(body, step_2, clock=11.0, next_write=next_write))
    assert held.progress is None and due == PROGRESS_WRITE_SECONDS - 1.0
    later, _ = read_progress(running(body, step_2, clock=next_write, next_write=next_write))
    assert later.progress["step"] == 2
    # The last report of a pod that has ended is never held back: the job may finish now.
    last, _ = read_progress(running(body, [rank0(pushed('ACCELERATE_PROGRESS {"step": 3}\n'),
                                                 phase="Succeeded")],
                                    clock=16.0, next_write=next_write))
    assert last.progress["step"] == 3


def test_progress_writes_leave_the_goodput_ledger_and_the_next_write_of_it_has_the_last_step():
    """A write of progress alone carries the goodput's totals but not its ledger (the stored
    one stays, a merge patch); a write that happens anyway (here a restart) brings the ledger up
    to the step pod 0 last reported, held back or not, so the recovery starts there."""
    status: dict = {"phase": "Running", "attempt": 1}

    def at(seconds: float) -> datetime:
        return NOW + timedelta(seconds=seconds)

    def apply(planned: dict, readings: Readings, seconds: float) -> dict:
        nonlocal status
        written = build_status_write(status, planned, readings, NOW, at(seconds))
        status = merge_patch(status, written)
        return written

    first = apply(status, Readings({"step": 1}, step=1, step_time=at(5)), 5)
    assert first["goodput"]["ledger"]["lastStep"] == 1  # the job's first ledger: stored
    for step in (2, 3, 4):
        written = apply(status, Readings({"step": step}, step=step, step_time=at(10 * step)),
                        10 * step)
        assert set(written) == {"progress", "goodput"} and "ledger" not in written["goodput"]
        assert written["goodput"]["wallSeconds"] == 10 * step  # the totals go on
    assert status["goodput"]["ledger"]["lastStep"] == 1  # left as it was
    restart = apply({**status, "phase": "Restarting", "attempt": 2},
                    Readings(step=5, step_time=at(48)), 50)  # step 5's write held back
    assert restart["goodput"]["ledger"]["lastStep"] == 5
    assert restart["goodput"]["lostSeconds"]["recovery"] == 2.0  # from step 5, not step 1


def test_an_elastic_job_grown_back_trains_at_full_size_through_merge_patched_writes():
    """Shrunk, then grown back: each write a merge patch over the stored status, as the API
    server applies it. The training after the growth is not reduced time, and the reduced
    training (step 11 at 52 s to step 20 at 70 s: 18 s) stays counted apart."""
    full, reduced = {"nodes": 2, "wantedNodes": 2}, {"nodes": 1, "wantedNodes": 2}
    status: dict = {"phase": "Running", "attempt": 1, "elastic": full}

    def apply(seconds: float, step: int | None = None, **planned) -> dict:
        nonlocal status
        readings = Readings({"step": step}, step=step, step_time=NOW + timedelta(
            seconds=seconds)) if step is not None else Readings()
        written = build_status_write(status, {**status, **planned}, readings, NOW,
                                     NOW + timedelta(seconds=seconds))
        status = merge_patch(status, written or {})
        return status["goodput"]

    for step in range(1, 11):
        apply(2 * step, step)
    apply(25, phase="Restarting", attempt=2, elastic=reduced)
    apply(30, phase="Running")
    for step in range(11, 21):
        apply(30 + 2 * step, step)  # 52 s to 70 s: the first step ends recovery
    apply(71, phase="Restarting", attempt=3, elastic=full)
    apply(75, phase="Running")
    for step in range(21, 61):
        grown = apply(40 + 2 * step, step)
    assert grown["reducedSeconds"] == 18.0  # step 11 at 52 s to step 20 at 70 s
    assert grown["ledger"]["reducedOpen"] is False


def test_a_held_back_step_still_reaches_goodput():
    body = running_body({"trainer": {"attempt": 1}, "progress": build_progress_status(
        {"step": 1}, NOW)})
    step_2 = [rank0(pushed('ACCELERATE_PROGRESS {"step": 2}\n'))]
    held, _ = read_progress(running(body, step_2, clock=11.0, next_write=20.0))
    assert held.progress is None and held.step == 2


def test_only_pod_0_of_the_current_attempt_reports():
    report = pushed('ACCELERATE_PROGRESS {"step": 7}\n')
    other_rank = PodState(name="llm-1", index=1, attempt=1, phase="Running", report=report)
    old_attempt = PodState(name="llm-0", index=0, attempt=0, phase="Running", report=report)
    seen = running(running_body({"trainer": {"attempt": 1}}), [other_rank, old_attempt])
    assert read_progress(seen)[0].progress is None and activity(seen).last_activity is None


def test_after_an_in_place_restart_the_last_attempts_progress_is_history():
    """Pod 0 of group 1 restarted in place as attempt 2: its report of attempt 1 still shows a
    sign of life, not a step of attempt 2 (goodput would end the recovery at it)."""
    report = json.dumps({"progress": {"step": 29}, "lastOutputTime": "2026-01-02T03:04:05Z",
                         "progressTime": "2026-01-02T03:04:05Z", "attempt": 1})
    body = running_body({"trainer": {"attempt": 1}, "attempt": 2, "groupAttempt": 1})
    seen = running(body, [rank0(report)])
    assert read_progress(seen)[0].progress is None and activity(seen).last_step is None
    assert activity(seen).last_activity == datetime(2026, 1, 2, 3, 4, 5)
    current = running(body, [rank0(report.replace('"attempt": 1', '"attempt": 2'))])
    assert read_progress(current)[0].progress["step"] == 29
    assert activity(current).last_step == 29


@pytest.mark.parametrize("annotation", [
    "not json", "[1, 2]", '{"progress": {"step": -1}}', '{"progress": {"step": 1.5}}',
    '{"progress": "step 3"}', '{"lastOutputTime": "yesterday"}',
    '{"progress": {"step": 1, "pad": "' + "x" * MAX_BODY_BYTES + '"}}',
])
def test_a_malformed_or_oversized_report_leaves_the_status_as_it_was(annotation):
    body = running_body({"trainer": {"attempt": 1}, "progress": {"step": 5, "summary": "step 5"}})
    seen = running(body, [rank0(annotation)])
    assert read_progress(seen)[0].progress is None and write(seen) is None


def test_a_tqdm_bar_before_the_report_on_its_line_does_not_hide_it():
    """tqdm in a pod (no terminal) redraws with carriage returns and no newline, so a report
    printed after a bar shares the bar's line."""
    bar = "".join(f"\r{i}/3000 [00:10<00:01, 25.00it/s]" for i in range(2313, 2438))
    output = bar + 'ACCELERATE_PROGRESS {"step": 2437, "total_steps": 3000}\n' + bar
    assert pushed_progress(output) == {"step": 2437, "total_steps": 3000}
