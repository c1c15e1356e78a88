"""End to end: the CPU example applied with kubectl, trained by the real `accelerate launch` in
pods the operator created, to Succeeded; then the pods' logs prove it was really distributed."""

from __future__ import annotations

import json
import re

from devtools.cluster import ROOT, kubectl

EXAMPLE = ROOT / "examples" / "cpu-ddp.yaml"


def job_status(kubeconfig: str, namespace: str, name: str) -> dict:
    out = kubectl("-n", namespace, "get", "acceleratejob", name, "-o", "json",
                  kubeconfig=kubeconfig)
    return json.loads(out.stdout).get("status", {})


def test_cpu_example_trains_four_ranks_to_succeeded(kubeconfig: str, namespace: str):
    kubectl("-n", namespace, "apply", "-f", str(EXAMPLE), kubeconfig=kubeconfig)
    waited = kubectl("-n", namespace, "wait", "--for=condition=Succeeded", "acceleratejob/cpu-ddp",
                     "--timeout=600s", kubeconfig=kubeconfig, check=False, timeout=660)
    status = job_status(kubeconfig, namespace, "cpu-ddp")
    assert waited.returncode == 0, f"job did not succeed: {json.dumps(status, indent=1)}"
    assert status["phase"] == "Succeeded"
    assert status["restarts"] == 0
    assert status["nodes"]["succeeded"] == 2

    logs = {i: kubectl("-n", namespace, "logs", f"cpu-ddp-{i}", kubeconfig=kubeconfig).stdout
            for i in range(2)}
    ranks = {}
    for node, text in logs.items():
        for rank, world, node_rank in re.findall(
                r"RANK_INFO rank=(\d+) local_rank=\d+ world_size=(\d+) node_rank=(\d+)", text):
            assert world == "4" and int(node_rank) == node
            ranks[int(rank)] = node
    assert sorted(ranks) == [0, 1, 2, 3], f"ranks seen: {ranks}"
    assert sorted(set(ranks.values())) == [0, 1]

    checksums = {checksum for text in logs.values()
                 for checksum in re.findall(r"FINAL rank=\d+ param_checksum=(\S+)", text)}
    assert len(checksums) == 1, f"weights differ across ranks: {checksums}"
    done = re.search(r"TRAINING_DONE steps=(\d+) first_loss=(\S+) last_loss=(\S+)", logs[0])
    assert done, logs[0][-2000:]
    steps, first, last = int(done.group(1)), float(done.group(2)), float(done.group(3))
    assert steps == 40
    assert last < first * 0.7, f"loss did not go down enough: {first} -> {last}"

    events = kubectl("-n", namespace, "get", "events", "--field-selector",
                     "involvedObject.kind=AccelerateJob", "-o", "json", kubeconfig=kubeconfig)
    reasons = [e["reason"] for e in json.loads(events.stdout)["items"]]
    assert {"PodsCreated", "AllNodesRunning", "AllNodesSucceeded"} <= set(reasons)
