"""End to end, from inside a training container on the real nodes: what it holds is no API
credential, and it reaches the operator's report endpoint the way the trainer does. The job's
template says nothing of automountServiceAccountToken: the operator turns it off, so the
container has the report token only (audience accelerate-operator.io/report), which the API
server refuses (401), and which the operator's endpoint, reached through the chart's Service
with the CA from the job's ConfigMap, takes (checked against the API server's published keys):
the report shows in the job's status."""

from __future__ import annotations

import json

import pytest

from devtools.cluster import kubectl, wait_for_phase
from tests.helpers.jobs import apply_job, command_job, wait_for_job

pytestmark = [pytest.mark.timeout(300)]

SLEEP = "import time; time.sleep(600)"
# Run in the trainer container: one JSON line of what it saw.
PROBE = r"""
import json, os, ssl, urllib.error, urllib.request
folder = "/var/run/secrets/accelerate-operator.io/report"
token = open(folder + "/token").read().strip()
seen = {"automounted": os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount/token")}

def call(url, context, body=None):
    request = urllib.request.Request(url, data=body, method="POST" if body else "GET", headers={
        "Authorization": "Bearer " + token, "Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(request, context=context, timeout=10).status
    except urllib.error.HTTPError as error:
        return error.code

# The API server (its CA is not in the container: only the answer matters here).
anyone = ssl.create_default_context()
anyone.check_hostname, anyone.verify_mode = False, ssl.CERT_NONE
seen["apiserver"] = call("https://kubernetes.default.svc/api/v1/namespaces/default/pods", anyone)
# The operator's endpoint, as the trainer sends to it.
report = {"acceleratePodReport": {"progress": {"step": 7, "total_steps": 10},
                                  "lastOutputTime": "2026-01-01T00:00:00Z"}}
seen["endpoint"] = call(os.environ["ACCELERATE_REPORT_URL"],
                        ssl.create_default_context(cafile=folder + "/ca.crt"),
                        json.dumps(report).encode())
print(json.dumps(seen))
"""


def test_the_training_container_holds_no_api_credential_and_reports_to_the_operator(
        kubeconfig, namespace):
    job = command_job("creds", SLEEP, nodes=1)
    apply_job(kubeconfig, namespace, job.build())
    wait_for_phase(kubeconfig, namespace, "creds-0", ("Running",), timeout=180)
    out = kubectl("-n", namespace, "exec", "creds-0", "-c", "trainer", "--", "python3", "-c",
                  PROBE, kubeconfig=kubeconfig).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {"automounted": False, "apiserver": 401, "endpoint": 200}, out
    found = wait_for_job(kubeconfig, namespace, "creds",
                         lambda j: (j.get("status", {}).get("progress") or {}).get("step") == 7,
                         timeout=30, description="the report in the job's status")
    assert found["status"]["progress"]["summary"] == "7/10 (70%)"
