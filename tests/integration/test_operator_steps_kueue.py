"""A job queued with Kueue, as step tables (tests/helpers/steps.py) against the real API server:
it waits with no pod until its Workload is admitted, runs, is evicted (its pods stop, the quota
is given back, no restart is counted), runs again when admitted again under a new attempt, and
its Workload is marked Finished when it succeeds.

Kueue itself cannot be had here: the test plays Kueue's part on the Workload's status, through a
Workload CRD of ours (tests/helpers/kueue_crds.py, Kueue v0.15-v0.19's versions) installed for
the module where the cluster serves none, and removed after. The operator runs as its own
process (`python -m accelerate_operator`, the Kueue integration on: a setting read when its
handlers are imported, so not in this process, where other tests import them without it) for
this module's namespace; the chart's operator is scaled to zero meanwhile."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.cluster import ROOT, create_namespace, delete_namespace, kubectl, wait_for_crd
from tests.helpers.jobs import JobBuilder
from tests.helpers.kueue_crds import workload_crd
from tests.helpers.steps import (
    KUEUE_GROUP,
    Cluster,
    Expect,
    create,
    kueue_admits,
    kueue_evicts,
    pods_running,
    pods_succeed,
    run_steps,
)

CRD = f"workloads.{KUEUE_GROUP}"


@pytest.fixture(scope="module")
def workload_crd_served(kubeconfig: str) -> Iterator[None]:
    """Kueue's Workload CRD: ours, unless the cluster has one already (then left as it is)."""
    present = kubectl("get", "crd", CRD, kubeconfig=kubeconfig, check=False).returncode == 0
    if not present:
        kubectl("apply", "--server-side", "-f", "-", kubeconfig=kubeconfig,
                input=json.dumps(workload_crd(KUEUE_GROUP, ("v1beta2", "v1beta1"))))
        wait_for_crd(kubeconfig, CRD)
    try:
        yield
    finally:
        if not present:
            kubectl("delete", "crd", CRD, "--wait=false", kubeconfig=kubeconfig, check=False)


@pytest.fixture(scope="module")
def cluster(kubeconfig: str, workload_crd_served: None, deployed_operator_stopped: None,
            tmp_path_factory) -> Iterator[Cluster]:
    namespace = create_namespace(kubeconfig, prefix="steps-kueue")
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    env = {**os.environ, "KUBECONFIG": kubeconfig, "ACCELERATE_OPERATOR_KUEUE": "1",
           "ACCELERATE_OPERATOR_REPORT_PORT": "0",
           "PYTHONPATH": os.pathsep.join(str(ROOT / part) for part in ("operator", "trainer"))}
    try:
        with open(log, "w") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "accelerate_operator", "--namespace", namespace],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=Path(ROOT))
            try:
                yield Cluster(kubeconfig, namespace)
            finally:
                process.send_signal(signal.SIGTERM)
                code = process.wait(timeout=30)
    finally:
        delete_namespace(kubeconfig, namespace)
    assert code == 0, log.read_text()[-4000:]


def test_a_queued_job_runs_only_while_admitted_and_an_eviction_counts_no_restart(cluster):
    queued = JobBuilder().nodes(2).procs(1).command("pass").grace(1).unscheduled().queue("team")
    run_steps(cluster, "queued", [
        ("created in LocalQueue team: a Workload, no pod", create(queued),
         Expect(phase="Queued", pods=0, workload={"QuotaReserved": None})),
        ("Kueue admits the Workload: the group starts", kueue_admits(),
         Expect(phase="Pending", attempt=0, pods=2, events=["Admitted"])),
        ("both pods run: Kueue is told the pods are ready", pods_running(0, 1),
         Expect(phase="Running", workload={"PodsReady": "True"})),
        ("Kueue evicts it: the pods stop, the quota is given back, nothing is counted",
         kueue_evicts("Preempted"),
         Expect(phase="Queued", attempt=1, restarts=0, pods=0, evictions=1,
                reasons={"Queued": "Preempted"},
                workload={"QuotaReserved": "False", "Requeued": "True"})),
        ("Kueue admits it again: a new group", kueue_admits(),
         Expect(phase="Pending", attempt=1, restarts=0, pods=2)),
        ("the new group runs", pods_running(0, 1), Expect(phase="Running", attempt=1)),
        ("both pods succeed: the Workload is Finished", pods_succeed(0, 1),
         Expect(phase="Succeeded", restarts=0, workload={"Finished": "True"})),
    ])
