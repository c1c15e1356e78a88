"""The Helm chart, checked with the real `helm` binary: lint, schema, and the rendered objects.

These tests render templates only; they never talk to a cluster. `helm` comes from
hack/install-tools.sh (installed on first use, so the tests never skip for a missing binary).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import yaml
from accelerate_operator.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "accelerate-operator"
CRD_SOURCE = ROOT / "crds" / "accelerate-operator.io_acceleratejobs.yaml"
RELEASE = "accelerate-operator"
NAMESPACE = "accelerate-system"

# What the operator may do, and nothing more (no Secrets but its own TLS Secret in its own
# namespace, nothing cluster-wide of its own but the service-account issuer's public keys).
READ = {"get", "list", "watch"}
NAMESPACED_RULES = {
    # kopf writes nothing to a job; the operator deletes finished ones (TTL)
    ("accelerate-operator.io", "acceleratejobs"): READ | {"delete"},
    ("accelerate-operator.io", "acceleratejobs/status"): {"patch"},  # one merge patch a pass
    # blockOwnerDeletion on the children (OwnerReferencesPermissionEnforcement)
    ("accelerate-operator.io", "acceleratejobs/finalizers"): {"update"},
    # patch: the run-attempt annotation (restart in place); no Role or RoleBinding per job
    ("", "pods"): {"get", "list", "watch", "create", "delete", "patch"},
    ("", "pods/log"): {"get"},  # the trainer's versions and the logs archived before a restart
    ("", "services"): {"get", "list", "watch", "create"},
    ("", "configmaps"): {"get", "list", "watch", "create", "patch"},  # + the CA bundle
    ("", "events"): {"create", "list"},  # list: why a pod is long in ContainerCreating
    # spec.runPolicy.podDisruptionBudget: one budget per job, owned by it
    ("policy", "poddisruptionbudgets"): {"get", "list", "watch", "create"},
    ("kopf.dev", "kopfpeerings"): READ | {"create", "patch"},  # kopf's peering per namespace
}
# Nodes by name (is a pod's node lost?); with kueue.enabled, Kueue's flavors and priority classes.
# The report endpoint reads the API server's service-account keys (OIDC discovery) to check the
# pods' tokens itself: no TokenReview.
CLUSTER_ONLY_RULES = {("", "nodes"): {"get"},
                      ("", "/.well-known/openid-configuration"): {"get"},
                      ("", "/openid/v1/jwks"): {"get"}}
REPORT_TLS_ROLE = f"{RELEASE}-report-endpoint"
# An operator of every namespace peers through one ClusterKopfPeering.
CLUSTER_WIDE_PEERING = {("kopf.dev", "clusterkopfpeerings"): READ | {"create", "patch"}}


def _helm_ok(path: str | None) -> bool:
    if not path or not os.access(path, os.X_OK):
        return False
    return subprocess.run([path, "version", "--short"], capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def helm() -> str:
    """The pinned helm: $HELM, else the tools cache, installed there by install-tools.sh if missing.

    A helm found on PATH is not used: CI runners ship their own, of another major version.
    """
    default_cache = Path.home() / ".cache/accelerate-operator"
    cache = Path(os.environ.get("ACCELERATE_OPERATOR_CACHE", default_cache))
    for candidate in (os.environ.get("HELM"), str(cache / "tools/bin/helm")):
        if _helm_ok(candidate):
            return candidate
    done = subprocess.run(
        ["bash", str(ROOT / "hack/install-tools.sh")],
        env={**os.environ, "INSTALL_TOOLS": "helm"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"hack/install-tools.sh failed:\n{done.stderr}"
    path = str(Path(done.stdout.strip().splitlines()[-1]) / "helm")
    assert _helm_ok(path), f"hack/install-tools.sh did not leave a working helm at {path}"
    return path


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


@functools.cache
def _render(helm: str, sets: tuple[str, ...]) -> tuple[dict, ...]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for s in sets:
        args += ["--set", s]
    done = run_helm(helm, *args)
    assert done.returncode == 0, f"helm template {' '.join(sets)} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def render(helm: str, *sets: str) -> list[dict]:
    return list(_render(helm, sets))


def only(docs: list[dict], kind: str) -> dict:
    """The one object of a kind; for CRDs, the AccelerateJob one (kopf's peering CRDs beside
    it are verbatim copies of crds/ too, checked by the drift test)."""
    found = [d for d in docs if d["kind"] == kind and (
        kind != "CustomResourceDefinition" or d["spec"]["group"] == "accelerate-operator.io")]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def rules_of(role: dict) -> dict[tuple[str, str], set[str]]:
    """Flatten RBAC rules to {(apiGroup, resource): verbs}, merging rules that repeat a pair."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role.get("rules", []):
        assert not rule.get("resourceNames"), "rules are per resource, not per object name"
        for url in rule.get("nonResourceURLs", []):
            out.setdefault(("", url), set()).update(rule["verbs"])
        for group in rule.get("apiGroups", []):
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def service_named(docs: list[dict], name: str) -> dict:
    found = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one Service {name}, got {len(found)}"
    return found[0]


def selected_by(monitor: dict, service: dict) -> bool:
    wanted = monitor["spec"]["selector"]["matchLabels"].items()
    return wanted <= service["metadata"]["labels"].items()


def operator_container(docs: list[dict]) -> dict:
    return only(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_chart_passes_helm_lint_strict(helm):
    for sets in ([], ["watchNamespaces={team-a,team-b}", "crds.enabled=false"]):
        args = ["lint", "--strict", str(CHART)]
        for s in sets:
            args += ["--set", s]
        done = run_helm(helm, *args)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"helm lint --strict {sets} failed:\n{output}"


def test_default_render_has_exactly_the_expected_kinds(helm):
    kinds = Counter(d["kind"] for d in render(helm))
    assert kinds == Counter(
        {
            "CustomResourceDefinition": 3,  # AccelerateJob, and kopf's two peering kinds
            "ServiceAccount": 1,
            "ClusterRole": 1,
            "ClusterRoleBinding": 1,
            "Deployment": 1,
            "Service": 2,  # the metrics Service, the report endpoint's
            "Role": 1,  # the report endpoint's TLS Secret, in the release namespace
            "RoleBinding": 1,
            "PriorityClass": 1,  # elastic jobs' placeholder pods
        }
    )


def test_every_object_carries_the_standard_labels(helm):
    for doc in render(helm):
        if doc["kind"] == "CustomResourceDefinition":
            continue  # verbatim from crds/, checked against the source below
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "accelerate-operator", doc["kind"]
        assert labels["app.kubernetes.io/instance"] == RELEASE, doc["kind"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm", doc["kind"]


def test_deployment_runs_two_peered_replicas_rolled_with_no_gap(helm):
    deployment = only(render(helm), "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    assert deployment["metadata"]["namespace"] == NAMESPACE
    assert only(render(helm, "replicaCount=1"), "Deployment")["spec"]["replicas"] == 1


def test_the_peering_lifetime_is_a_value_the_operator_is_started_with(helm):
    container = operator_container(render(helm, "peering.lifetimeSeconds=20"))
    assert container["args"][-2:] == ["--peering-lifetime", "20"]
    for bad in ("peering.lifetimeSeconds=19", "peering.lifetimeSeconds=abc"):
        done = run_helm(helm, "template", RELEASE, str(CHART), "--set", bad)
        assert done.returncode != 0, f"--set {bad} was accepted"


def test_deployment_sets_the_command_explicitly_with_liveness_probe(helm):
    container = operator_container(render(helm))
    assert container["command"] == ["accelerate-operator"]
    assert container["args"] == ["--liveness-port", "8080", "--peering", "accelerate-operator",
                                 "--peering-lifetime", "60"]
    assert container["image"] == "ghcr.io/accelerate-operator/operator:0.1.0"
    assert {"name": "ACCELERATE_OPERATOR_LOG_LEVEL", "value": "info"} in container["env"]
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    assert probe["port"] in (8080, "health")
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in container["ports"]


def test_deployment_security_context_is_restricted_with_writable_tmp(helm):
    docs = render(helm)
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    container = operator_container(docs)
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    tmp = next(v for v in pod["volumes"] if v["name"] == "tmp")
    assert "emptyDir" in tmp
    assert pod["serviceAccountName"] == only(docs, "ServiceAccount")["metadata"]["name"]


def test_values_reach_the_deployment(helm):
    docs = render(
        helm,
        "image.tag=dev",
        "logLevel=debug",
        "priorityClassName=system-cluster-critical",
        "podLabels.team=ml",
        "extraEnv[0].name=HTTPS_PROXY",
        "extraEnv[0].value=http://proxy:3128",
    )
    pod = only(docs, "Deployment")["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["image"].endswith(":dev")
    assert {"name": "ACCELERATE_OPERATOR_LOG_LEVEL", "value": "debug"} in container["env"]
    assert {"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in container["env"]
    assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
    assert pod["metadata"]["labels"]["team"] == "ml"


@pytest.mark.parametrize(
    "mistyped, key",
    [
        ("imagee.tag=x", "imagee"),
        ("image.tagg=x", "tagg"),
        ("securityContext.runAsNonroot=true", "runAsNonroot"),
        ("crds.keeep=false", "keeep"),
        ("replicaCountt=2", "replicaCountt"),
    ],
)
def test_mistyped_value_key_fails_schema_validation_naming_the_key(helm, mistyped, key):
    done = run_helm(helm, "template", RELEASE, str(CHART), "--set", mistyped)
    assert done.returncode != 0, f"--set {mistyped} was accepted"
    assert key in done.stderr
    assert "not allowed" in done.stderr


def test_invalid_value_types_fail_schema_validation(helm):
    for bad in ("logLevel=loud", "watchNamespaces={Team_A}", "image.pullPolicy=Sometimes"):
        done = run_helm(helm, "template", RELEASE, str(CHART), "--set", bad)
        assert done.returncode != 0, f"--set {bad} was accepted"


def test_watch_namespaces_get_a_role_each_and_no_cluster_wide_pod_access(helm):
    docs = render(helm, "watchNamespaces={team-a,team-b}")
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role"
             and d["metadata"]["name"] != REPORT_TLS_ROLE}
    bindings = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "RoleBinding"
                and d["metadata"]["name"] != REPORT_TLS_ROLE}
    assert set(roles) == set(bindings) == {"team-a", "team-b"}
    for ns in ("team-a", "team-b"):
        assert rules_of(roles[ns]) == NAMESPACED_RULES
        subject = bindings[ns]["subjects"][0]
        assert (subject["kind"], subject["namespace"]) == ("ServiceAccount", NAMESPACE)
        assert bindings[ns]["roleRef"]["name"] == roles[ns]["metadata"]["name"]
    # Cluster-wide, only the Nodes, read by name: nothing of any namespace.
    assert rules_of(only(docs, "ClusterRole")) == CLUSTER_ONLY_RULES
    assert only(docs, "ClusterRoleBinding")["roleRef"]["kind"] == "ClusterRole"
    container = operator_container(docs)
    assert container["args"] == ("--liveness-port 8080 --peering accelerate-operator "
                                 "--peering-lifetime 60 --namespace team-a --namespace team-b"
                                 ).split()


def test_cluster_role_grants_exactly_the_operator_verbs_and_no_secrets(helm):
    docs = render(helm)
    role = only(docs, "ClusterRole")
    rules = rules_of(role)
    assert not any(resource == "secrets" or resource == "*" for _, resource in rules)
    assert not any("*" in verbs for verbs in rules.values())
    assert rules == {**NAMESPACED_RULES, **CLUSTER_ONLY_RULES, **CLUSTER_WIDE_PEERING}
    binding = only(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    sa = only(docs, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
    ]


def test_the_only_secret_the_operator_may_touch_is_its_own_tls_secret(helm):
    for sets in ((), ("watchNamespaces={team-a}",)):
        for doc in render(helm, *sets):
            if doc["kind"] in ("Role", "ClusterRole") and doc["metadata"]["name"] != \
                    REPORT_TLS_ROLE:
                assert "secrets" not in yaml.safe_dump(doc["rules"]), doc["kind"]
        role = next(d for d in render(helm, *sets) if d["metadata"]["name"] == REPORT_TLS_ROLE
                    and d["kind"] == "Role")
        assert role["metadata"]["namespace"] == NAMESPACE
        assert role["rules"] == [
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "update"],
             "resourceNames": [f"{RELEASE}-report-tls"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]


def test_the_report_endpoint_has_a_service_and_the_operator_knows_its_url(helm):
    docs = render(helm)
    service = service_named(docs, RELEASE)
    assert service["spec"]["ports"] == [{"name": "reports", "port": 8443,
                                         "targetPort": "reports", "protocol": "TCP"}]
    # the active replica alone: the label it puts on its own pod (report_presence.py)
    pod_labels = only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == {
        **{k: pod_labels[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance")},
        "accelerate-operator.io/report-endpoint": "true"}
    container = operator_container(docs)
    assert {"name": "reports", "containerPort": 8443, "protocol": "TCP"} in container["ports"]
    env = {e["name"]: e for e in container["env"]}
    assert env["ACCELERATE_OPERATOR_REPORT_URL"]["value"] == (
        f"https://{RELEASE}.{NAMESPACE}.svc:8443")
    assert env["ACCELERATE_OPERATOR_REPORT_SECRET"]["value"] == f"{RELEASE}-report-tls"
    assert env["ACCELERATE_OPERATOR_POD_NAMESPACE"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["ACCELERATE_OPERATOR_POD_NAME"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.name"}}
    assert env["ACCELERATE_OPERATOR_PROGRESS_WRITE_SECONDS"]["value"] == "12"
    moved = operator_container(render(helm, "reports.port=9443",
                                      "reports.progressWriteSeconds=2"))
    moved_env = {e["name"]: e.get("value") for e in moved["env"]}
    assert moved_env["ACCELERATE_OPERATOR_REPORT_URL"].endswith(".svc:9443")
    assert moved_env["ACCELERATE_OPERATOR_PROGRESS_WRITE_SECONDS"] == "2"
    assert not [d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")]
    for bad in ("reports.port=8080", "reports.port=0", "reports.prot=1",
                "reports.progressWriteSeconds=0"):
        done = run_helm(helm, "template", RELEASE, str(CHART), "--set", bad)
        assert done.returncode != 0, f"--set {bad} was accepted"


def test_crds_disabled_renders_no_crd(helm):
    kinds = [d["kind"] for d in render(helm, "crds.enabled=false")]
    assert "CustomResourceDefinition" not in kinds
    assert "Deployment" in kinds


def test_crd_is_kept_on_uninstall_unless_told_otherwise(helm):
    crd = only(render(helm), "CustomResourceDefinition")
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    crd = only(render(helm, "crds.keep=false"), "CustomResourceDefinition")
    assert "annotations" not in crd["metadata"]


def test_chart_crd_is_generated_from_crds_source(helm):
    done = subprocess.run(
        ["bash", str(ROOT / "hack/sync-chart-crd.sh"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    # And what Helm renders is the source object itself, plus only the keep annotation.
    rendered = only(render(helm, "crds.keep=false"), "CustomResourceDefinition")
    assert rendered == yaml.safe_load(CRD_SOURCE.read_text())


def test_sync_check_reports_drift(tmp_path):
    # A copy of the two inputs the script reads, with the chart's CRD edited by hand.
    (tmp_path / "hack").mkdir()
    shutil.copy(ROOT / "hack/sync-chart-crd.sh", tmp_path / "hack")
    shutil.copytree(ROOT / "crds", tmp_path / "crds")
    chart_crds = tmp_path / "charts/accelerate-operator/templates/crds"
    shutil.copytree(CHART / "templates/crds", chart_crds)
    copy = chart_crds / CRD_SOURCE.name
    copy.write_text(copy.read_text().replace("shortNames: [ajob, ajobs]", "shortNames: [ajob]"))
    script = str(tmp_path / "hack/sync-chart-crd.sh")
    done = subprocess.run(["bash", script, "--check"], capture_output=True, text=True)
    assert done.returncode == 1
    assert "drifted" in done.stderr
    # The unified diff shows the hand-edited line.
    assert re.search(r"^-\s+shortNames: \[ajob\]$", done.stderr, re.MULTILINE), done.stderr
    subprocess.run(["bash", script], check=True, capture_output=True)
    assert subprocess.run(["bash", script, "--check"], capture_output=True).returncode == 0


def notes(helm: str, *sets: str) -> str:
    args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client"]
    done = run_helm(helm, *args, *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr
    return done.stdout.partition("\nNOTES:\n")[2]


def test_notes_tell_the_user_what_to_do_next(helm):
    text = notes(helm)
    assert "kubectl get ajob -w" in text
    assert "kubectl apply -f examples/cpu-ddp.yaml" in text
    assert (ROOT / "examples/cpu-ddp.yaml").is_file(), "NOTES.txt names an example that is gone"
    assert "crds/" not in text


def test_notes_send_the_example_where_the_operator_watches(helm):
    text = notes(helm, "watchNamespaces={team-a,team-b}")
    assert "kubectl apply -n team-a -f examples/cpu-ddp.yaml" in text
    assert "kubectl get ajob -n team-a -w" in text


def test_without_the_charts_crds_the_notes_ask_for_all_three(helm):
    """kopf's peering CRDs go with crds.enabled too, and the operator (--peering) handles no
    job without them: the notes must not ask for the AccelerateJob CRD alone."""
    assert not [d for d in render(helm, "crds.enabled=false")
                if d["kind"] == "CustomResourceDefinition"]
    assert "kubectl apply --server-side -f crds/\n" in notes(helm, "crds.enabled=false")
    names = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    assert names == sorted(p.name for p in (CHART / "templates/crds").glob("*.yaml"))


KUEUE_NAMESPACED_RULES = {
    ("kueue.x-k8s.io", "workloads"): {"list", "watch", "create", "patch"},
    ("kueue.x-k8s.io", "workloads/status"): {"patch"},
}
KUEUE_CLUSTER_RULES = {
    ("kueue.x-k8s.io", "resourceflavors"): {"get"},
    ("kueue.x-k8s.io", "workloadpriorityclasses"): {"get"},
}


def test_kueue_enabled_grants_exactly_the_workload_verbs_and_turns_the_integration_on(helm):
    docs = render(helm, "kueue.enabled=true")
    assert rules_of(only(docs, "ClusterRole")) == {
        **NAMESPACED_RULES, **CLUSTER_ONLY_RULES, **KUEUE_NAMESPACED_RULES,
        **KUEUE_CLUSTER_RULES, **CLUSTER_WIDE_PEERING}
    env = {e["name"]: e.get("value") for e in operator_container(docs)["env"]}
    assert env["ACCELERATE_OPERATOR_KUEUE"] == "true"
    namespaced = render(helm, "kueue.enabled=true", "watchNamespaces={team-a}")
    watched = [d for d in namespaced if d["kind"] == "Role"
               and d["metadata"]["name"] != REPORT_TLS_ROLE]
    assert len(watched) == 1
    assert rules_of(watched[0]) == {**NAMESPACED_RULES, **KUEUE_NAMESPACED_RULES}
    assert rules_of(only(namespaced, "ClusterRole")) == {**CLUSTER_ONLY_RULES,
                                                          **KUEUE_CLUSTER_RULES}


def test_kueue_disabled_by_default_grants_nothing_of_kueue(helm):
    docs = render(helm)
    assert not any(group == "kueue.x-k8s.io" for d in docs if d["kind"] == "ClusterRole"
                   for group, _ in rules_of(d))
    assert "ACCELERATE_OPERATOR_KUEUE" not in {e["name"] for e in operator_container(docs)["env"]}


# ---- metrics: the port, its Service, the optional ServiceMonitor and Grafana dashboard --------


def test_metrics_are_served_on_their_own_port_behind_a_service_by_default(helm):
    docs = render(helm)
    container = operator_container(docs)
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    assert {"name": "ACCELERATE_OPERATOR_METRICS_PORT", "value": "9090"} in container["env"]
    service = service_named(docs, f"{RELEASE}-metrics")
    pod_labels = only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["metadata"]["name"] == f"{RELEASE}-metrics"
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9090,
                                         "targetPort": "metrics", "protocol": "TCP"}]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert not [d for d in docs if d["kind"] in ("ServiceMonitor", "ConfigMap")]


def test_metrics_port_is_configurable_and_can_be_switched_off(helm):
    container = operator_container(render(helm, "metrics.port=9200"))
    assert {"name": "ACCELERATE_OPERATOR_METRICS_PORT", "value": "9200"} in container["env"]
    off = render(helm, "metrics.enabled=false")
    assert [d["metadata"]["name"] for d in off if d["kind"] == "Service"] == [RELEASE]
    assert [p["name"] for p in operator_container(off)["ports"]] == ["health", "reports"]
    assert not [e for e in operator_container(off)["env"] if "METRICS" in e["name"]]
    for bad in ("metrics.port=8080", "metrics.port=0", "metrics.serviceMonitor.interval=often",
                "metrics.dashbord.enabled=true"):
        done = run_helm(helm, "template", RELEASE, str(CHART), "--set", bad)
        assert done.returncode != 0, f"--set {bad} was accepted"


def test_a_long_release_name_still_gives_valid_distinct_service_names(helm):
    release = "gpu-training-platform-operator-prod1"  # 36 characters; helm allows 53
    args = ["template", release, str(CHART), "--namespace", NAMESPACE]
    done = run_helm(helm, *args)
    assert done.returncode == 0, done.stderr
    names = [d["metadata"]["name"] for d in yaml.safe_load_all(done.stdout)
             if d and d["kind"] == "Service"]
    assert len(names) == len(set(names)) == 2
    assert all(len(name) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
               for name in names), names


def test_the_report_and_metrics_ports_must_differ(helm):
    done = run_helm(helm, "template", RELEASE, str(CHART), "--set", "reports.port=9090")
    assert done.returncode != 0 and "reports.port and metrics.port" in done.stderr
    assert render(helm, "reports.port=9090", "metrics.enabled=false")


def test_the_image_can_be_pinned_by_digest(helm):
    digest = "sha256:" + "0123456789abcdef" * 4
    image = operator_container(render(helm, f"image.digest={digest}"))["image"]
    assert image == f"ghcr.io/accelerate-operator/operator@{digest}"
    for bad in (f"image.repository=ghcr.io/x/operator@{digest}", "image.digest=sha256:0123",
                "image.tag=0.1.0@sha256:0123"):
        done = run_helm(helm, "template", RELEASE, str(CHART), "--set", bad)
        assert done.returncode != 0, f"--set {bad} was accepted"


def test_watched_namespaces_that_yaml_would_retype_stay_strings(helm):
    done = run_helm(helm, "template", RELEASE, str(CHART), "--set-json",
                    'watchNamespaces=["2024","on"]')
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    namespaces = {d["metadata"]["namespace"] for d in docs if d["kind"] in ("Role", "RoleBinding")}
    assert {"2024", "on"} <= namespaces


def test_service_monitor_selects_the_metrics_service_with_the_users_labels(helm):
    docs = render(helm, "metrics.serviceMonitor.enabled=true",
                  "metrics.serviceMonitor.labels.release=prom",
                  "metrics.serviceMonitor.interval=1m30s")
    monitor = only(docs, "ServiceMonitor")
    service = service_named(docs, f"{RELEASE}-metrics")
    assert not selected_by(monitor, service_named(docs, RELEASE))
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics",
                                             "interval": "1m30s"}]


def test_grafana_dashboard_ships_as_a_sidecar_labelled_configmap_of_every_metric(helm):
    docs = render(helm, "metrics.dashboard.enabled=true", "metrics.dashboard.namespace=grafana")
    configmap = only(docs, "ConfigMap")
    assert configmap["metadata"]["namespace"] == "grafana"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(configmap["data"]["accelerate-operator.json"])
    exprs = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    names = {metric.name for metric in Metrics().registry.collect()}
    assert names == {"accelerate_operator_jobs", "accelerate_operator_restarts",
                     "accelerate_operator_job_seconds_to_running",
                     "accelerate_operator_job_seconds_to_first_step",
                     "accelerate_operator_pass_duration_seconds",
                     "accelerate_operator_api_errors",
                     "accelerate_operator_job_goodput_ratio",
                     "accelerate_operator_job_lost_seconds",
                     "accelerate_operator_job_interruptions",
                     "accelerate_operator_job_last_recovery_seconds"}
    assert all(name in exprs for name in names), exprs


def test_the_placeholder_priority_class_is_the_one_the_operator_names_lowest_and_never_preempts(
        helm):
    """Elastic jobs' placeholders (resources/placeholder.py) name this PriorityClass: the chart
    installs it, unless another release already has (cluster-scoped)."""
    from accelerate_operator.resources.placeholder import PLACEHOLDER_PRIORITY_CLASS

    priority = only(render(helm), "PriorityClass")
    assert priority["metadata"]["name"] == PLACEHOLDER_PRIORITY_CLASS
    assert (priority["value"], priority["preemptionPolicy"], priority["globalDefault"]) == (
        -10, "Never", False)
    kinds = {d["kind"] for d in render(helm, "elastic.placeholderPriorityClass=false")}
    assert "PriorityClass" not in kinds
