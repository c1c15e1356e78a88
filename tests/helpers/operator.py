"""The deployed operator's replicas: which are running, and which one kopf's peering keeps
active (the chart runs two; the other is a paused standby, and killing it tests nothing)."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from devtools.cluster import kubectl, wait_for

OPERATOR_NAMESPACE = os.environ.get("ACCELERATE_OPERATOR_NAMESPACE", "accelerate-system")
OPERATOR_SELECTOR = "app.kubernetes.io/name=accelerate-operator"
PEERING = "accelerate-operator"


def get_json(kubeconfig: str, *args: str) -> dict:
    return json.loads(kubectl(*args, "-o", "json", kubeconfig=kubeconfig).stdout)


def running_operator_pods(kubeconfig: str) -> list[str]:
    """The operator's pods that run and are not being deleted."""
    return [p["metadata"]["name"] for p in get_json(
        kubeconfig, "-n", OPERATOR_NAMESPACE, "get", "pods", "-l", OPERATOR_SELECTOR)["items"]
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]


def active_operator(kubeconfig: str) -> tuple[str, list[str]]:
    """The replica kopf's peering keeps active (the live record of highest priority), and all
    the operator's running pods."""
    pods = running_operator_pods(kubeconfig)
    peering = get_json(kubeconfig, "get", "clusterkopfpeering", PEERING)
    records = [(info["priority"], identity.split("@", 1)[1].split("/", 1)[0])
               for identity, info in (peering.get("status") or {}).items()]
    live = sorted((priority, pod) for priority, pod in records if pod in pods)
    assert live, f"no live peering record among {pods}: {records}"
    return live[-1][1], pods


def operator_pods(kubeconfig: str) -> list[str]:
    out = kubectl("-n", OPERATOR_NAMESPACE, "get", "pods", "-l", OPERATOR_SELECTOR, "-o",
                  "name", kubeconfig=kubeconfig)
    return out.stdout.split()


def stop_deployed_operator(kubeconfig: str) -> dict:
    """Scale the chart's operator to zero and wait for its pods to go; returns what
    start_deployed_operator needs to bring it back as it was."""
    deployment = kubectl("-n", OPERATOR_NAMESPACE, "get", "deployment", "-l", OPERATOR_SELECTOR,
                         "-o", "name", kubeconfig=kubeconfig).stdout.split()[0]
    replicas = kubectl("-n", OPERATOR_NAMESPACE, "get", deployment, "-o",
                       "jsonpath={.spec.replicas}", kubeconfig=kubeconfig).stdout or "1"
    kubectl("-n", OPERATOR_NAMESPACE, "scale", deployment, "--replicas=0", kubeconfig=kubeconfig)
    stopped = {"deployment": deployment, "replicas": replicas}
    try:
        wait_for(lambda: not operator_pods(kubeconfig), timeout=120,
                 description="the deployed operator to stop")
    except BaseException:
        start_deployed_operator(kubeconfig, stopped)
        raise
    return stopped


def start_deployed_operator(kubeconfig: str, stopped: dict) -> None:
    kubectl("-n", OPERATOR_NAMESPACE, "scale", stopped["deployment"],
            f"--replicas={stopped['replicas']}", kubeconfig=kubeconfig)
    kubectl("-n", OPERATOR_NAMESPACE, "rollout", "status", stopped["deployment"],
            "--timeout=180s", kubeconfig=kubeconfig)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # the lock goes with the file's close


@contextmanager
def deployed_operator_scaled_down_shared(kubeconfig: str, state: Path) -> Iterator[None]:
    """The chart's operator scaled to zero while tests run their own, then back as it was; shared
    by processes (pytest-xdist's workers): the first to enter stops it, the last to leave starts
    it. How many are inside, and how to start it, are in the JSON file `state`, under a lock
    beside it."""
    lock = state.with_suffix(".lock")
    with _locked(lock):
        shared = json.loads(state.read_text()) if state.exists() else {"inside": 0}
        if shared["inside"] == 0:
            shared["stopped"] = stop_deployed_operator(kubeconfig)
        shared["inside"] += 1
        state.write_text(json.dumps(shared))
    try:
        yield
    finally:
        with _locked(lock):
            shared = json.loads(state.read_text())
            shared["inside"] -= 1
            state.write_text(json.dumps(shared))
            if shared["inside"] == 0:
                start_deployed_operator(kubeconfig, shared["stopped"])
