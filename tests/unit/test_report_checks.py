"""The report endpoint's decisions, pure: the body's shape, who a TokenReview says the caller
is, whether that pod may write what it sent, per-caller rates, the TokenReview cache and the
reports kept per pod."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from accelerate_operator.pod_state import PodState
from accelerate_operator.report_checks import (
    Caller,
    Refused,
    authorize,
    parse_body,
    read_caller,
)
from accelerate_operator.report_store import RateLimiter, ReportStore, ReviewCache
from accelerate_trainer.contract import MAX_BODY_BYTES, REPORT_AUDIENCE

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
    assert progress.progress and not progress.exit and progress.trainer_status is None
    failed = parse_body(body(**EXIT))
    assert failed.exit and not failed.progress  # nulls are not progress
    kubeflow = parse_body(body(**KUBEFLOW))
    assert kubeflow.progress and kubeflow.trainer_status.metrics["current_step"] == 3
    cleared = parse_body(body(acceleratePodReport={"progress": None, "lastOutputTime": None,
                                                   "attempt": 1}))
    assert not cleared.progress and not cleared.exit


# ---- the caller ----------------------------------------------------------------------------
def review(**changes):
    status = {"authenticated": True, "audiences": [REPORT_AUDIENCE],
              "user": {"username": "system:serviceaccount:ml:default", "extra": {
                  "authentication.kubernetes.io/pod-name": ["train-0"],
                  "authentication.kubernetes.io/pod-uid": ["uid-0"]}}}
    status.update(changes)
    return status


def test_a_pod_bound_token_of_the_endpoints_audience_names_its_pod():
    assert read_caller(review()) == Caller("ml", "train-0", "uid-0")


@pytest.mark.parametrize("status", [
    {}, None, review(authenticated=False),
    review(audiences=["https://kubernetes.default.svc.cluster.local"]),  # the API server's
    review(user={"username": "system:serviceaccount:ml:default", "extra": {}}),  # no pod
    review(user={"username": "alice", "extra": review()["user"]["extra"]}),
])
def test_any_other_token_names_no_one(status):
    assert read_caller(status) is None


# ---- who may write what --------------------------------------------------------------------
def allowed(caller, document, pods=PODS, group=0, namespace="ml"):
    return authorize(caller, namespace, "train", JOB_UID, group, pods,
                     parse_body(body(**document)))


def refused(*args, **kwargs) -> str:
    with pytest.raises(Refused) as caught:
        allowed(*args, **kwargs)
    assert caught.value.code == 403
    return str(caught.value)


def test_pod_0_may_send_progress_and_any_pod_of_the_current_group_a_failed_launch():
    assert allowed(Caller("ml", "train-0", "uid-0"), PROGRESS).name == "train-0"
    assert allowed(Caller("ml", "train-0", "uid-0"), KUBEFLOW).name == "train-0"
    assert allowed(Caller("ml", "train-1", "uid-1"), EXIT).name == "train-1"


def test_progress_from_another_pod_than_0_is_forbidden():
    assert "only from pod 0" in refused(Caller("ml", "train-1", "uid-1"), PROGRESS)
    assert "only from pod 0" in refused(Caller("ml", "train-1", "uid-1"), KUBEFLOW)


def test_a_pod_of_another_job_another_namespace_or_an_old_uid_is_forbidden():
    assert "no pod of job ml/train" in refused(Caller("ml", "other-0", "uid-other"), PROGRESS)
    assert "namespace team-b" in refused(Caller("team-b", "train-0", "uid-0"), PROGRESS)
    # train-0 deleted and created again: a token bound to the old one names the old uid
    assert "no pod of" in refused(Caller("ml", "train-0", "uid-0-before"), PROGRESS)
    # the uid of train-0 with the name of another pod: never both from one token, still no
    assert "no pod of" in refused(Caller("ml", "train-1", "uid-0"), PROGRESS)


def test_a_pod_going_away_or_of_an_earlier_group_is_forbidden():
    ending = [(JOB_UID, pod(0, "uid-0", deleting=True))]
    assert "no longer live" in refused(Caller("ml", "train-0", "uid-0"), PROGRESS, ending)
    assert "not of the current group" in refused(Caller("ml", "train-1", "uid-1"), EXIT,
                                                 group=1)


# ---- rates and the TokenReview cache ---------------------------------------------------------
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


def test_reviews_are_cached_for_their_ttl_refusals_shorter_and_the_cache_is_bounded():
    cache = ReviewCache(ttl=60, negative_ttl=10, max_entries=2)
    cache.put("good", Caller("ml", "train-0", "uid-0"), now=0)
    cache.put("bad", None, now=0)
    assert cache.get("good", 59) == (True, Caller("ml", "train-0", "uid-0"))
    assert cache.get("bad", 9) == (True, None)
    assert cache.get("bad", 10) == (False, None)
    assert cache.get("good", 60) == (False, None)
    for digest in ("x", "y", "z"):
        cache.put(digest, None, now=100)
    assert len(cache) == 2


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
    store.take_report(KEY, "uid-0", {"progress": None, "lastOutputTime": None, "attempt": 0})
    store.take_trainer_status(KEY, "uid-0", parse_body(body(**KUBEFLOW)).trainer_status, NOW)
    assert json.loads(store.text("uid-0"))["progress"]["step"] == 3
    store.take_report(KEY, "uid-0", {"progress": {"step": 7}, "attempt": 0,
                                     "lastOutputTime": "2026-01-01T12:00:05Z"})
    assert json.loads(store.text("uid-0"))["progress"] == {"step": 7}
    store.take_report(KEY, "uid-0", {"progress": None, "attempt": 1,
                                     "lastOutputTime": "2026-01-01T12:00:09Z"})
    assert json.loads(store.text("uid-0")) == {"progress": None, "attempt": 1,
                                               "lastOutputTime": "2026-01-01T12:00:09Z"}


def test_reports_go_with_their_pod_and_their_job():
    store = ReportStore()
    for uid in ("uid-0", "uid-1"):
        store.take_report(KEY, uid, EXIT["acceleratePodReport"])
    store.take_report(("ml", "other"), "uid-other", EXIT["acceleratePodReport"])
    store.keep_only(KEY, ["uid-1"])
    assert store.text("uid-0") is None and store.text("uid-1") is not None
    store.forget_job(KEY)
    assert store.text("uid-1") is None and len(store) == 1
    store.forget_pod(("ml", "other"), "uid-other")
    assert len(store) == 0
