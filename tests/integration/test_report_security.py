"""Who may push a job's progress, checked against the real API server with the chart's admission
policy and the Roles the deployed operator creates: only pod `<job>-0` itself, with a token bound
to it, changing only its report annotation, up to its size limit. The pushes go through the
supervisor's own PodPatcher (TLS to the API server, the cluster's CA), with tokens the API server
issues bound to the pods (TokenRequest, as the kubelet asks for the projected volume). The pods
are never scheduled: a token is bound to a pod object, not to a running container.

What the operator makes of what is admitted: a valid report becomes status.progress; a malformed
one leaves the status as it was."""

from __future__ import annotations

import base64
import json
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from accelerate_trainer.contract import MAX_REPORT_BYTES, REPORT_ANNOTATION
from accelerate_trainer.supervise import PodPatcher, PushRefused, Snapshot, encode

from devtools.cluster import kubectl, kubectl_json, wait_for
from tests.helpers.jobs import JobBuilder, apply_job, wait_for_job

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def jobs(kubeconfig: str, request: pytest.FixtureRequest) -> Iterator[tuple[str, dict]]:
    """Two jobs, `alpha` and `beta`, in one namespace, whose pods 0 exist: (namespace, uids)."""
    from devtools.cluster import create_namespace, delete_namespace

    namespace = create_namespace(kubeconfig, prefix="report-security")
    for name in ("alpha", "beta"):
        apply_job(kubeconfig, namespace, JobBuilder(name).nodes(1).unscheduled().build())
    uids = {}
    for name in ("alpha", "beta"):
        pod = wait_for(lambda n=name: _get(kubeconfig, namespace, "pod", f"{n}-0"), timeout=60,
                       description=f"pod {name}-0")
        wait_for(lambda n=name: _get(kubeconfig, namespace, "rolebinding", f"{n}-report"),
                 timeout=60, description=f"the report RoleBinding of {name}")
        uids[name] = pod["metadata"]["uid"]
    yield namespace, uids
    delete_namespace(kubeconfig, namespace)


def _get(kubeconfig: str, namespace: str, kind: str, name: str) -> dict | None:
    found = kubectl("-n", namespace, "get", kind, name, "-o", "json", kubeconfig=kubeconfig,
                    check=False)
    return json.loads(found.stdout) if found.returncode == 0 else None


def bound_token(kubeconfig: str, namespace: str, pod: str | None, uid: str | None) -> str:
    """A token of the namespace's `default` account, bound to `pod` (or to nothing)."""
    bound = ["--bound-object-kind", "Pod", "--bound-object-name", pod,
             "--bound-object-uid", uid] if pod else []
    return kubectl("-n", namespace, "create", "token", "default", *bound,
                   kubeconfig=kubeconfig).stdout.strip()


def patcher(kubeconfig: str, namespace: str, pod: str, token: str | None,
            tmp_path: Path) -> PodPatcher:
    """The supervisor's patcher, aimed at the API server of `kubeconfig`."""
    cluster = yaml.safe_load(Path(kubeconfig).read_text())["clusters"][0]["cluster"]
    ca = cluster.get("certificate-authority-data")
    context = (ssl.create_default_context(cadata=base64.b64decode(ca).decode()) if ca else
               ssl.create_default_context(cafile=cluster["certificate-authority"]))
    directory = tmp_path / f"token-{time.monotonic_ns()}"
    directory.mkdir()
    (directory / "token").write_text(token or "")
    url = urlsplit(cluster["server"])
    return PodPatcher(namespace, pod, url.hostname, url.port or 443, directory=str(directory),
                      context=context)


def push(patcher_: PodPatcher, annotation: str) -> str | None:
    """None when the API server took the push, else its refusal."""
    try:
        patcher_.patch(annotation)
    except PushRefused as refused:
        return str(refused)
    return None


REPORT = encode(Snapshot({"step": 12, "total_steps": 40, "loss": 0.5}, time.time()))


def test_pod_0_pushes_its_own_report_and_the_operator_shows_it(kubeconfig, jobs, tmp_path):
    namespace, uids = jobs
    token = bound_token(kubeconfig, namespace, "alpha-0", uids["alpha"])
    assert push(patcher(kubeconfig, namespace, "alpha-0", token, tmp_path), REPORT) is None
    job = wait_for_job(kubeconfig, namespace, "alpha",
                       lambda j: (j.get("status", {}).get("progress") or {}).get("step") == 12,
                       timeout=30, description="the pushed progress in the job's status")
    assert job["status"]["progress"]["summary"] == "12/40 (30%)"


def test_a_pod_of_another_job_is_refused(kubeconfig, jobs, tmp_path):
    namespace, uids = jobs
    beta = bound_token(kubeconfig, namespace, "beta-0", uids["beta"])
    refusal = push(patcher(kubeconfig, namespace, "alpha-0", beta, tmp_path), REPORT)
    assert refusal and "only the pod itself may write its report" in refusal
    assert REPORT_ANNOTATION not in _annotations(kubeconfig, namespace, "beta-0")


def test_a_token_bound_to_no_pod_and_an_unauthenticated_caller_are_refused(
        kubeconfig, jobs, tmp_path):
    namespace, _ = jobs
    unbound = bound_token(kubeconfig, namespace, None, None)
    refusal = push(patcher(kubeconfig, namespace, "beta-0", unbound, tmp_path), REPORT)
    assert refusal and "only the pod itself" in refusal
    anonymous = push(patcher(kubeconfig, namespace, "beta-0", None, tmp_path), REPORT)
    assert anonymous and anonymous.startswith(("HTTP 401", "HTTP 403"))
    assert REPORT_ANNOTATION not in _annotations(kubeconfig, namespace, "beta-0")


def test_a_pod_may_change_nothing_but_its_report_and_not_too_much(kubeconfig, jobs, tmp_path):
    namespace, uids = jobs
    token = bound_token(kubeconfig, namespace, "beta-0", uids["beta"])
    own = patcher(kubeconfig, namespace, "beta-0", token, tmp_path)
    # A label, or the attempt the operator tells the pod to run (a pod restarting itself in
    # place would skip the restart count), through the same connection.
    for change in ({"labels": {"accelerate-operator.io/job-name": "alpha"}},
                   {"annotations": {"accelerate-operator.io/run-attempt": "9"}}):
        connection = own._connect()
        connection.request("PATCH", own.path, json.dumps({"metadata": change}), {
            "Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json"})
        answer = connection.getresponse()
        message = json.loads(answer.read()).get("message", "")
        assert answer.status == 403 and "may change only its annotation" in message, change
    oversized = push(own, "x" * (MAX_REPORT_BYTES + 1))
    assert oversized and "at most 4096 bytes" in oversized
    assert REPORT_ANNOTATION not in _annotations(kubeconfig, namespace, "beta-0")


def test_a_malformed_report_leaves_the_status_as_it_was(kubeconfig, jobs, tmp_path):
    namespace, uids = jobs
    token = bound_token(kubeconfig, namespace, "beta-0", uids["beta"])
    own = patcher(kubeconfig, namespace, "beta-0", token, tmp_path)
    assert push(own, REPORT) is None
    before = wait_for_job(kubeconfig, namespace, "beta",
                          lambda j: (j.get("status", {}).get("progress") or {}).get("step") == 12,
                          timeout=30, description="the first report in the status")
    for malformed in ('{"progress": {"step": "twelve"}}', "not json", "[]"):
        assert push(own, malformed) is None  # admitted: the API server cannot read JSON
    time.sleep(8)  # past the operator's progress write interval
    after = kubectl_json("-n", namespace, "get", "acceleratejob", "beta", kubeconfig=kubeconfig)
    assert after["status"]["progress"] == before["status"]["progress"]
    assert after["status"]["phase"] == before["status"]["phase"]


def _annotations(kubeconfig: str, namespace: str, pod: str) -> dict:
    return (_get(kubeconfig, namespace, "pod", pod) or {}).get("metadata", {}).get(
        "annotations") or {}
