"""Fixtures shared by every test.

Cluster tests run against the local cluster (started once per session by hack/local-cluster.sh and
the operator installed with the Helm chart by hack/deploy-operator.sh), or against any cluster
named by KUBECONFIG when ACCELERATE_OPERATOR_EXTERNAL_CLUSTER=1 (kind in the GitHub workflow).
Each test gets a fresh namespace."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests exercise the checkout's source; the venv's installed copy (what pods on the local node
# run) is refreshed by hack/python-env.sh and may lag behind an edit.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT / "operator"), str(_ROOT / "trainer")]

from devtools.cluster import (  # noqa: E402
    ROOT,
    create_namespace,
    delete_namespace,
    ensure_cluster,
)

EXTERNAL = os.environ.get("ACCELERATE_OPERATOR_EXTERNAL_CLUSTER") == "1"


@pytest.fixture(scope="session")
def kubeconfig() -> str:
    """A running cluster with the operator installed through the Helm chart."""
    if EXTERNAL:
        path = ensure_cluster()
    else:
        proc = subprocess.run([str(ROOT / "hack" / "cluster-up.sh")], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"hack/cluster-up.sh failed:\n{proc.stderr[-4000:]}")
        path = proc.stdout.strip().splitlines()[-1]
    os.environ["KUBECONFIG"] = path
    return path


@pytest.fixture
def namespace(kubeconfig: str, request: pytest.FixtureRequest) -> Iterator[str]:
    prefix = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower().removeprefix("test_"))[:24]
    name = create_namespace(kubeconfig, prefix=prefix.strip("-") or "test")
    yield name
    delete_namespace(kubeconfig, name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Anything that uses the cluster carries the `cluster` marker, so `-m "not cluster"` works."""
    for item in items:
        if "kubeconfig" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)
