"""Helpers for tests that need a Kubernetes cluster: start it, run kubectl, make namespaces, wait.

By default the local cluster (hack/local-cluster.sh: real control plane and real nodes)
is started once and reused. Set ACCELERATE_OPERATOR_EXTERNAL_CLUSTER=1 and KUBECONFIG to run the
same tests against another cluster (kind, a real one). These helpers never delete a cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def ensure_cluster() -> str:
    """Return a kubeconfig path for a running cluster, starting the local one if needed."""
    if os.environ.get("ACCELERATE_OPERATOR_EXTERNAL_CLUSTER") == "1":
        kubeconfig = os.environ.get("KUBECONFIG")
        if not kubeconfig:
            raise RuntimeError("ACCELERATE_OPERATOR_EXTERNAL_CLUSTER=1 needs KUBECONFIG to name "
                               "the cluster's kubeconfig file")
        return kubeconfig
    proc = subprocess.run([str(ROOT / "hack" / "local-cluster.sh"), "up"], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"hack/local-cluster.sh up failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]


_kubectl_path: str | None = None


def kubectl_binary() -> str:
    """The kubectl built by hack/build-control-plane.sh when present, else `kubectl` on PATH."""
    global _kubectl_path
    if _kubectl_path is None:
        cache = Path(os.environ.get("ACCELERATE_OPERATOR_CACHE",
                                    Path.home() / ".cache" / "accelerate-operator"))
        built = sorted(cache.glob("bin/*/kubectl"))
        if built:
            _kubectl_path = str(built[-1])
        else:
            found = shutil.which("kubectl")
            if not found:
                raise RuntimeError("no kubectl: run hack/build-control-plane.sh or install kubectl")
            _kubectl_path = found
    return _kubectl_path


def kubectl(*args: str, kubeconfig: str, check: bool = True, input: str | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    # errors="replace": a pod's log may hold a multi-byte character cut in two (the runtime
    # splits long lines, a progress bar redraws mid-character).
    proc = subprocess.run([kubectl_binary(), "--kubeconfig", kubeconfig, *args], input=input,
                          capture_output=True, text=True, errors="replace", timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed (exit {proc.returncode}):\n"
                             f"{proc.stderr}{proc.stdout[-2000:]}")
    return proc


def kubectl_json(*args: str, kubeconfig: str) -> dict:
    return json.loads(kubectl(*args, "-o", "json", kubeconfig=kubeconfig).stdout)


def wait_for(predicate: Callable[[], T], timeout: float = 60, interval: float = 0.5,
             description: str = "a condition") -> T:
    """Call `predicate` until it returns something truthy; return it or fail saying what."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except Exception as e:  # the condition may raise until it holds (e.g. 404)
            last_error = e
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {description}{detail}")
        time.sleep(interval)


def wait_for_crd(kubeconfig: str, name: str, timeout: float = 60) -> None:
    """Until the CRD `name` is Established. Not `kubectl wait --for=condition=Established`: a
    CRD just created can still hold `status.conditions: null`, and kubectl then fails at once
    (".status.conditions accessor error: <nil> is of the type <nil>") instead of waiting."""
    def established() -> bool:
        crd = kubectl_json("get", "crd", name, kubeconfig=kubeconfig)
        return any(c.get("type") == "Established" and c.get("status") == "True"
                   for c in (crd.get("status") or {}).get("conditions") or [])

    wait_for(established, timeout=timeout, description=f"CRD {name} to be Established")


def create_namespace(kubeconfig: str, prefix: str = "test") -> str:
    """Create a uniquely named namespace and wait for its default ServiceAccount (pods need it)."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name, kubeconfig=kubeconfig)
    wait_for(lambda: kubectl("-n", name, "get", "serviceaccount", "default",
                             kubeconfig=kubeconfig, check=False).returncode == 0,
             timeout=60, description=f"the default ServiceAccount in namespace {name}")
    return name


def delete_namespace(kubeconfig: str, name: str, wait: bool = False) -> None:
    kubectl("delete", "namespace", name, "--ignore-not-found", f"--wait={str(wait).lower()}",
            kubeconfig=kubeconfig, check=False)


def pod_phase(kubeconfig: str, namespace: str, name: str) -> str:
    proc = kubectl("-n", namespace, "get", "pod", name, "-o", "jsonpath={.status.phase}",
                   kubeconfig=kubeconfig, check=False)
    return proc.stdout if proc.returncode == 0 else ""


def wait_for_phase(kubeconfig: str, namespace: str, name: str, phases: tuple[str, ...],
                   timeout: float = 60) -> str:
    return wait_for(lambda: (p := pod_phase(kubeconfig, namespace, name)) in phases and p,
                    timeout=timeout, description=f"pod {namespace}/{name} to be in {phases}")
