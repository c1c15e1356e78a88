"""Who may report to a job, checked against the real API server and the deployed operator's
report endpoint (reached through `kubectl port-forward` to its active replica): only a live pod
of the job, with a token the API server issued bound to that pod for the endpoint's own
audience; progress only from pod 0. Every refusal leaves the job's status as it was. The tokens
come from TokenRequest (`kubectl create token`, as the kubelet asks for the projected volume);
the pods are never scheduled: a token is bound to a pod object, not to a running container."""

from __future__ import annotations

import base64
import datetime as dt
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from accelerate_operator.report_settings import ENV_PROGRESS_WRITE, PROGRESS_WRITE_SECONDS
from accelerate_operator.report_tls import renew
from accelerate_trainer.contract import (
    MAX_BODY_BYTES,
    NEXT_REPORT_KEY,
    NEXT_REPORT_SECONDS,
    REPORT_BODY_KEY,
)

from devtools.cluster import (
    create_namespace,
    delete_namespace,
    kubectl,
    kubectl_binary,
    kubectl_json,
    wait_for,
)
from tests.helpers.jobs import JobBuilder, apply_job, wait_for_job
from tests.helpers.operator import OPERATOR_NAMESPACE, OPERATOR_SELECTOR, active_operator
from tests.helpers.report_post import forwarded, job_ca, pod_token, post

pytestmark = pytest.mark.cluster


def progress(step: int) -> dict:
    return {REPORT_BODY_KEY: {"progress": {"step": step, "total_steps": 40, "loss": 0.5},
                              "lastOutputTime": "2026-01-01T00:00:00Z"}}


def pod_uid(kubeconfig: str, namespace: str, name: str) -> str:
    return wait_for(lambda: kubectl("-n", namespace, "get", "pod", name, "-o",
                                    "jsonpath={.metadata.uid}", kubeconfig=kubeconfig,
                                    check=False).stdout, timeout=60, description=f"pod {name}")


@pytest.fixture(scope="module")
def site(kubeconfig: str) -> Iterator[dict]:
    """Jobs `alpha` (2 pods) and `beta` in one namespace, `alpha` again in another; the
    endpoint's local port and CA."""
    namespaces = [create_namespace(kubeconfig, prefix="report-security") for _ in range(2)]
    main, other = namespaces
    apply_job(kubeconfig, main, JobBuilder("alpha").nodes(2).procs(1).unscheduled().build())
    apply_job(kubeconfig, main, JobBuilder("beta").nodes(1).unscheduled().build())
    apply_job(kubeconfig, other, JobBuilder("alpha").nodes(1).unscheduled().build())
    uids = {(ns, pod): pod_uid(kubeconfig, ns, pod) for ns, pod in (
        (main, "alpha-0"), (main, "alpha-1"), (main, "beta-0"), (other, "alpha-0"))}
    active, _ = active_operator(kubeconfig)
    try:
        with forwarded(kubeconfig, OPERATOR_NAMESPACE, active) as port:
            yield {"ns": main, "other": other, "uids": uids, "port": port,
                   "ca": job_ca(kubeconfig, main, "alpha")}
    finally:
        for namespace in namespaces:
            delete_namespace(kubeconfig, namespace)


def send(site: dict, token: str | None, body, job: str = "alpha", namespace: str | None = None):
    return post(site["port"], site["ca"], namespace or site["ns"], job, token, body)


def token_of(kubeconfig: str, site: dict, pod: str, namespace: str | None = None, **kw) -> str:
    namespace = namespace or site["ns"]
    return pod_token(kubeconfig, namespace, pod, site["uids"][(namespace, pod)], **kw)


def api_server_answer(kubeconfig: str, path: str, token: str) -> int:
    """The API server's answer to a GET with `token` alone (no client certificate)."""
    cluster = yaml.safe_load(Path(kubeconfig).read_text())["clusters"][0]["cluster"]
    ca = cluster.get("certificate-authority-data")
    context = (ssl.create_default_context(cadata=base64.b64decode(ca).decode()) if ca else
               ssl.create_default_context(cafile=cluster["certificate-authority"]))
    request = urllib.request.Request(cluster["server"] + path,
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=15) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


def progress_write_seconds(kubeconfig: str) -> float:
    """The deployed operator's progress write interval (the tests' deploy sets it short)."""
    deployment = kubectl_json("-n", OPERATOR_NAMESPACE, "get", "deployment", "-l",
                              OPERATOR_SELECTOR, kubeconfig=kubeconfig)["items"][0]
    env = {e["name"]: e.get("value") for e in
           deployment["spec"]["template"]["spec"]["containers"][0].get("env") or []}
    return float(env.get(ENV_PROGRESS_WRITE) or PROGRESS_WRITE_SECONDS)


def status_of(kubeconfig: str, namespace: str, job: str) -> dict:
    return kubectl_json("-n", namespace, "get", "acceleratejob", job,
                        kubeconfig=kubeconfig).get("status") or {}


@contextmanager
def progress_writes(kubeconfig: str, namespace: str, job: str) -> Iterator[list[str]]:
    """The job's status.progress.step at every event of a watch that runs inside the block
    (filled in when the block ends): each change is one status write the operator made."""
    watch = subprocess.Popen(
        [kubectl_binary(), f"--kubeconfig={kubeconfig}", "-n", namespace, "get",
         "acceleratejob", job, "--watch", "--output-watch-events",
         "-o", "jsonpath={.type} {.object.status.progress.step}{\"\\n\"}"],
        stdout=subprocess.PIPE, text=True)
    steps: list[str] = []
    try:
        time.sleep(1.0)  # the watch's first event: the job as it is
        yield steps
    finally:
        watch.terminate()
        out, _ = watch.communicate(timeout=15)
        values = [line.split(" ", 1)[1] for line in out.splitlines() if " " in line]
        steps.extend(v for i, v in enumerate(values) if i == 0 or v != values[i - 1])


def test_pod_0s_token_is_taken_and_its_progress_shows_in_the_status(kubeconfig, site):
    answer = send(site, token_of(kubeconfig, site, "alpha-0"), progress(12))
    assert answer[0] == 200, answer
    # Pod 0 is told to report again as the job's next progress write falls due: one interval.
    low, high = NEXT_REPORT_SECONDS
    interval = min(max(progress_write_seconds(kubeconfig), low), high)
    assert interval <= answer[1][NEXT_REPORT_KEY] <= interval + 1, answer
    job = wait_for_job(kubeconfig, site["ns"], "alpha",
                       lambda j: (j.get("status", {}).get("progress") or {}).get("step") == 12,
                       timeout=30, description="the reported progress in the job's status")
    assert job["status"]["progress"]["summary"] == "12/40 (30%)"


def test_forged_and_unauthenticated_reports_are_refused_and_change_nothing(kubeconfig, site):
    """Each refused report leaves the status as it was: the next write, of pod 0's next step,
    is the first the operator makes."""
    ns = site["ns"]
    wait_for_job(kubeconfig, ns, "alpha", lambda j: (j.get("status", {}).get("progress") or {})
                 .get("step") == 12, timeout=30, description="the first report")
    with progress_writes(kubeconfig, ns, "alpha") as steps:
        send_refused(kubeconfig, site)
        assert send(site, token_of(kubeconfig, site, "alpha-0"), progress(13))[0] == 200
        wait_for_job(kubeconfig, ns, "alpha", lambda j: j["status"]["progress"]["step"] == 13,
                     timeout=progress_write_seconds(kubeconfig) + 20,
                     description="pod 0's next step written")
    assert steps == ["12", "13"], steps


def send_refused(kubeconfig: str, site: dict) -> None:
    ns, other = site["ns"], site["other"]
    refused = {
        "a pod of another job": (token_of(kubeconfig, site, "beta-0"), 403),
        "pod 1 sending progress": (token_of(kubeconfig, site, "alpha-1"), 403),
        "alpha-0 of another namespace": (token_of(kubeconfig, site, "alpha-0", other), 403),
        "a token whose signature was changed": (token_of(kubeconfig, site, "alpha-0")[:-4]
                                                + "AAAA", 401),
        "the pod's token for the API server": (
            token_of(kubeconfig, site, "alpha-0", audience=None), 401),
        "a token bound to no pod": (pod_token(kubeconfig, ns, None), 401),
        "no token": (None, 401),
    }
    for why, (token, code) in refused.items():
        answer = send(site, token, progress(999))
        assert answer[0] == code, (why, answer)
    assert send(site, token_of(kubeconfig, site, "alpha-0"), b"{not json")[0] == 400
    assert send(site, token_of(kubeconfig, site, "alpha-0"), b"x" * (MAX_BODY_BYTES + 1))[0] \
        == 413
    assert send(site, token_of(kubeconfig, site, "alpha-0"), progress(999), job="nope")[0] \
        == 404


def test_a_token_of_a_pod_deleted_and_created_again_is_refused(kubeconfig, site):
    ns = site["ns"]
    old = token_of(kubeconfig, site, "beta-0")
    kubectl("-n", ns, "delete", "pod", "beta-0", "--wait=true", kubeconfig=kubeconfig)
    wait_for(lambda: pod_uid(kubeconfig, ns, "beta-0") not in ("", site["uids"][(ns, "beta-0")]),
             timeout=90, description="beta-0 created again")
    answer = send(site, old, progress(5), job="beta")
    assert answer[0] in (401, 403), answer  # the API server no longer vouches for it, or the
    assert "progress" not in status_of(kubeconfig, ns, "beta")  # operator sees the old uid


def test_a_sustained_flood_writes_progress_at_most_once_per_interval(kubeconfig, site):
    """Pod 0 reporting a new step every 0.3 s for 2 intervals (the deployed operator's progress
    write interval): the operator takes what its rate limit lets through (a new step each time)
    and still writes status.progress at most once per interval, the newest step last, within an
    interval of it."""
    interval = progress_write_seconds(kubeconfig)
    token = token_of(kubeconfig, site, "alpha-0")
    with progress_writes(kubeconfig, site["ns"], "alpha") as steps:
        started, step, taken = time.monotonic(), 100, []
        while time.monotonic() - started < 2 * interval:
            step += 1
            if send(site, token, progress(step))[0] == 200:
                taken.append(str(step))
            time.sleep(0.3)
        wait_for_job(kubeconfig, site["ns"], "alpha",
                     lambda j: j["status"]["progress"]["step"] == int(taken[-1]),
                     timeout=interval + 10, description="the last step held back, written")
        elapsed = time.monotonic() - started
    assert len(taken) > 2 * elapsed / interval, taken  # far more than one per interval
    writes = steps[1:]  # the first is the job as the watch found it
    assert writes and writes[-1] == taken[-1], (writes, taken)
    assert len(writes) <= elapsed / interval + 1, (writes, taken, elapsed)


def test_a_flood_from_one_pod_is_throttled_with_retry_after(kubeconfig, site):
    token = token_of(kubeconfig, site, "alpha-0")
    answers = [send(site, token, progress(13 + i)) for i in range(25)]
    throttled = [a for a in answers if a[0] == 429]
    assert throttled and all(a[2] and int(a[2]) >= 1 for a in throttled), answers
    assert {a[0] for a in answers} <= {200, 429}


def test_the_endpoints_token_is_refused_by_the_api_server_and_pods_may_not_patch_pods(
        kubeconfig, site):
    ns = site["ns"]
    token = token_of(kubeconfig, site, "alpha-0")
    assert api_server_answer(kubeconfig, f"/api/v1/namespaces/{ns}/pods", token) == 401
    assert api_server_answer(kubeconfig, f"/api/v1/namespaces/{ns}/pods",
                             token_of(kubeconfig, site, "alpha-0", audience=None)) == 403
    can = kubectl("auth", "can-i", "patch", "pods", "-n", ns,
                  f"--as=system:serviceaccount:{ns}:default", kubeconfig=kubeconfig, check=False)
    assert can.stdout.strip() == "no"
    owned = kubectl_json("-n", ns, "get", "roles,rolebindings", kubeconfig=kubeconfig)["items"]
    assert owned == []


def test_a_client_that_trusts_another_ca_does_not_send(kubeconfig, site):
    """The pods verify the endpoint with the CA of their job's ConfigMap: the same check with a
    CA of another fails the handshake before anything is sent."""
    stranger = renew(None, ["x"], dt.datetime.now(dt.timezone.utc)).ca_certs
    with pytest.raises(ssl.SSLCertVerificationError):
        send({**site, "ca": stranger}, None, progress(1))
    assert send(site, None, progress(1))[0] == 401  # the job's own CA: the handshake works
