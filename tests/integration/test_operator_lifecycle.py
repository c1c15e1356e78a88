"""The operator against the real API server, scheduler, garbage collector and node: the children
it creates, how the job's status follows its pods, and what is left once it ends (TTL, clean-pod
policy). Pods run cheap Python snippets; real training is in tests/e2e. Restarts, failures and
the run policy's stops: test_operator_restarts.py."""

from __future__ import annotations

import json

from devtools.cluster import kubectl, wait_for
from tests.helpers.jobs import (
    apply_job,
    command_job,
    condition,
    get_job,
    phase_is,
    wait_for_job,
)

SLEEP = "import time; time.sleep(600)"
SUCCEED = "import time; time.sleep(1)"


def pods_of(kubeconfig: str, namespace: str, job: str) -> list[dict]:
    out = kubectl("-n", namespace, "get", "pods", "-l", f"accelerate-operator.io/job-name={job}",
                  "-o", "json", kubeconfig=kubeconfig)
    return json.loads(out.stdout)["items"]


def test_children_are_created_with_topology_env_and_owner_references(kubeconfig, namespace):
    apply_job(kubeconfig, namespace, command_job("topo", SLEEP, nodes=3).build())
    pods = wait_for(lambda: (p := pods_of(kubeconfig, namespace, "topo")) and len(p) == 3 and p,
                    timeout=60, description="3 pods")
    job = get_job(kubeconfig, namespace, "topo")
    for pod in pods:
        index = int(pod["metadata"]["labels"]["accelerate-operator.io/node-index"])
        assert pod["metadata"]["name"] == f"topo-{index}"
        assert pod["spec"]["hostname"] == f"topo-{index}" and pod["spec"]["subdomain"] == "topo"
        assert pod["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["NODE_RANK"] == str(index)
        assert env["MASTER_ADDR"] == "topo-0.topo"
        assert (env["NUM_NODES"], env["NPROC_PER_NODE"], env["WORLD_SIZE"]) == ("3", "1", "3")
    service = json.loads(kubectl("-n", namespace, "get", "service", "topo", "-o", "json",
                                 kubeconfig=kubeconfig).stdout)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    config = kubectl("-n", namespace, "get", "configmap", "topo-accelerate-config", "-o",
                     "jsonpath={.data.config\\.yaml}", kubeconfig=kubeconfig).stdout
    assert "num_machines: 3" in config and "num_processes: 3" in config

    running = wait_for_job(kubeconfig, namespace, "topo", phase_is("Running"), timeout=90)
    assert running["status"]["readyNodes"] == "3/3"
    assert condition(running, "Running")["status"] == "True"
    printed = kubectl("-n", namespace, "get", "ajob", "topo", kubeconfig=kubeconfig).stdout
    assert "Running" in printed and "3/3" in printed

    kubectl("-n", namespace, "delete", "acceleratejob", "topo", "--wait=true",
            kubeconfig=kubeconfig)
    wait_for(lambda: not pods_of(kubeconfig, namespace, "topo"), timeout=90,
             description="the garbage collector to delete the pods")
    wait_for(lambda: kubectl("-n", namespace, "get", "configmap", "topo-accelerate-config",
                             kubeconfig=kubeconfig, check=False).returncode != 0,
             timeout=60, description="the garbage collector to delete the ConfigMap")


def test_job_succeeds_only_when_every_node_succeeded(kubeconfig, namespace):
    # Node 1 finishes soon after both run; node 0 keeps running a while: the job must stay
    # Running. (A pod counts as Succeeded as soon as its container exits 0, so a node 1 that
    # ended before node 0 even started would leave the job Pending, not Running.)
    script = ("import os, time; time.sleep(3 if os.environ['NODE_RANK'] == '1' else 12)")
    apply_job(kubeconfig, namespace, command_job("finish", script).build())
    wait_for_job(kubeconfig, namespace, "finish", phase_is("Running"), timeout=90)
    wait_for_job(kubeconfig, namespace, "finish",
                 lambda j: j.get("status", {}).get("nodes", {}).get("succeeded") == 1,
                 timeout=90, description="one node succeeded")
    assert get_job(kubeconfig, namespace, "finish")["status"]["phase"] == "Running"
    done = wait_for_job(kubeconfig, namespace, "finish", phase_is("Succeeded"), timeout=90)
    assert condition(done, "Succeeded")["reason"] == "AllNodesSucceeded"
    assert done["status"]["completionTime"]


def test_ttl_deletes_a_finished_job_and_its_children(kubeconfig, namespace):
    apply_job(kubeconfig, namespace,
              command_job("ttl", SUCCEED).run_policy(ttlSecondsAfterFinished=3).build())
    wait_for_job(kubeconfig, namespace, "ttl", phase_is("Succeeded"), timeout=90)
    wait_for(lambda: not get_job(kubeconfig, namespace, "ttl"), timeout=60,
             description="the TTL to delete the job")
    wait_for(lambda: not pods_of(kubeconfig, namespace, "ttl"), timeout=60,
             description="the children to be garbage-collected")


def test_clean_pod_policy_all_removes_finished_pods(kubeconfig, namespace):
    apply_job(kubeconfig, namespace,
              command_job("clean", SUCCEED).run_policy(cleanPodPolicy="All").build())
    wait_for_job(kubeconfig, namespace, "clean", phase_is("Succeeded"), timeout=90)
    wait_for(lambda: not pods_of(kubeconfig, namespace, "clean"), timeout=60,
             description="cleanPodPolicy All to delete the finished pods")


def test_clean_pod_policy_none_keeps_finished_pods_for_their_logs(kubeconfig, namespace):
    apply_job(kubeconfig, namespace,
              command_job("keep", SUCCEED).run_policy(cleanPodPolicy="None").build())
    wait_for_job(kubeconfig, namespace, "keep", phase_is("Succeeded"), timeout=90)
    assert len(pods_of(kubeconfig, namespace, "keep")) == 2
