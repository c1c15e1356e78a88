"""The control run of bench/running.py: one synthetic reporter for every job, in place of a
supervisor in each job's pod. The jobs' pods are the bare printers; one pod of the same
namespace POSTs each job's progress to the operator's report endpoint as pod 0's supervisor
would (a new step every PERIOD_SECONDS per job, spread evenly, then at the pace the
operator's answers set; a token the API server bound to
the job's pod 0, for the endpoint's audience; HTTPS kept alive, over a few connections). The
operator and the API server then do what they do for supervised jobs, the same reports and the
same status writes, while the machine runs one reporting process instead of one per job: the
difference between the two runs is what the reporting processes cost, apart from what the
writes cost.

Stdlib only in the pod (the trainer image's python); it prints a tally of the answers, one JSON
line every 10 s."""

from __future__ import annotations

import json

from accelerate_trainer.contract import (
    NEXT_REPORT_KEY,
    REPORT_AUDIENCE,
    REPORT_BODY_KEY,
    REPORT_CA_KEY,
)
from common import Cluster
from kubernetes import client

# The supervisor's PUSH_SECONDS: a report per job when its step changed, until the operator's
# answer sets the pace (contract.NEXT_REPORT_KEY), which the reporter then keeps as it does.
PERIOD_SECONDS = 8.0
CONNECTIONS = 8  # well under the endpoint's per-peer cap (report_listener.Bounds)
SERVICE = "accelerate-operator.accelerate-system.svc:8443"
NAME = "synthetic-reporter"

REPORTER = r"""
import collections, http.client, json, os, socket, ssl, threading, time
jobs = json.load(open("/reporter/tokens.json"))
names, period = sorted(jobs), float(os.environ["PERIOD"])
host, port = os.environ["SERVICE"].rsplit(":", 1)
context = ssl.create_default_context(cadata=open("/reporter/ca.crt").read())
path = "/apis/accelerate-operator.io/v1alpha1/namespaces/%s/acceleratejobs/%%s/status" % (
    os.environ["NAMESPACE"])
key = os.environ["BODY_KEY"]
answers, lock = collections.Counter(), threading.Lock()
start = time.monotonic()

def stamp():
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + "Z"

def body(step):
    return json.dumps({key: {"progress": {"step": step, "total_steps": 100000,
                                          "loss": round(1 + 1 / step, 4)},
                             "lastOutputTime": stamp(), "progressTime": stamp(),
                             "attempt": 0, "versions": {"accelerate": "synthetic"}}})

def run(mine):
    connection, step = None, {name: 0 for name in mine}
    due = {name: start + period * names.index(name) / len(names) for name in mine}
    while True:
        name = min(due, key=due.get)
        time.sleep(max(0.0, due[name] - time.monotonic()))
        due[name] += period
        step[name] += 1
        try:
            if connection is None:
                connection = http.client.HTTPSConnection(host, int(port), context=context,
                                                         timeout=15)
            connection.request("POST", path % name, body(step[name]), {
                "Authorization": "Bearer " + jobs[name], "Content-Type": "application/json"})
            answer = connection.getresponse()
            text = answer.read()
            code = str(answer.status)
            if answer.status == 200:  # the operator's pace, as the supervisor keeps it
                due[name] += json.loads(text).get(os.environ["NEXT_KEY"], period) - period
            if answer.getheader("Connection", "").lower() == "close":
                connection.close(); connection = None
        except (OSError, http.client.HTTPException) as error:
            code = type(error).__name__
            connection = None
        with lock:
            answers[code] += 1

for index in range(int(os.environ["CONNECTIONS"])):
    threading.Thread(target=run, args=(names[index::int(os.environ["CONNECTIONS"])],),
                     daemon=True).start()
while True:
    time.sleep(10)
    with lock:
        print(json.dumps(answers), flush=True)
"""


def pod_tokens(cluster: Cluster, namespace: str, names: list[str]) -> dict[str, str]:
    """A token for each job's pod 0, as the kubelet projects it: the namespace's default
    account, bound to the pod, for the endpoint's audience."""
    uids = {pod.metadata.name: pod.metadata.uid
            for pod in cluster.core.list_namespaced_pod(namespace).items}
    tokens = {}
    for name in names:
        request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=[REPORT_AUDIENCE], expiration_seconds=3600,
            bound_object_ref=client.V1BoundObjectReference(
                kind="Pod", api_version="v1", name=f"{name}-0", uid=uids[f"{name}-0"])))
        answer = cluster.core.create_namespaced_service_account_token("default", namespace,
                                                                      request)
        tokens[name] = answer.status.token
    return tokens


def start_reporter(cluster: Cluster, namespace: str, names: list[str], image: str) -> None:
    """The reporter pod, with the tokens and the endpoint's CA in a Secret of its own."""
    configmap = cluster.core.read_namespaced_config_map(f"{names[0]}-accelerate-config",
                                                        namespace)
    cluster.core.create_namespaced_secret(namespace, {
        "metadata": {"name": NAME}, "stringData": {
            "tokens.json": json.dumps(pod_tokens(cluster, namespace, names)),
            "ca.crt": configmap.data[REPORT_CA_KEY]}})
    env = {"PERIOD": str(PERIOD_SECONDS), "SERVICE": SERVICE, "NAMESPACE": namespace,
           "BODY_KEY": REPORT_BODY_KEY, "NEXT_KEY": NEXT_REPORT_KEY,
           "CONNECTIONS": str(CONNECTIONS)}
    cluster.core.create_namespaced_pod(namespace, {
        "metadata": {"name": NAME},
        "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                 "terminationGracePeriodSeconds": 1,
                 "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                     "seccompProfile": {"type": "RuntimeDefault"}},
                 "volumes": [{"name": "reporter", "secret": {"secretName": NAME}}],
                 "containers": [{
                     "name": "reporter", "image": image, "imagePullPolicy": "IfNotPresent",
                     "command": ["python", "-u", "-c", REPORTER],
                     "env": [{"name": k, "value": v} for k, v in env.items()],
                     "volumeMounts": [{"name": "reporter", "mountPath": "/reporter"}],
                     "securityContext": {"allowPrivilegeEscalation": False,
                                         "capabilities": {"drop": ["ALL"]}},
                     "resources": {"requests": {"cpu": "5m", "memory": "32Mi"}}}]}})


def reporter_answers(cluster: Cluster, namespace: str) -> dict[str, int]:
    """The reporter's latest tally of the endpoint's answers, by status code or error."""
    log = cluster.core.read_namespaced_pod_log(NAME, namespace, tail_lines=1)
    return json.loads(log.strip() or "{}")
