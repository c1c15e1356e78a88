"""The ConfigMap that keeps a group's logs when the operator restarts it; compared whole."""

from __future__ import annotations

import json

from accelerate_operator.api import parse_job
from accelerate_operator.resources.logs import TRUNCATED_MARKER, build_logs_configmap

from tests.helpers.jobs import JobBuilder


def test_logs_configmap_is_built_whole_owned_by_the_job_and_labelled_with_the_attempt():
    job = parse_job(JobBuilder().build())
    logs = {"train-1": "b1\nb2\n", "train-0": "a1\na2\n"}
    assert build_logs_configmap(job, 2, logs) == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "train-logs-attempt-2",
            "namespace": "ml",
            "labels": {
                "app.kubernetes.io/name": "accelerate-job",
                "app.kubernetes.io/instance": "train",
                "app.kubernetes.io/managed-by": "accelerate-operator",
                "accelerate-operator.io/job-name": "train",
                "accelerate-operator.io/attempt": "2",
            },
            "ownerReferences": [{
                "apiVersion": "accelerate-operator.io/v1alpha1",
                "kind": "AccelerateJob",
                "name": "train",
                "uid": "uid-train",
                "controller": True,
                "blockOwnerDeletion": True,
            }],
        },
        "data": {"train-0.log": "a1\na2\n", "train-1.log": "b1\nb2\n"},
    }


def test_only_the_last_lines_are_kept():
    job = parse_job(JobBuilder().build())
    text = "".join(f"line {i}\n" for i in range(1000))
    data = build_logs_configmap(job, 0, {"train-0": text}, lines=300)["data"]
    kept = data["train-0.log"].splitlines()
    assert len(kept) == 300 and kept[0] == "line 700" and kept[-1] == "line 999"


def test_the_whole_configmap_stays_under_the_size_cap_and_keeps_each_tail():
    job = parse_job(JobBuilder().nodes(4).build())
    long_line = "x" * 9000
    logs = {f"train-{i}": "".join(f"{i}:{n}:{long_line}\n" for n in range(300)) + "END\n"
            for i in range(4)}
    manifest = build_logs_configmap(job, 1, logs)
    assert len(json.dumps(manifest["data"]).encode()) < 900 * 1024 + 1024
    for i in range(4):
        text = manifest["data"][f"train-{i}.log"]
        assert text.startswith(TRUNCATED_MARKER)
        assert text.endswith("END\n")
        assert text[len(TRUNCATED_MARKER):].startswith(f"{i}:")  # starts on a whole line


def test_an_empty_log_is_archived_as_empty():
    job = parse_job(JobBuilder().build())
    assert build_logs_configmap(job, 0, {"train-0": ""})["data"] == {"train-0.log": ""}
