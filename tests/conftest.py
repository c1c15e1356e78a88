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
# Modules that change what every other test shares (or load the machine so that the tests beside
# them slip), and why: hack/test.sh runs them alone, after the rest has run side by side. (Tests
# that stop the deployed operator are found by fixture.)
EXCLUSIVE = {
    "tests/e2e/test_kueue.py": "installs Kueue, whose webhooks see every pod; redeploys",
    "tests/e2e/test_upgrade_keeps_jobs.py": "installs the previous operator",
    "tests/e2e/test_node_loss.py": "kills a node",
    "tests/e2e/test_disruptions.py": "drains (cordons) a node",
    "tests/e2e/test_operator_failover.py": "kills the active operator",
    "tests/integration/test_resilience.py": "kills the operator, restarts the API server",
    "tests/integration/test_report_security.py": "floods the operator's report endpoint",
    "tests/integration/test_report_attacks.py": "floods the operator's report endpoint",
    # Not a change to shared state, but each starts dozens of jobs at once: alone they take 160 s
    # and 116 s; beside each other 630 s each, and the trainings beside them slow down in turn.
    "tests/e2e/test_accelerate_corpus_on_cluster.py": "starts dozens of jobs at once",
    "tests/e2e/test_ignored_config_values_on_cluster.py": "starts dozens of jobs at once",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "exclusive: changes what every test shares (the operator's deployment, a "
        "node, the API server, Kueue's webhooks) or loads the machine so that tests beside it "
        "slip: make test runs these alone, after the others")
    config.addinivalue_line(
        "markers", "operator_stopped: runs with the chart's operator scaled to zero (fixture "
        "deployed_operator_stopped), an operator of its own for its namespace: make test runs "
        "these side by side, after the exclusive ones")


def build_cluster() -> str:
    """hack/cluster-up.sh's kubeconfig; a build that fails ends the session once, naming the
    step, instead of erroring every cluster test the same way."""
    proc = subprocess.run([str(ROOT / "hack" / "cluster-up.sh")], stdout=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        pytest.exit(f"hack/cluster-up.sh failed (exit {proc.returncode}); its output is above",
                    returncode=3)
    return proc.stdout.strip().splitlines()[-1]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the cluster before the first test when a collected test needs it and `make test`
    has not built it already (hack/test.sh names it in ACCELERATE_OPERATOR_CLUSTER_READY): here,
    outside every test's time limit, which a cold build (15-20 minutes) would exceed."""
    needed = any(item.get_closest_marker("cluster") for item in session.items)
    if (not needed or EXTERNAL or session.config.option.collectonly
            or os.environ.get("ACCELERATE_OPERATOR_CLUSTER_READY")):
        return
    os.environ["ACCELERATE_OPERATOR_CLUSTER_READY"] = build_cluster()


@pytest.fixture(scope="session")
def kubeconfig() -> str:
    """A running cluster with the operator installed through the Helm chart."""
    path = ensure_cluster() if EXTERNAL else os.environ.get("ACCELERATE_OPERATOR_CLUSTER_READY")
    if not path:  # a cluster test collected in a way the hook above did not see
        path = os.environ["ACCELERATE_OPERATOR_CLUSTER_READY"] = build_cluster()
    os.environ["KUBECONFIG"] = path
    return path


@pytest.fixture
def namespace(kubeconfig: str, request: pytest.FixtureRequest) -> Iterator[str]:
    prefix = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower().removeprefix("test_"))[:24]
    name = create_namespace(kubeconfig, prefix=prefix.strip("-") or "test")
    yield name
    delete_namespace(kubeconfig, name)


@pytest.fixture(scope="session")
def deployed_operator_stopped(kubeconfig: str,
                              tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The chart's operator scaled to zero, for tests that run an operator of their own (each for
    its own namespace): once per session, then restored as it was. pytest-xdist's workers share
    one stop (the first in stops it, the last out starts it), so these tests run side by side."""
    from tests.helpers.operator import deployed_operator_scaled_down_shared

    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = run_dir.parent  # the run's, above each worker's own
    with deployed_operator_scaled_down_shared(kubeconfig, run_dir / "operator-stopped.json"):
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Anything that uses the cluster carries the `cluster` marker, so `-m "not cluster"` works.
    A test that stops the deployed operator is `exclusive` and `operator_stopped` (hack/test.sh
    runs those side by side once the other exclusive ones have run alone), and they run last, so
    the operator is stopped and started once per session, not once per module."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "kubeconfig" in names:
            item.add_marker(pytest.mark.cluster)
        if "deployed_operator_stopped" in names:
            item.add_marker(pytest.mark.operator_stopped)
        if "deployed_operator_stopped" in names or item.nodeid.split("::")[0] in EXCLUSIVE:
            item.add_marker(pytest.mark.exclusive)
    items.sort(key=lambda item: "deployed_operator_stopped" in getattr(item, "fixturenames", ()))
