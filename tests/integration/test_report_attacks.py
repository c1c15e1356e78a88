"""The report endpoint read as an attacker reads it (issue 57), against the real API server and
the deployed operator (its active replica reached through `kubectl port-forward`): a flood of
made-up tokens while a pod keeps reporting, slow clients, deep and oversized bodies, an `exit`
of 60 KB of escape codes, an impostor pod with the job's labels and owner, a probe from another
namespace, and the API credential a job's pod holds. Each test failed on main at 4b15dd8 (see
each docstring). The pods are never scheduled: a token is bound to a pod object."""

from __future__ import annotations

import json
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import jwt
import pytest
from accelerate_operator.report_server import LIMITS
from accelerate_trainer.contract import MAX_FIELD_CHARS, MAX_MESSAGE_CHARS, REPORT_BODY_KEY
from cryptography.hazmat.primitives.asymmetric import rsa

from devtools.cluster import create_namespace, delete_namespace, kubectl, kubectl_json, wait_for
from devtools.images import TRAINER_CPU_IMAGE
from tests.helpers.jobs import JobBuilder, apply_job, wait_for_job
from tests.helpers.operator import OPERATOR_NAMESPACE, active_operator
from tests.helpers.report_post import PATH, SERVICE_HOST, forwarded, job_ca, pod_token, post

pytestmark = pytest.mark.cluster


def pod_uid(kubeconfig: str, namespace: str, name: str) -> str:
    return wait_for(lambda: kubectl("-n", namespace, "get", "pod", name, "-o",
                                    "jsonpath={.metadata.uid}", kubeconfig=kubeconfig,
                                    check=False).stdout, timeout=60, description=f"pod {name}")


@pytest.fixture(scope="module")
def jobs(kubeconfig: str) -> Iterator[dict]:
    """Jobs `alpha` (reports progress), `gamma` (sends a failed launch; no restart left) and
    `delta` (gets an impostor) in one namespace, `alpha` again in another; the endpoint's CA."""
    main, other = (create_namespace(kubeconfig, prefix="report-attacks") for _ in range(2))
    apply_job(kubeconfig, main, JobBuilder("alpha").nodes(1).unscheduled().build())
    apply_job(kubeconfig, main, JobBuilder("gamma").nodes(1).unscheduled()
              .run_policy(backoffLimit=0).build())
    apply_job(kubeconfig, main, JobBuilder("delta").nodes(1).unscheduled().build())
    apply_job(kubeconfig, other, JobBuilder("alpha").nodes(1).unscheduled().build())
    try:
        yield {"ns": main, "other": other, "ca": job_ca(kubeconfig, main, "alpha")}
    finally:
        for namespace in (main, other):
            delete_namespace(kubeconfig, namespace)


@pytest.fixture
def site(kubeconfig: str, jobs: dict) -> Iterator[dict]:
    """The jobs, and the endpoint's local port: a port-forward of this test's own (kubectl's
    port-forward ends when the endpoint resets a connection, as it does to a client over its
    limits)."""
    active, _ = active_operator(kubeconfig)
    with forwarded(kubeconfig, OPERATOR_NAMESPACE, active) as port:
        yield {**jobs, "port": port}


def token(kubeconfig: str, namespace: str, pod: str) -> str:
    """A fresh token bound to the pod (a new string each time, as the kubelet's renewals)."""
    return pod_token(kubeconfig, namespace, pod, pod_uid(kubeconfig, namespace, pod))


def progress(step: int) -> dict:
    return {REPORT_BODY_KEY: {"progress": {"step": step, "total_steps": 10_000},
                              "lastOutputTime": "2026-01-01T00:00:00Z"}}


def send(site: dict, bearer: str | None, body, job: str = "alpha",
         namespace: str | None = None):
    return post(site["port"], site["ca"], namespace or site["ns"], job, bearer, body)


def step_of(kubeconfig: str, namespace: str, job: str) -> int | None:
    status = kubectl_json("-n", namespace, "get", "acceleratejob", job,
                          kubeconfig=kubeconfig).get("status") or {}
    return (status.get("progress") or {}).get("step")


def made_up_tokens(kubeconfig: str, count: int) -> list[str]:
    """Distinct tokens no one issued: random strings, and JWTs with the cluster's own key id
    and claims of a pod, signed by a key of ours (the endpoint must check the signature)."""
    keys = json.loads(kubectl("get", "--raw", "/openid/v1/jwks", kubeconfig=kubeconfig).stdout)
    kid = keys["keys"][0]["kid"]
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = int(time.time())
    return [secrets.token_urlsafe(600) if i % 2 else jwt.encode(
        {"iss": "https://kubernetes.default.svc.cluster.local",
         "aud": ["accelerate-operator.io/report"], "iat": now, "nbf": now, "exp": now + 600,
         "sub": "system:serviceaccount:x:default", "kubernetes.io": {"namespace": "x", "pod": {
             "name": secrets.token_hex(4), "uid": secrets.token_hex(8)}}},
        key, algorithm="RS256", headers={"kid": kid}) for i in range(count)]


# Run in a pod of another namespace: THREADS threads POST made-up tokens to the report Service
# for SECONDS, then print how they were answered (one JSON line).
FLOOD = r"""
import collections, json, os, ssl, threading, time, urllib.error, urllib.request
tokens, url = json.loads(os.environ["TOKENS"]), os.environ["URL"]
context = ssl.create_default_context(cadata=os.environ["CA"])
answers, stop = collections.Counter(), time.monotonic() + float(os.environ["SECONDS"])
def flood(offset):
    sent = offset
    while time.monotonic() < stop:
        request = urllib.request.Request(url, data=b'{"acceleratePodReport": {}}', headers={
            "Authorization": "Bearer " + tokens[sent % len(tokens)]})
        try:
            answers[urllib.request.urlopen(request, context=context, timeout=10).status] += 1
        except urllib.error.HTTPError as error:
            answers[error.code] += 1
        except OSError as error:
            answers[type(error).__name__] += 1
        sent += 7
print("flooding", flush=True)
threads = [threading.Thread(target=flood, args=(i,)) for i in range(int(os.environ["THREADS"]))]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(answers), flush=True)
"""


def flood_pod(kubeconfig: str, site: dict, seconds: int, threads: int = 8) -> dict:
    url = ("https://accelerate-operator.accelerate-system.svc:8443"
           + PATH.format(site["ns"], "alpha"))
    env = {"TOKENS": json.dumps(made_up_tokens(kubeconfig, 60)), "URL": url, "CA": site["ca"],
           "SECONDS": str(seconds), "THREADS": str(threads)}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "flood", "namespace": site["other"]},
            "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [{
                         "name": "flood", "image": TRAINER_CPU_IMAGE,
                         "imagePullPolicy": "IfNotPresent", "command": ["python3", "-c", FLOOD],
                         "env": [{"name": k, "value": v} for k, v in env.items()],
                         "securityContext": {"allowPrivilegeEscalation": False,
                                             "capabilities": {"drop": ["ALL"]}}}]}}


def test_a_flood_of_made_up_tokens_spends_no_budget_of_a_pod_that_keeps_reporting(
        kubeconfig, site):
    """A pod of another namespace, holding no credential, POSTs distinct made-up tokens from 8
    threads through the report Service while pod 0 of alpha reports a new step every 0.3 s with
    a fresh token (as after each kubelet renewal): every one of its reports is taken and its
    last step reaches the status; the flood is refused (401) and never throttles anyone else.
    On main the flood spent the one TokenReview budget (20/s for all callers): pod 0's new
    token got 429."""
    ns, other = site["ns"], site["other"]
    kubectl("-n", other, "apply", "-f", "-", input=json.dumps(flood_pod(kubeconfig, site, 25)),
            kubeconfig=kubeconfig)
    wait_for(lambda: "flooding" in kubectl("-n", other, "logs", "flood", kubeconfig=kubeconfig,
                                           check=False).stdout,
             timeout=120, description="the flood pod under way")
    real = []
    for step in range(100, 106):
        real.append(send(site, token(kubeconfig, ns, "alpha-0"), progress(step))[:2])
        time.sleep(0.3)
    assert [code for code, _ in real] == [200] * len(real), real
    wait_for(lambda: step_of(kubeconfig, ns, "alpha") == 105, timeout=30,
             description="pod 0's last step in the status (within the progress write interval)")
    log = wait_for(lambda: (lambda out: out if out.count("\n") >= 2 else "")(kubectl(
        "-n", other, "logs", "flood", kubeconfig=kubeconfig, check=False).stdout),
        timeout=60, description="the flood's tally")
    answers = json.loads(log.splitlines()[-1])
    assert set(answers) == {"401"} and answers["401"] > 200, answers  # a flood, all refused


def slow_connection(site: dict) -> ssl.SSLSocket:
    context = ssl.create_default_context(cadata=site["ca"])
    raw = socket.create_connection(("127.0.0.1", site["port"]), timeout=30)
    return context.wrap_socket(raw, server_hostname=SERVICE_HOST)


def closed_after(connection: ssl.SSLSocket, drip: bytes | None) -> tuple[float, bytes]:
    """Seconds until the endpoint closes the connection, and what it said; `drip`: a byte of it
    sent every 0.5 s meanwhile (a client that never finishes its head)."""
    started, said = time.monotonic(), b""
    connection.settimeout(0.5)
    for index in range(60):
        try:
            chunk = connection.recv(4096)
            if not chunk:
                break
            said += chunk
        except TimeoutError:
            pass
        except (ConnectionError, ssl.SSLError):
            break
        try:
            if drip:
                connection.sendall(drip[index % len(drip):index % len(drip) + 1])
        except (ConnectionError, ssl.SSLError, OSError):
            break
    return time.monotonic() - started, said


def test_slow_clients_are_cut_off_at_the_deadlines(kubeconfig, site):
    """A head sent a byte every 0.5 s is closed at the header deadline; a body that never comes
    gets 408 at the body deadline, both well before the clients would stop. On main neither
    deadline existed: both connections stayed open past 30 s."""
    bounds = LIMITS.bounds
    slow_head, slow_body = slow_connection(site), slow_connection(site)
    path = PATH.format(site["ns"], "alpha")
    slow_head.sendall(f"POST {path} HTTP/1.1\r\n".encode())
    slow_body.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                       f"{token(kubeconfig, site['ns'], 'alpha-0')}\r\nContent-Length: 500\r\n"
                       "\r\n{").encode())
    results: dict[str, tuple[float, bytes]] = {}
    threads = [threading.Thread(target=lambda: results.update(head=closed_after(
                   slow_head, b"X-Slow: " + b"a" * 100))),
               threading.Thread(target=lambda: results.update(body=closed_after(
                   slow_body, None)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    head_seconds, _ = results["head"]
    body_seconds, said = results["body"]
    assert head_seconds < bounds.header_seconds + 5, results
    assert said.startswith(b"HTTP/1.1 408") and body_seconds < LIMITS.body_seconds + 5, results


def test_deep_and_oversized_bodies_are_refused_and_junk_before_it_is_read(kubeconfig, site):
    """60,000 `[` was a 500 and a RecursionError traceback in the operator's log on main."""
    real = token(kubeconfig, site["ns"], "alpha-0")
    assert send(site, real, b"[" * 60_000)[0] == 400
    assert send(site, real, b'{"acceleratePodReport":' + b"[" * 60_000)[0] == 400
    assert send(site, real, b"x" * (64 * 1024 + 1))[0] == 413
    assert send(site, "junk", b"[" * 60_000)[0] == 401  # the token first, the body never read


def test_an_exit_of_60_kb_of_escape_codes_leaves_a_small_printable_job(kubeconfig, site):
    """gamma's pod reports a failed launch whose message and root cause hold 60 KB and terminal
    escape codes; the job fails (no restart left) with both cut to their caps and printable, and
    the whole object stays small. On main lastFailure became 60,070 characters, escapes
    included, and the object 65 KB."""
    ns = site["ns"]
    escapes = "\x1b[2J\x1b]0;owned\x07\x9b31m"
    message = ("Traceback (most recent call last):\n" + (escapes + "x" * 80 + "\n") * 460
               + "RuntimeError: boom")
    body = {REPORT_BODY_KEY: {"attempt": 0, "exit": {
        "attempt": 0, "exitCode": 1, "message": message, "rootCause": escapes + "y" * 2000,
        "signal": escapes * 100}}}
    assert 60_000 < len(json.dumps(body)) < 64 * 1024
    assert send(site, token(kubeconfig, ns, "gamma-0"), body, job="gamma")[0] == 200
    job = wait_for_job(kubeconfig, ns, "gamma", lambda j: j.get("status", {}).get("phase")
                       == "Failed", timeout=60, description="gamma failed")
    failure = job["status"]["lastFailure"]
    texts = [failure] + [c.get("message") or "" for c in job["status"]["conditions"]]
    assert not any(ord(c) < 32 and c != "\n" or 0x7f <= ord(c) <= 0x9f
                   for text in texts for c in text), failure[:300]
    assert failure.rstrip().endswith("RuntimeError: boom")
    assert len(failure) <= 2 * MAX_MESSAGE_CHARS + MAX_FIELD_CHARS + 200, len(failure)
    size = len(kubectl("-n", ns, "get", "acceleratejob", "gamma", "-o", "json",
                       kubeconfig=kubeconfig).stdout)
    assert size < 24 * 1024, size


def test_an_impostor_pod_with_the_jobs_labels_and_owner_is_not_the_jobs(kubeconfig, site):
    """A pod any namespace member may create: delta-0's labels and a controller ownerReference
    to delta (the API server lets anyone who may create the pod write both), under another name.
    Its own token's progress is refused while the operator indexes it. On main it was taken
    (200): the label and an ownerReference of kind AccelerateJob were all that was checked."""
    ns = site["ns"]
    assert send(site, token(kubeconfig, ns, "delta-0"), progress(3), job="delta")[0] == 200
    real = kubectl_json("-n", ns, "get", "pod", "delta-0", kubeconfig=kubeconfig)
    impostor = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "delta-impostor", "namespace": ns, "labels": real["metadata"]["labels"],
        "ownerReferences": [{**ref, "blockOwnerDeletion": False}
                            for ref in real["metadata"]["ownerReferences"]]},
        "spec": {**real["spec"], "hostname": "delta-impostor"}}
    kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(impostor), kubeconfig=kubeconfig)
    bearer = token(kubeconfig, ns, "delta-impostor")
    answers = []
    for _ in range(6):  # the operator's watch has it within this time
        answers.append(send(site, bearer, progress(7), job="delta")[0])
        time.sleep(0.3)
    assert answers == [403] * 6, answers
    assert step_of(kubeconfig, ns, "delta") != 7


def test_a_caller_of_another_namespace_cannot_tell_a_missing_job_from_a_forbidden_one(
        kubeconfig, site):
    """On main a missing job answered 404 before the namespace was checked: job names leaked
    across namespaces."""
    stranger = token(kubeconfig, site["other"], "alpha-0")
    exists = send(site, stranger, progress(1), job="alpha")
    missing = send(site, stranger, progress(1), job="no-such-job")
    assert exists[0] == missing[0] == 403
    assert exists[1]["message"].replace("alpha", "X") == \
        missing[1]["message"].replace("no-such-job", "X")


def test_the_jobs_pods_hold_no_api_credential(kubeconfig, site):
    """The operator turns the API token off (the template did not ask for one): no token for
    the API server is mounted, only the endpoint's. On main the pod got the namespace's default
    service-account token (automountServiceAccountToken unset)."""
    pod = kubectl_json("-n", site["ns"], "get", "pod", "alpha-0", kubeconfig=kubeconfig)
    assert pod["spec"]["automountServiceAccountToken"] is False
    audiences = [source["serviceAccountToken"].get("audience")
                 for volume in pod["spec"]["volumes"]
                 for source in (volume.get("projected") or {}).get("sources", [])
                 if "serviceAccountToken" in source]
    assert audiences == ["accelerate-operator.io/report"]
    assert not any(v["name"].startswith("kube-api-access") for v in pod["spec"]["volumes"])
