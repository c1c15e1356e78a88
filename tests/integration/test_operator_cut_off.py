"""No split-brain, on the real API server: two replicas of the operator (`python -m
accelerate_operator --peering`, processes of this host), each with its own ServiceAccount, share a
KopfPeering in the test's namespace. The active one (priority 200) is cut off from the peering
object: its RoleBinding on kopfpeerings is deleted, so it can neither read its peers nor renew
its own record, while it keeps every other right. It stops (its probe says paused) and runs no
pass from then on, though a job created meanwhile is there for it to act on; nothing acts on that
job until its record has expired, and then the standby (priority 100) alone creates the job's
children.

The operator the chart deployed is scaled to zero meanwhile, so that only these two act."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from devtools.cluster import ROOT, kubectl, kubectl_json, wait_for
from tests.helpers.jobs import apply_job, command_job
from tests.integration.test_operator_in_process import free_port, health

pytestmark = pytest.mark.cluster

PEERING = "cut-off"
# Shorter than kopf's 60 s (--peering-lifetime), and every record says the lifetime its replica
# was started with. Long enough for the checks below: a pauses about 10 s after the cut, its
# probe shows it 11 s later, and the job made then must have 10 s of a's record left.
LIFETIME = 40
CLUSTER_ROLE = "accelerate-operator"  # the chart's, cluster-wide: every rule the operator needs
PEERING_RULE = {"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings"],
                "verbs": ["get", "list", "watch", "create", "patch"]}


def apply(kubeconfig: str, namespace: str, *objects: dict) -> None:
    kubectl("-n", namespace, "apply", "-f", "-", kubeconfig=kubeconfig,
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))


def role(name: str, rules: list[dict]) -> dict:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": name}, "rules": rules}


def binding(name: str, role_name: str, account: str, namespace: str) -> dict:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": role_name},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]}


def replica_kubeconfig(kubeconfig: str, namespace: str, account: str, path: Path) -> str:
    """A kubeconfig for the ServiceAccount: the cluster's server and CA, the account's token."""
    config = kubectl_json("config", "view", "--raw", "--minify", kubeconfig=kubeconfig)
    token = kubectl("-n", namespace, "create", "token", account, "--duration=1h",
                    kubeconfig=kubeconfig).stdout.strip()
    config["users"] = [{"name": account, "user": {"token": token}}]
    for context in config["contexts"]:
        context["context"]["user"] = account
    path.write_text(json.dumps(config))
    return str(path)


def grant(kubeconfig: str, namespace: str, accounts: list[str]) -> None:
    """Each account: the operator's namespaced rules, and kopfpeerings through a binding of its
    own (the one a cut deletes)."""
    rules = [rule for rule in kubectl_json("get", "clusterrole", CLUSTER_ROLE,
                                           kubeconfig=kubeconfig)["rules"]
             if "kopf.dev" not in rule.get("apiGroups", []) and "resources" in rule
             and "nodes" not in rule["resources"]]
    objects = [role("operator", rules), role("peering", [PEERING_RULE])]
    for account in accounts:
        objects += [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}},
                    binding(f"{account}-operator", "operator", account, namespace),
                    binding(f"{account}-peering", "peering", account, namespace)]
    apply(kubeconfig, namespace, *objects)


class Replica:
    def __init__(self, kubeconfig: str, namespace: str, priority: int, log: Path) -> None:
        self.port = free_port()
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "accelerate_operator", "--namespace", namespace,
                 "--peering", PEERING, "--priority", str(priority),
                 "--peering-lifetime", str(LIFETIME),
                 "--liveness-port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, env={
                    **os.environ, "KUBECONFIG": kubeconfig,
                    "ACCELERATE_OPERATOR_REPORT_PORT": "0",  # two replicas on one host
                    # this checkout's operator, whichever checkout last installed itself
                    "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("operator", "trainer"))})

    def probe(self) -> dict:
        """What the operator's probe says (kopf keeps an answer for 10 s)."""
        return (health(self.port) or {}).get("jobs") or {}

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture
def replicas(kubeconfig: str, namespace: str, tmp_path: Path,
             deployed_operator_stopped: None) -> Iterator[tuple[Replica, ...]]:
    grant(kubeconfig, namespace, ["replica-a", "replica-b"])
    started = [Replica(replica_kubeconfig(kubeconfig, namespace, account, tmp_path / account),
                       namespace, priority, tmp_path / f"{account}.log")
               for account, priority in (("replica-a", 200), ("replica-b", 100))]
    try:
        yield tuple(started)
    finally:
        for replica in started:
            replica.stop()


def records(kubeconfig: str, namespace: str) -> dict:
    return kubectl_json("-n", namespace, "get", "kopfpeering", PEERING,
                        kubeconfig=kubeconfig).get("status") or {}


def identity_of(kubeconfig: str, namespace: str, priority: int) -> str:
    return next(name for name, record in records(kubeconfig, namespace).items()
                if record.get("priority") == priority)


def utc(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).astimezone(timezone.utc)


def record_end(record: dict) -> datetime:
    """When the peers count the record's replica dead (kopf's lastseen + lifetime)."""
    return utc(record["lastseen"]) + timedelta(seconds=record["lifetime"])


def created(kubeconfig: str, namespace: str, job: str) -> datetime | None:
    """When the job's first child was created, or None while it has none."""
    out = kubectl_json("-n", namespace, "get", "configmaps,services,pods", "-l",
                       f"accelerate-operator.io/job-name={job}", kubeconfig=kubeconfig)
    stamps = [item["metadata"]["creationTimestamp"] for item in out["items"]]
    return min(utc(stamp) for stamp in stamps) if stamps else None


def test_a_replica_cut_off_from_the_peering_object_stops_and_the_other_alone_acts(
        kubeconfig: str, namespace: str, replicas: tuple[Replica, Replica]):
    a, b = replicas
    wait_for(lambda: a.probe().get("paused") is False and b.probe().get("paused") is True,
             timeout=90, description="replica a active, b standing by")
    apply_job(kubeconfig, namespace, command_job("before", "pass", nodes=1).build())
    wait_for(lambda: created(kubeconfig, namespace, "before"), timeout=60,
             description="the active replica to act on a job")

    # Cut a off right after kopf renewed its record: the record then stands LIFETIME s more, and
    # b may take over only once it has expired.
    a_id = identity_of(kubeconfig, namespace, 200)
    recorded = records(kubeconfig, namespace)
    assert {r["lifetime"] for r in recorded.values()} == {LIFETIME}, recorded
    seen = recorded[a_id]["lastseen"]
    wait_for(lambda: records(kubeconfig, namespace)[a_id]["lastseen"] != seen, timeout=LIFETIME,
             interval=0.2, description="kopf's next keep-alive of replica a")
    kubectl("-n", namespace, "delete", "rolebinding", "replica-a-peering", kubeconfig=kubeconfig)
    a_end = record_end(records(kubeconfig, namespace)[a_id])

    wait_for(lambda: a.probe().get("paused") is True, timeout=30,
             description="replica a to pause once it cannot confirm it is active")
    time.sleep(11)  # the probe's answer is now from after the pause
    a_passes = a.probe()["passes"]
    assert datetime.now(timezone.utc) < a_end - timedelta(seconds=10), "the cut came too late"
    apply_job(kubeconfig, namespace, command_job("after", "pass", nodes=1).build())

    first = wait_for(lambda: created(kubeconfig, namespace, "after"), timeout=120,
                     description="the standby to take over and act")
    # Nobody acted while a's record stood; then b did, and a ran no pass.
    assert first >= a_end - timedelta(seconds=1.5), (first, a_end)
    wait_for(lambda: b.probe().get("paused") is False, timeout=20, description="b active")
    time.sleep(11)
    if a.process.poll() is None:  # kopf may end a replica whose keep-alive keeps failing
        probe = a.probe()
        assert (probe["paused"], probe["passes"]) == (True, a_passes), probe
