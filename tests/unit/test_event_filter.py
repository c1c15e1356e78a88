"""Which events run a job's pass, decided from the event alone (controller.py): the job's own
events unless they are the echo of a status write, a pod's once something happened to it, a
child's deletion after the grace check. The operator runs these under kopf in tests/integration."""

from __future__ import annotations

from accelerate_operator.event_filter import event_matters, is_deletion, job_key


def job(generation: int, observed: int | None) -> dict:
    status = {} if observed is None else {"observedGeneration": observed}
    return {"metadata": {"name": "llm", "namespace": "ml", "generation": generation},
            "status": status}


def test_a_job_runs_its_pass_when_created_listed_or_its_spec_changed():
    assert event_matters("AccelerateJob", "ADDED", job(1, None))
    assert event_matters("AccelerateJob", None, job(3, 3))  # listed: at start-up, after a 410
    assert event_matters("AccelerateJob", "MODIFIED", job(2, 1))  # e.g. spec.runPolicy.suspend
    assert event_matters("AccelerateJob", "MODIFIED", job(1, None))


def test_the_echo_of_a_status_write_runs_no_pass():
    assert not event_matters("AccelerateJob", "MODIFIED", job(4, 4))


def test_a_pod_runs_the_pass_once_something_happened_to_it():
    created = {"metadata": {}, "spec": {}, "status": {"phase": "Pending"}}
    scheduled = {"metadata": {}, "spec": {"nodeName": "n1"}, "status": {"phase": "Pending"}}
    unschedulable = {"metadata": {}, "spec": {}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}}
    assert not event_matters("Pod", "ADDED", created)  # its creator, a pass, knows it
    assert event_matters("Pod", None, created)  # listed: at start-up, after a 410
    assert event_matters("Pod", "MODIFIED", created)
    for body in (scheduled, unschedulable):
        assert event_matters("Pod", "ADDED", body)
        assert event_matters("Pod", "MODIFIED", body)


def test_every_workload_event_runs_the_pass_but_a_child_created_does_not():
    for event_type in ("ADDED", "MODIFIED", None):
        assert event_matters("Workload", event_type, {"metadata": {}})
    for kind in ("ConfigMap", "Service", "PodDisruptionBudget"):
        assert not event_matters(kind, "ADDED", {"metadata": {}})
        assert not event_matters(kind, "MODIFIED", {"metadata": {}})
        assert event_matters(kind, None, {"metadata": {}})


def test_a_child_deleted_or_being_deleted_waits_for_the_grace_check():
    assert is_deletion("Pod", "DELETED", {"name": "llm-0"})
    assert is_deletion("Pod", "MODIFIED", {"name": "llm-0", "deletionTimestamp": "2026-11-25T"})
    assert is_deletion("Service", "DELETED", {"name": "llm"})
    assert not is_deletion("Pod", "MODIFIED", {"name": "llm-0"})
    assert not is_deletion("AccelerateJob", "DELETED", {"name": "llm"})  # forgotten instead


def test_an_event_belongs_to_the_job_itself_or_to_the_job_named_by_its_label():
    assert job_key("AccelerateJob", {"name": "llm", "namespace": "ml"}) == ("ml", "llm")
    labels = {"accelerate-operator.io/job-name": "llm"}
    assert job_key("Pod", {"name": "llm-0", "namespace": "ml", "labels": labels}) == ("ml", "llm")
    assert job_key("Pod", {"name": "other", "namespace": "ml"}) is None


def test_kopf_hands_over_deletions_and_events_that_matter_only():
    from accelerate_operator.event_filter import hands_over
    labels = {"accelerate-operator.io/job-name": "llm"}
    service = {"metadata": {"name": "llm", "namespace": "ml", "labels": labels}}
    assert hands_over("AccelerateJob", "DELETED", job(4, 4))
    assert not hands_over("AccelerateJob", "MODIFIED", job(4, 4))
    assert hands_over("Service", "DELETED", service)
    assert not hands_over("Service", "ADDED", service)
    being_deleted = {"metadata": {**service["metadata"], "deletionTimestamp": "2026-11-25T"},
                     "spec": {}, "status": {"phase": "Pending"}}
    assert hands_over("Pod", "MODIFIED", being_deleted)
