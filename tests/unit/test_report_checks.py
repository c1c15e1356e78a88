"""The report endpoint's decisions, pure: the body's shape and what of it the job keeps (caps,
printable text), whether the token's pod is one the operator made for the job and may write what
it sent, when the job's pass must see a report, per-caller rates and the reports kept per pod."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from accelerate_operator.pod_state import PodState
from accelerate_operator.progress import parse_report
from accelerate_operator.report_checks import (
    PASS_NOW,
    PASS_WHEN_DUE,
    JobGroup,
    Refused,
    job_pod,
    may_write,
    parse_body,
    pass_for_report,
)
from accelerate_operator.report_store import RateLimiter, ReportStore
from accelerate_operator.report_tokens import Caller
from accelerate_trainer.contract import (
    MAX_BODY_BYTES,
    MAX_FIELD_CHARS,
    MAX_MESSAGE_CHARS,
    printable_text,
)

JOB_UID = "job-uid"
KEY = ("ml", "train")


def body(**document) -> bytes:
    return json.dumps(document).encode()


def pod(index: int, uid: str, attempt: int = 0, **changes) -> PodState:
    return PodState(name=f"train-{index}", index=index, attempt=attempt, phase="Running",
                    uid=uid, **changes)


PODS = [(JOB_UID, pod(0, "uid-0")), (JOB_UID, pod(1, "uid-1")),
        ("other-job", PodState(name="other-0", index=0, attempt=0, phase="Running",
                               uid="uid-other"))]
PROGRESS = {"acceleratePodReport": {"progress": {"step": 3, "total_steps": 10},
                                    "lastOutputTime": "2026-01-01T00:00:00Z"}}
EXIT = {"acceleratePodReport": {"progress": None, "lastOutputTime": None, "attempt": 0,
                                "exit": {"attempt": 0, "exitCode": 1, "message": "boom"}}}
KUBEFLOW = {"trainerStatus": {"progressPercentage": 30, "estimatedRemainingSeconds": 70,
                              "metrics": [{"name": "current_step", "value": 3},
                                          {"name": "total_steps", "value": 10},
                                          {"name": "loss", "value": 0.5}],
                              "lastUpdatedTime": "2026-01-01T00:00:00Z"}}


# ---- the body ------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, code, words", [
    (b"x" * (MAX_BODY_BYTES + 1), 413, "over"),
    (b"{not json", 400, "not JSON"),
    (b"[1, 2]", 400, "trainerStatus"),
    (body(status={}), 400, "acceleratePodReport"),
    (body(trainerStatus=[1]), 400, "trainerStatus is not an object"),
    (body(trainerStatus={"progressPercentage": 130}), 400, "outside 0-100"),
    (body(trainerStatus={"metrics": [{"name": "loss", "value": "nan"}]}), 400, "finite"),
    (body(acceleratePodReport="step 3"), 400, "not an object"),
    (body(acceleratePodReport={"exit": {"attempt": "0", "exitCode": 1}}), 400, "exitCode"),
    (body(acceleratePodReport={"exit": {"attempt": 0, "exitCode": 0}}), 400, "non-zero"),
    (body(acceleratePodReport={"progress": {"step": -1}}), 400, "step"),
    (body(acceleratePodReport={"lastOutputTime": "yesterday"}), 400, "RFC 3339"),
])
def test_a_malformed_or_oversized_body_is_refused_naming_what_is_wrong(raw, code, words):
    with pytest.raises(Refused) as refused:
        parse_body(raw)
    assert refused.value.code == code
    assert words in str(refused.value)


def test_valid_bodies_say_what_they_carry():
    progress = parse_body(body(**PROGRESS))
    assert progress.progress and progress.trainer_status is None
    failed = parse_body(body(**EXIT))
    assert failed.report["exit"]["message"] == "boom" and not failed.progress  # nulls: none
    kubeflow = parse_body(body(**KUBEFLOW))
    assert kubeflow.progress and kubeflow.trainer_status.metrics["current_step"] == 3
    cleared = parse_body(body(acceleratePodReport={"progress": None, "lastOutputTime": None,
                                                   "attempt": 1}))
    assert not cleared.progress and "exit" not in cleared.report


def test_a_body_nested_past_the_parser_is_refused_not_an_error():
    for raw in (b"[" * 60_000, b'{"acceleratePodReport": ' + b"[" * 60_000):
        with pytest.raises(Refused) as refused:
            parse_body(raw)
        assert refused.value.code == 400


def test_whatever_a_pod_sends_its_report_keeps_only_what_the_operator_reads_small_and_printable():
    escapes = "\x1b[2J\x1b]0;owned\x07\u202eevil\r"
    message = "Traceback\n" + "x" * 40_000 + escapes + "\nRuntimeError: boom\tend"
    report = parse_body(body(acceleratePodReport={
        "attempt": 0, "injected": "y" * 10_000,
        "progress": {"step": 3, "loss": 10 ** 400, "note": "z" * 5000,
                     "metrics": {f"m{i}\x1b[31m": i for i in range(100)}},
        "versions": {"torch": "2.9\x1b[2J", **{f"lib{i}": "1.0" for i in range(40)}},
        "exit": {"attempt": 0, "exitCode": 137, "message": message,
                 "rootCause": escapes + "r" * 5000, "signal": "SIG" * 100, "reason": "Hacked",
                 "rank": 1, "extra": "e" * 1000}})).report
    ended = report["exit"]
    assert ended["message"].endswith("\nRuntimeError: boom end")
    assert len(ended["message"]) == MAX_MESSAGE_CHARS and ended["message"].startswith("[...]")
    # Escape sequences go whole, and of a line what a carriage return redrew: the r's.
    assert ended["rootCause"].startswith("rrrr") and "owned" not in ended["rootCause"]
    assert len(ended["rootCause"]) == MAX_MESSAGE_CHARS and len(ended["signal"]) == MAX_FIELD_CHARS
    assert set(ended) == {"attempt", "exitCode", "message", "rootCause", "signal", "rank"}
    assert set(report) == {"attempt", "progress", "exit", "versions"}
    assert len(report["versions"]) == 16 and report["versions"]["torch"] == "2.9"
    assert report["progress"]["step"] == 3 and "loss" not in report["progress"]
    assert len(report["progress"]["metrics"]) == 16
    texts = [ended["message"], ended["rootCause"], ended["signal"], *report["progress"]["metrics"],
             *report["versions"], *report["versions"].values()]
    assert not any(ord(c) < 32 and c != "\n" or c in "\x7f\x9b\u202e" for t in texts for c in t)
    assert len(json.dumps(report).encode()) < 2 * MAX_MESSAGE_CHARS + 1024


@pytest.mark.parametrize("text, limit, keep_end, cleaned", [
    ("plain\nlines", 100, False, "plain\nlines"),
    ("\x1b[31mred\x1b[0m\ttab\r\n", 100, False, "red tab\n"),  # escape sequences go whole
    ("\x9b2J\u2066x\ud800", 100, False, "x"),
    ("abcdefghij", 8, False, "abc[...]"),
    ("abcdefghij", 8, True, "[...]hij"),
])
def test_text_is_cut_to_its_cap_and_loses_its_control_characters(text, limit, keep_end,
                                                                 cleaned):
    assert printable_text(text, limit, keep_end) == cleaned


# ---- who may write what --------------------------------------------------------------------
def allowed(caller, document, pods=PODS, group=0, namespace="ml", nodes=2):
    pod = job_pod(caller, namespace, "train", JobGroup(JOB_UID, group, nodes, pods))
    may_write(pod, parse_body(body(**document)), "train")
    return pod


def refused(*args, **kwargs) -> str:
    with pytest.raises(Refused) as caught:
        allowed(*args, **kwargs)
    assert caught.value.code == 403
    return str(caught.value)


def caller(namespace: str, name: str, uid: str) -> Caller:
    return Caller(namespace, name, uid, expires=0.0)


def test_pod_0_may_send_progress_and_any_pod_of_the_current_group_a_failed_launch():
    assert allowed(caller("ml", "train-0", "uid-0"), PROGRESS).name == "train-0"
    assert allowed(caller("ml", "train-0", "uid-0"), KUBEFLOW).name == "train-0"
    assert allowed(caller("ml", "train-1", "uid-1"), EXIT).name == "train-1"


def test_progress_from_another_pod_than_0_is_forbidden():
    assert "only from pod 0" in refused(caller("ml", "train-1", "uid-1"), PROGRESS)
    assert "only from pod 0" in refused(caller("ml", "train-1", "uid-1"), KUBEFLOW)


def test_a_pod_of_another_job_or_an_old_uid_is_forbidden():
    nobody = "no live pod of AccelerateJob ml/train"
    assert nobody in refused(caller("ml", "other-0", "uid-other"), PROGRESS)
    # train-0 deleted and created again: a token bound to the old one names the old uid
    assert nobody in refused(caller("ml", "train-0", "uid-0-before"), PROGRESS)
    # the uid of train-0 with the name of another pod: never both from one token, still no
    assert nobody in refused(caller("ml", "train-1", "uid-0"), PROGRESS)


def test_an_impostor_with_the_jobs_labels_and_owner_is_not_the_jobs_pod():
    """A namespace member's pod with the job's labels and a controller ownerReference to the
    job (anyone who may create pods may write both) under a name the operator does not give,
    or an index past the job's nodes."""
    impostors = [(JOB_UID, PodState(name="train-impostor", index=0, attempt=0, phase="Running",
                                    uid="uid-x")),
                 (JOB_UID, PodState(name="train-5", index=5, attempt=0, phase="Running",
                                    uid="uid-5"))]
    assert "no live pod" in refused(caller("ml", "train-impostor", "uid-x"), EXIT,
                                    PODS + impostors)
    assert "no live pod" in refused(caller("ml", "train-5", "uid-5"), EXIT, PODS + impostors)


def test_a_caller_of_another_namespace_learns_nothing_of_the_jobs_there():
    stranger = caller("team-b", "train-0", "uid-0")
    with pytest.raises(Refused) as missing:
        job_pod(stranger, "ml", "nope", None)
    exists = refused(stranger, PROGRESS)
    assert (missing.value.code, str(missing.value).replace("nope", "train")) == (403, exists)
    with pytest.raises(Refused) as own:
        job_pod(caller("ml", "train-0", "uid-0"), "ml", "nope", None)
    assert own.value.code == 404  # in its own namespace, a missing job is said


def test_a_pod_going_away_or_of_an_earlier_group_is_forbidden():
    ending = [(JOB_UID, pod(0, "uid-0", deleting=True))]
    assert "no longer live" in refused(caller("ml", "train-0", "uid-0"), PROGRESS, ending)
    assert "not of the current group" in refused(caller("ml", "train-1", "uid-1"), EXIT,
                                                 group=1)


# ---- rates ---------------------------------------------------------------------------------
def test_a_caller_gets_its_burst_then_one_request_per_second_and_others_are_not_slowed():
    limiter = RateLimiter(rate=1.0, burst=3)
    assert [limiter.take("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a", 0.0) == pytest.approx(1.0)
    assert limiter.take("b", 0.0) == 0.0
    assert limiter.take("a", 1.0) == 0.0
    assert limiter.take("a", 1.5) == pytest.approx(0.5)


def test_the_limiter_keeps_a_bounded_number_of_callers():
    limiter = RateLimiter(rate=1.0, burst=1, max_keys=2)
    for key in "abc":
        limiter.take(key, 0.0)
    assert limiter.take("a", 0.0) == 0.0  # forgotten: a full bucket again
    assert limiter.take("c", 0.0) > 0


# ---- the reports kept --------------------------------------------------------------------
NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def test_a_trainer_status_becomes_pod_0s_progress_as_the_trainer_maps_it():
    store = ReportStore()
    store.take_trainer_status(KEY, "uid-0", parse_body(body(**KUBEFLOW)).trainer_status, NOW)
    report = json.loads(store.text("uid-0"))
    assert report["progress"] == {"step": 3, "total_steps": 10, "loss": 0.5, "eta_seconds": 70,
                                  "metrics": {"loss": 0.5}}
    assert report["progressTime"] == report["lastOutputTime"] == "2026-01-01T12:00:00.000000Z"
    # train end: 100 % without step counts is total/total
    end = {"trainerStatus": {"progressPercentage": 100}}
    store.take_trainer_status(KEY, "uid-0", parse_body(body(**end)).trainer_status, NOW)
    assert json.loads(store.text("uid-0"))["progress"]["step"] == 10


def test_the_pods_own_progress_wins_and_a_new_attempt_starts_transformers_afresh():
    store = ReportStore()
    store.take_report(KEY, "uid-0", {"progress": None, "lastOutputTime": None, "attempt": 0},
                      NOW)
    store.take_trainer_status(KEY, "uid-0", parse_body(body(**KUBEFLOW)).trainer_status, NOW)
    assert json.loads(store.text("uid-0"))["progress"]["step"] == 3
    store.take_report(KEY, "uid-0", {"progress": {"step": 7}, "attempt": 0,
                                     "lastOutputTime": "2026-01-01T12:00:05Z"}, NOW)
    assert json.loads(store.text("uid-0"))["progress"] == {"step": 7}
    later = NOW + timedelta(seconds=9)
    store.take_report(KEY, "uid-0", {"progress": None, "attempt": 1,
                                     "lastOutputTime": "2026-01-01T12:00:09Z"}, later)
    assert json.loads(store.text("uid-0")) == {"progress": None, "attempt": 1,
                                               "lastOutputTime": "2026-01-01T12:00:09Z",
                                               "receivedTime": "2026-01-01T12:00:09.000000Z"}


def test_a_report_is_timed_by_the_operator_not_by_what_the_pod_says():
    """status.progress.updateTime comes from when the operator took the report: a pod cannot
    make its progress look fresher (or older) than it is."""
    forged = {"progress": {"step": 7}, "receivedTime": "2099-01-01T00:00:00Z"}
    kept = parse_body(body(acceleratePodReport=forged)).report
    assert "receivedTime" not in kept
    store = ReportStore()
    store.take_report(KEY, "uid-0", kept, NOW)
    assert parse_report(store.text("uid-0")).received == NOW.replace(tzinfo=None)


def test_reports_go_with_their_pod_and_their_job():
    store = ReportStore()
    for uid in ("uid-0", "uid-1"):
        store.take_report(KEY, uid, EXIT["acceleratePodReport"], NOW)
    store.take_report(("ml", "other"), "uid-other", EXIT["acceleratePodReport"], NOW)
    store.keep_only(KEY, ["uid-1"])
    assert store.text("uid-0") is None and store.text("uid-1") is not None
    store.forget_job(KEY)
    assert store.text("uid-1") is None and len(store) == 1
    store.forget_pod(("ml", "other"), "uid-other")
    assert len(store) == 0


# ---- when the pass sees a report -----------------------------------------------------------
def report(**fields) -> str:
    return json.dumps({"attempt": 0, "lastOutputTime": "2026-01-01T00:00:00Z", **fields})


STEP_3 = report(progress={"step": 3}, progressTime="2026-01-01T00:00:00Z")
FAILED = report(exit={"attempt": 0, "exitCode": 1, "message": "boom"})


@pytest.mark.parametrize("before, after, when", [
    (None, report(), None),  # a first sign of life: the stall check's timer reads it
    (report(), report(lastOutputTime="2026-01-01T00:00:09Z"), None),
    (report(), STEP_3, PASS_NOW),  # the attempt's first step ends its startup
    (None, STEP_3, PASS_NOW),
    (STEP_3, report(progress={"step": 4}, progressTime="2026-01-01T00:00:08Z"), PASS_WHEN_DUE),
    (STEP_3, STEP_3.replace('00:00Z"}', '00:09Z"}'), None),  # the same step, alive
    (STEP_3, report(progress={"step": 3}, versions={"torch": "2.9.0"}), PASS_WHEN_DUE),
    (STEP_3, FAILED, PASS_NOW),  # a failed launch: restart in place, or count it
    (FAILED, report(attempt=1), PASS_NOW),  # withdrawn: another attempt runs
    (STEP_3, report(attempt=1, progress={"step": 3}), PASS_NOW),
])
def test_a_report_runs_the_pass_at_once_only_when_it_changes_a_decision(before, after, when):
    assert pass_for_report(before, after) == when
