"""Tests of the local test cluster itself (control plane + real nodes), not of the operator.

They pin down what the operator's tests rely on: pod phases and exit codes, logs through the API
server, termination messages, pods on two nodes reaching each other by `<host>.<subdomain>` names
through CoreDNS, volumes, real garbage collection and in-cluster API access under RBAC.
"""

from __future__ import annotations

import ipaddress
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from devtools.cluster import (  # noqa: E402
    create_namespace,
    delete_namespace,
    kubectl,
    kubectl_json,
    wait_for,
    wait_for_phase,
)
from devtools.images import PYTHON_IMAGE  # noqa: E402

pytestmark = pytest.mark.cluster


def create(kubeconfig: str, *objects: dict) -> None:
    kubectl("create", "-f", "-", kubeconfig=kubeconfig,
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))


def python_pod(name: str, namespace: str, code: str, **spec: object) -> dict:
    container = {"name": "main", "image": PYTHON_IMAGE, "imagePullPolicy": "Never",
                 "command": ["python3", "-c", code]}
    container.update(spec.pop("container", {}))  # type: ignore[arg-type]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
                     "containers": [container], **spec}}


def logs(kubeconfig: str, namespace: str, pod: str) -> str:
    return kubectl("-n", namespace, "logs", pod, kubeconfig=kubeconfig).stdout


def in_its_nodes_pod_cidr(kubeconfig: str, pod: dict) -> bool:
    """The pod's IP is in the range its node was given (spec.podCIDR): the cluster's CNI placed
    it, whatever pod subnet this cluster uses (the local cluster's, kind's)."""
    node = kubectl_json("get", "node", pod["spec"]["nodeName"], kubeconfig=kubeconfig)
    return ipaddress.ip_address(pod["status"]["podIP"]) in \
        ipaddress.ip_network(node["spec"]["podCIDR"])


def test_pod_that_exits_zero_succeeds_and_its_logs_are_served(kubeconfig: str, namespace: str):
    code = "import os; print('hello from', os.environ['POD_NAME'], os.environ['POD_NS'])"
    create(kubeconfig, python_pod("printer", namespace, code, container={"env": [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]}))

    assert wait_for_phase(kubeconfig, namespace, "printer", ("Succeeded", "Failed")) == "Succeeded"
    assert f"hello from printer {namespace}" in logs(kubeconfig, namespace, "printer")
    pod = kubectl_json("-n", namespace, "get", "pod", "printer", kubeconfig=kubeconfig)
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed")
    assert in_its_nodes_pod_cidr(kubeconfig, pod), pod["status"]["podIP"]


def test_pod_exit_code_and_termination_message_are_reported(kubeconfig: str, namespace: str):
    code = ("import sys; open('/dev/termination-log', 'w').write('boom'); "
            "print('failing on purpose'); sys.exit(3)")
    create(kubeconfig, python_pod("failer", namespace, code))

    assert wait_for_phase(kubeconfig, namespace, "failer", ("Succeeded", "Failed")) == "Failed"
    pod = kubectl_json("-n", namespace, "get", "pod", "failer", kubeconfig=kubeconfig)
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"], terminated["message"]) == \
        (3, "Error", "boom")
    assert "failing on purpose" in logs(kubeconfig, namespace, "failer")


SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', 29500)); s.listen(1)
conn, _ = s.accept(); conn.sendall(sys.argv[1].encode()); conn.close()
print('served')
"""

CLIENT = """
import socket, sys, time
for attempt in range(120):
    try:
        c = socket.create_connection((sys.argv[1], 29500), timeout=2)
        break
    except OSError as e:
        last = e; time.sleep(0.5)
else:
    sys.exit(f'cannot connect to {sys.argv[1]}:29500: {last}')
print('got', c.recv(100).decode(), 'from', socket.gethostbyname(sys.argv[1]))
"""


def rendezvous_pair(namespace: str) -> list[dict]:
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "job", "namespace": namespace},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                        "selector": {"group": "job"}, "ports": [{"port": 29500}]}}
    server = python_pod("job-0", namespace, SERVER, hostname="job-0", subdomain="job",
                        container={"args": [f"token-{namespace}"]})
    client = python_pod("job-1", namespace, CLIENT, hostname="job-1", subdomain="job",
                        container={"args": ["job-0.job"]})
    for pod in (server, client):  # `python3 -c CODE ARG` gives sys.argv == ['-c', ARG]
        pod["metadata"]["labels"]["group"] = "job"
        # One pod per node: the pair talks across nodes, through the host's routes.
        one_per_node = {"labelSelector": {"matchLabels": {"group": "job"}},
                        "topologyKey": "kubernetes.io/hostname"}
        pod["spec"]["affinity"] = {"podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [one_per_node]}}
    return [service, server, client]


def test_pods_reach_each_other_by_hostname_while_another_namespace_uses_the_same_port(
        kubeconfig: str, namespace: str):
    other = create_namespace(kubeconfig, "infra-other")
    try:
        for ns in (namespace, other):
            create(kubeconfig, *rendezvous_pair(ns))
        for ns in (namespace, other):
            for pod in ("job-0", "job-1"):
                assert wait_for_phase(kubeconfig, ns, pod, ("Succeeded", "Failed"),
                                      timeout=90) == "Succeeded", logs(kubeconfig, ns, pod)
            assert "served" in logs(kubeconfig, ns, "job-0")
            pods = {pod: kubectl_json("-n", ns, "get", "pod", pod, kubeconfig=kubeconfig)
                    for pod in ("job-0", "job-1")}
            # job-0.job resolved to job-0's own pod IP, one its node's range holds.
            server_ip = pods["job-0"]["status"]["podIP"]
            assert f"got token-{ns} from {server_ip}\n" in logs(kubeconfig, ns, "job-1")
            assert all(in_its_nodes_pod_cidr(kubeconfig, pod) for pod in pods.values())
            nodes = {p["spec"]["nodeName"] for p in pods.values()}
            subnets = {p["status"]["podIP"].rsplit(".", 1)[0] for p in pods.values()}
            assert len(nodes) == 2 and len(subnets) == 2, (nodes, subnets)
    finally:
        delete_namespace(kubeconfig, other)


def test_configmap_volume_appears_at_its_mount_path(kubeconfig: str, namespace: str):
    configmap = {"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": "settings", "namespace": namespace},
                 "data": {"greeting": "hi there", "other": "x"}}
    code = "print(open('/etc/infra-test-config/greeting.txt').read())"
    pod = python_pod("reader", namespace, code, volumes=[
        {"name": "cfg", "configMap": {"name": "settings",
                                      "items": [{"key": "greeting", "path": "greeting.txt"}]}}],
        container={"volumeMounts": [{"name": "cfg", "mountPath": "/etc/infra-test-config"}]})
    create(kubeconfig, configmap, pod)

    assert wait_for_phase(kubeconfig, namespace, "reader", ("Succeeded", "Failed")) == \
        "Succeeded", logs(kubeconfig, namespace, "reader")
    assert "hi there" in logs(kubeconfig, namespace, "reader")
    assert not Path("/etc/infra-test-config/greeting.txt").exists(), "the volume leaked to the host"


def test_pod_owned_by_a_deleted_configmap_is_garbage_collected(kubeconfig: str, namespace: str):
    kubectl("-n", namespace, "create", "configmap", "owner", kubeconfig=kubeconfig)
    owner = kubectl_json("-n", namespace, "get", "configmap", "owner", kubeconfig=kubeconfig)
    pod = python_pod("owned", namespace, "import time; time.sleep(600)")
    pod["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap",
                                           "name": "owner", "uid": owner["metadata"]["uid"]}]
    create(kubeconfig, pod)
    wait_for_phase(kubeconfig, namespace, "owned", ("Running",))

    kubectl("-n", namespace, "delete", "configmap", "owner", kubeconfig=kubeconfig)

    wait_for(lambda: kubectl("-n", namespace, "get", "pod", "owned", kubeconfig=kubeconfig,
                             check=False).returncode != 0,
             timeout=60, description="the garbage collector to delete the owned pod")


# The pod's service account, as any in-cluster client uses it (the operator's image has no
# `kubernetes` client: kopf's own login reads the same files), with the standard library only.
IN_CLUSTER = """
import json, os, ssl, urllib.error, urllib.request
sa = '/var/run/secrets/kubernetes.io/serviceaccount/'
namespace = open(sa + 'namespace').read()
host = os.environ['KUBERNETES_SERVICE_HOST'] + ':' + os.environ['KUBERNETES_SERVICE_PORT']
request = urllib.request.Request(f'https://{host}/api/v1/namespaces/{namespace}/pods',
                                 headers={'Authorization': 'Bearer ' + open(sa + 'token').read()})
try:
    context = ssl.create_default_context(cafile=sa + 'ca.crt')
    answer = urllib.request.urlopen(request, context=context)
    print('LISTED', len(json.load(answer)['items']))
except urllib.error.HTTPError as e:
    print('STATUS', e.code)
"""


def test_in_cluster_client_is_allowed_or_forbidden_by_rbac(kubeconfig: str, namespace: str):
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "pod-reader", "namespace": namespace},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "pod-reader", "namespace": namespace},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                           "name": "pod-reader"},
               "subjects": [{"kind": "ServiceAccount", "name": "reader",
                             "namespace": namespace}]}
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": "reader", "namespace": namespace}}
    create(kubeconfig, role, binding, account)
    create(kubeconfig, python_pod("allowed", namespace, IN_CLUSTER, serviceAccountName="reader"),
           python_pod("forbidden", namespace, IN_CLUSTER))

    for pod in ("allowed", "forbidden"):
        assert wait_for_phase(kubeconfig, namespace, pod, ("Succeeded", "Failed"), timeout=90) \
            == "Succeeded", logs(kubeconfig, namespace, pod)
    assert "LISTED 2" in logs(kubeconfig, namespace, "allowed")
    assert "STATUS 403" in logs(kubeconfig, namespace, "forbidden")
