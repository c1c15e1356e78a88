"""Security of the installed operator, checked against the real API server.

(a) Least privilege: the chart's ServiceAccount may do what the operator needs and nothing that
    would make a compromised operator a cluster takeover (secrets, workloads, namespaces; RBAC
    only within what it holds itself).
(b) Pod Security: in a namespace enforcing the "restricted" profile the operator's pods are
    admitted as built (its security defaults satisfy the profile), a privileged template is refused
    at pod creation and the operator keeps serving.
(c) The operator's logs carry no credentials.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from accelerate_trainer.contract import JOB_NAME_LABEL

from devtools.cluster import (
    create_namespace,
    delete_namespace,
    kubectl,
    kubectl_json,
    wait_for,
)
from devtools.images import PYTHON_IMAGE
from tests.helpers.jobs import JobBuilder
from tests.helpers.operator import running_operator_pods

pytestmark = pytest.mark.cluster

OPERATOR_NAMESPACE = "accelerate-system"
OPERATOR_DEPLOYMENT = "accelerate-operator"
SERVICE_ACCOUNT = f"system:serviceaccount:{OPERATOR_NAMESPACE}:accelerate-operator"
SLEEP = ["python3", "-c", "import time; time.sleep(20)"]


def read(*args: str, kubeconfig: str) -> dict[str, Any]:
    """A read through kubectl that rides out a short API server restart (the local cluster is
    shared and may be restarted under us)."""
    return wait_for(lambda: [kubectl_json(*args, kubeconfig=kubeconfig)], timeout=60,
                    description=f"kubectl {' '.join(args)}")[0]
JOBS = "acceleratejobs.accelerate-operator.io"


# --- (a) least privilege ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rbac_ns(kubeconfig: str) -> Iterator[str]:
    name = create_namespace(kubeconfig, prefix="rbac")
    yield name
    delete_namespace(kubeconfig, name)


def can_i(kubeconfig: str, namespace: str | None, verb: str, resource: str,
          *extra: str) -> bool:
    """`kubectl auth can-i` as the operator. A subresource goes in --subresource: `pods/exec`
    would mean the pod NAMED exec."""
    scope = ["-n", namespace] if namespace else ["--all-namespaces"]
    proc = kubectl("auth", "can-i", verb, resource, f"--as={SERVICE_ACCOUNT}", *scope, *extra,
                   kubeconfig=kubeconfig, check=False)
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), f"kubectl auth can-i said {proc.stdout!r} {proc.stderr!r}"
    return answer == "yes"


ALLOWED = [
    pytest.param("create", "pods", (), id="create-pods"),
    pytest.param("delete", "pods", (), id="delete-pods"),
    pytest.param("watch", "pods", (), id="watch-pods"),
    pytest.param("list", JOBS, (), id="list-acceleratejobs"),
    pytest.param("watch", JOBS, (), id="watch-acceleratejobs"),
    pytest.param("patch", JOBS, ("--subresource=status",), id="patch-acceleratejobs-status"),
    pytest.param("create", "events", (), id="create-events"),
    # The Warning events of a pod long in ContainerCreating (why it cannot mount a volume).
    pytest.param("list", "events", (), id="list-events"),
    pytest.param("create", "configmaps", (), id="create-configmaps"),
    pytest.param("create", "services", (), id="create-services"),
    # The run-attempt annotation (restart in place), and the report CA bundle in a job's
    # ConfigMap when the operator renews its CA.
    pytest.param("patch", "pods", (), id="patch-pods"),
    pytest.param("patch", "configmaps", (), id="patch-configmaps"),
]

DENIED = [
    pytest.param("get", "secrets", (), id="get-secrets"),
    pytest.param("list", "secrets", (), id="list-secrets"),
    pytest.param("watch", "secrets", (), id="watch-secrets"),
    pytest.param("create", "deployments.apps", (), id="create-deployments"),
    pytest.param("create", "daemonsets.apps", (), id="create-daemonsets"),
    pytest.param("escalate", "roles.rbac.authorization.k8s.io", (), id="escalate-roles"),
    pytest.param("bind", "roles.rbac.authorization.k8s.io", (), id="bind-roles"),
    pytest.param("impersonate", "serviceaccounts", (), id="impersonate-serviceaccounts"),
    pytest.param("create", "serviceaccounts", ("--subresource=token",),
                 id="create-serviceaccount-tokens"),
    pytest.param("create", "pods", ("--subresource=exec",), id="exec-into-pods"),
    pytest.param("create", "pods", ("--subresource=portforward",), id="port-forward-to-pods"),
    pytest.param("update", "pods", (), id="update-pods"),
    # kopf writes nothing to a job, and the operator only its status.
    pytest.param("patch", JOBS, (), id="patch-acceleratejobs"),
    pytest.param("update", JOBS, (), id="update-acceleratejobs"),
    # No RBAC object per job: reports go to the operator's endpoint (issue 47).
    pytest.param("create", "roles.rbac.authorization.k8s.io", (), id="create-roles"),
    pytest.param("create", "rolebindings.rbac.authorization.k8s.io", (), id="create-rolebindings"),
    pytest.param("*", "*", (), id="everything"),
]

CLUSTER_DENIED = [
    pytest.param("delete", "namespaces", id="delete-namespaces"),
    pytest.param("create", "namespaces", id="create-namespaces"),
    pytest.param("create", "clusterroles.rbac.authorization.k8s.io", id="create-clusterroles"),
    pytest.param("create", "clusterrolebindings.rbac.authorization.k8s.io",
                 id="create-clusterrolebindings"),
    pytest.param("escalate", "clusterroles.rbac.authorization.k8s.io", id="escalate-clusterroles"),
    pytest.param("bind", "clusterroles.rbac.authorization.k8s.io", id="bind-clusterroles"),
    pytest.param("impersonate", "users", id="impersonate-users"),
    pytest.param("update", "customresourcedefinitions.apiextensions.k8s.io", id="update-crds"),
    pytest.param("delete", "customresourcedefinitions.apiextensions.k8s.io", id="delete-crds"),
    pytest.param("create", "mutatingwebhookconfigurations.admissionregistration.k8s.io",
                 id="create-mutating-webhooks"),
    pytest.param("create", "certificatesigningrequests.certificates.k8s.io", id="create-csrs"),
    pytest.param("list", "nodes", id="list-nodes"),
    pytest.param("watch", "nodes", id="watch-nodes"),
    pytest.param("patch", "nodes", id="patch-nodes"),
    # The report endpoint checks the pods' tokens itself (the API server's published keys).
    pytest.param("create", "tokenreviews.authentication.k8s.io", id="create-tokenreviews"),
]


@pytest.mark.parametrize(("verb", "resource", "extra"), ALLOWED)
def test_operator_service_account_can_do_its_job(kubeconfig: str, rbac_ns: str, verb: str,
                                                 resource: str, extra: tuple[str, ...]):
    assert can_i(kubeconfig, rbac_ns, verb, resource, *extra), \
        f"{SERVICE_ACCOUNT} cannot {verb} {resource} {' '.join(extra)} in {rbac_ns}"


@pytest.mark.parametrize(("verb", "resource", "extra"), DENIED)
def test_operator_service_account_cannot_do_more_in_a_namespace(
        kubeconfig: str, rbac_ns: str, verb: str, resource: str, extra: tuple[str, ...]):
    assert not can_i(kubeconfig, rbac_ns, verb, resource, *extra), \
        f"{SERVICE_ACCOUNT} can {verb} {resource} in {rbac_ns}: more than it needs"


def test_operator_service_account_reads_nodes_by_name_only(kubeconfig: str):
    """Is the node of a running, not Ready pod lost (spec.runPolicy.nodeLostTimeoutSeconds)?"""
    assert can_i(kubeconfig, None, "get", "nodes")


@pytest.mark.parametrize(("verb", "resource"), CLUSTER_DENIED)
def test_operator_service_account_cannot_do_more_cluster_wide(kubeconfig: str, verb: str,
                                                              resource: str):
    assert not can_i(kubeconfig, None, verb, resource), \
        f"{SERVICE_ACCOUNT} can {verb} {resource} cluster-wide: more than it needs"


def test_the_operator_cannot_grant_anything(kubeconfig: str, rbac_ns: str):
    """It creates no Role or RoleBinding (a job owns none): RBAC refuses both, the admin role
    or a Role reading Secrets alike."""
    as_operator = (f"--as={SERVICE_ACCOUNT}", "-n", rbac_ns, "--dry-run=server")
    admin = kubectl("create", "rolebinding", "takeover", "--clusterrole=admin",
                    f"--serviceaccount={rbac_ns}:default", *as_operator, kubeconfig=kubeconfig,
                    check=False)
    assert admin.returncode != 0 and "forbidden" in admin.stderr, admin.stdout + admin.stderr
    secrets = kubectl("create", "role", "read-secrets", "--verb=get", "--resource=secrets",
                      *as_operator, kubeconfig=kubeconfig, check=False)
    assert secrets.returncode != 0 and "forbidden" in secrets.stderr, secrets.stderr


def test_the_only_secret_the_operator_may_read_is_its_report_tls_in_its_namespace(
        kubeconfig: str):
    """The report endpoint's CA and certificate, which the operator creates if absent; and the
    service-account issuer's public keys, with which it checks the pods' tokens."""
    own = f"secrets/{OPERATOR_DEPLOYMENT}-report-tls"
    assert can_i(kubeconfig, OPERATOR_NAMESPACE, "get", own)
    assert can_i(kubeconfig, OPERATOR_NAMESPACE, "update", own)
    assert not can_i(kubeconfig, OPERATOR_NAMESPACE, "get", "secrets/another")
    assert not can_i(kubeconfig, OPERATOR_NAMESPACE, "list", "secrets")
    assert can_i(kubeconfig, None, "get", "/openid/v1/jwks")


def test_operator_service_account_has_no_wildcard_and_no_secret_rule(kubeconfig: str,
                                                                     rbac_ns: str):
    """Everything the SA may do in a namespace, as the API server resolves it: no '*' verb or
    resource, nothing on secrets."""
    proc = kubectl("auth", "can-i", "--list", f"--as={SERVICE_ACCOUNT}", "-n", rbac_ns,
                   kubeconfig=kubeconfig)
    resource_rows = [line.split() for line in proc.stdout.splitlines()[1:]
                     if line and not line[0].isspace()]
    assert resource_rows, proc.stdout
    resources = {row[0] for row in resource_rows}
    assert "pods" in resources and f"{JOBS}/status" in resources, proc.stdout
    for row in resource_rows:
        resource, verbs = row[0], " ".join(row[1:])
        assert not resource.startswith("*") and "secrets" not in resource, row
        assert "*" not in verbs.rsplit("[", 1)[-1], f"wildcard verb on {resource}: {row}"


# --- (b) Pod Security "restricted" --------------------------------------------------------------

def cheap_job(name: str, nodes: int = 2, container_security: dict | None = None) -> dict[str, Any]:
    builder = (JobBuilder(name).for_server().nodes(nodes).procs(1)
               .config(distributed_type="MULTI_CPU", use_cpu=True)
               .container(image=PYTHON_IMAGE, command=SLEEP, args=[]).grace(1))
    if container_security is not None:
        builder.container(securityContext=container_security)
    return builder.build()


def create_job(kubeconfig: str, namespace: str, body: dict[str, Any]) -> None:
    kubectl("-n", namespace, "create", "-f", "-", kubeconfig=kubeconfig, input=json.dumps(body))


def pods_of(kubeconfig: str, namespace: str, job: str) -> list[dict[str, Any]]:
    return read("-n", namespace, "get", "pods", "-l", f"{JOB_NAME_LABEL}={job}",
                        kubeconfig=kubeconfig)["items"]


def job_body(kubeconfig: str, namespace: str, job: str) -> dict[str, Any]:
    return read("-n", namespace, "get", "acceleratejob", job, kubeconfig=kubeconfig)


def job_events(kubeconfig: str, namespace: str, job: str) -> list[dict[str, Any]]:
    return read("-n", namespace, "get", "events", "--field-selector",
                        f"involvedObject.name={job},involvedObject.kind=AccelerateJob",
                        kubeconfig=kubeconfig)["items"]


@pytest.fixture
def restricted_ns(kubeconfig: str, namespace: str) -> str:
    kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted",
            "pod-security.kubernetes.io/enforce-version=latest", kubeconfig=kubeconfig)
    return namespace


def assert_operator_available(kubeconfig: str) -> None:
    deployment = read("-n", OPERATOR_NAMESPACE, "get", "deployment", OPERATOR_DEPLOYMENT,
                              kubeconfig=kubeconfig)
    conditions = {c["type"]: c["status"] for c in deployment["status"].get("conditions", [])}
    assert conditions.get("Available") == "True", deployment["status"]
    assert deployment["status"].get("availableReplicas", 0) >= 1, deployment["status"]


def wait_running_pods(kubeconfig: str, namespace: str, job: str, count: int) -> list[dict]:
    def running() -> list[dict] | None:
        pods = pods_of(kubeconfig, namespace, job)
        ok = len(pods) == count and all(p["status"].get("phase") == "Running" for p in pods)
        return pods if ok else None
    return wait_for(running, timeout=90, description=f"{count} running pods of job {job}")


def test_restricted_namespace_admits_the_operators_pods(kubeconfig: str, restricted_ns: str):
    create_job(kubeconfig, restricted_ns, cheap_job("secure"))

    pods = wait_running_pods(kubeconfig, restricted_ns, "secure", 2)
    for pod in pods:  # the defaults the operator adds, which make the pod "restricted"
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, spec["securityContext"]
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        security = spec["containers"][0]["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, security
        assert security["capabilities"]["drop"] == ["ALL"], security
    wait_for(lambda: (job_body(kubeconfig, restricted_ns, "secure").get("status") or {})
             .get("phase") == "Running", timeout=60, description="the job to be Running")


# The API server's own words for a privileged container with allowPrivilegeEscalation false.
PRIVILEGED_INVALID = "`privileged` to true"


def refusal_evidence(kubeconfig: str, namespace: str, job: str, text: str) -> str | None:
    """Where the API server's refusal of the pod shows: the job's status or events once the
    operator reports it."""
    body = job_body(kubeconfig, namespace, job)
    places = {
        "status": json.dumps(body.get("status") or {}),
        "events": json.dumps([e.get("message") for e in job_events(kubeconfig, namespace, job)]),
    }
    for where, blob in places.items():
        if text in blob:
            return where
    return None


@pytest.mark.parametrize("security", [
    pytest.param({"privileged": True, "allowPrivilegeEscalation": True}, id="privileged"),
    pytest.param({"privileged": True}, id="privileged-only"),
])
def test_privileged_template_is_refused_and_the_operator_keeps_serving(
        kubeconfig: str, restricted_ns: str, security: dict):
    create_job(kubeconfig, restricted_ns, cheap_job("root", container_security=security))

    # The operator tried and the API server refused it (PodSecurity).
    expected = (["violates PodSecurity"] if "allowPrivilegeEscalation" in security
                else ["violates PodSecurity", PRIVILEGED_INVALID])
    wait_for(lambda: any(refusal_evidence(kubeconfig, restricted_ns, "root", text)
                         for text in expected), timeout=60,
             description=f"the refusal of the pod ({expected}) to show on the job")
    time.sleep(3)
    assert pods_of(kubeconfig, restricted_ns, "root") == []
    assert_operator_available(kubeconfig)

    # Still serving: a valid job in the same namespace runs.
    create_job(kubeconfig, restricted_ns, cheap_job("after", nodes=1))
    wait_running_pods(kubeconfig, restricted_ns, "after", 1)
    assert pods_of(kubeconfig, restricted_ns, "root") == []


def test_pod_creation_refusal_is_reported_on_the_job(kubeconfig: str, restricted_ns: str):
    create_job(kubeconfig, restricted_ns, cheap_job(
        "root", container_security={"privileged": True, "allowPrivilegeEscalation": True}))
    wait_for(lambda: refusal_evidence(kubeconfig, restricted_ns, "root", "violates PodSecurity")
             in ("status", "events"), timeout=20,
             description="the PodSecurity refusal in the job's status or events")


def test_privileged_template_gets_pods_where_privileged_pods_are_allowed(kubeconfig: str,
                                                                         namespace: str):
    create_job(kubeconfig, namespace, cheap_job("root", nodes=1,
                                                container_security={"privileged": True}))
    wait_for(lambda: pods_of(kubeconfig, namespace, "root"), timeout=20,
             description="the privileged job's pod")


# --- (c) no credentials in the operator's logs --------------------------------------------------

SECRET_PATTERNS = {
    "a JWT (service-account token)": re.compile(r"eyJ[A-Za-z0-9_-]{10,}"),
    "a PEM certificate": re.compile(r"BEGIN CERTIFICATE"),
    "a PEM private key": re.compile(r"BEGIN [A-Z ]*PRIVATE KEY"),
    "a bearer token": re.compile(r"(?i)bearer\s+[A-Za-z0-9._-]{8,}"),
    "an Authorization header": re.compile(r"(?i)['\"]?authorization['\"]?\s*[:=]"),
    "kubeconfig key data": re.compile(r"client-(key|certificate)-data"),
}


def test_operator_logs_carry_no_credentials(kubeconfig: str, restricted_ns: str):
    # Give the operator something to log, errors included (a refused pod logs the API response).
    create_job(kubeconfig, restricted_ns, cheap_job("quiet", nodes=1))
    create_job(kubeconfig, restricted_ns, cheap_job(
        "loud", nodes=1, container_security={"privileged": True, "allowPrivilegeEscalation": True}))
    wait_running_pods(kubeconfig, restricted_ns, "quiet", 1)
    wait_for(lambda: refusal_evidence(kubeconfig, restricted_ns, "loud", "violates PodSecurity"),
             timeout=60, description="the operator's attempt at the refused pod")

    def operator_logs() -> str | None:
        # Every replica's log (the chart runs two: the active one and a standby).
        text = "".join(kubectl("-n", OPERATOR_NAMESPACE, "logs", pod, "--all-containers",
                               "--tail=-1", kubeconfig=kubeconfig).stdout
                       for pod in running_operator_pods(kubeconfig))
        # The operator logs the refusal with the API server's answer, which names the pod.
        return text if "loud-0" in text else None
    logs = wait_for(operator_logs, timeout=90,
                    description="the operator's log of the refused pod loud-0")
    for what, pattern in SECRET_PATTERNS.items():
        match = pattern.search(logs)
        assert match is None, (f"the operator's log holds {what}: "
                               f"...{logs[max(0, match.start() - 80):match.end() + 20]}...")
