"""End to end: every config accelerate ships (tests/accelerate_corpus), unchanged, in one
ConfigMap with the DeepSpeed JSON beside it, each named by a job that gives no topology of its
own, on CPU pods. What must happen is tests/helpers/corpus.py's table: a file that can run on CPU
trains to Succeeded (2 steps) and its pods log the world size its YAML asked for, with the
ConfigWarnings condition naming exactly the values accelerate would ignore; a GPU-only one
fails (InvalidConfig, exit 78, no restart) with the reason named; one the operator can refuse
alone fails before any pod exists. Plus the issue's case: the multi-node template switched to
MULTI_CPU keeps its port 9999 and trains over 2 pods x 4 processes.

Every job is applied at once and checked as each finishes, so the run costs about as long as the
slowest job: the failing ones stop at validation within seconds of their pod starting."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from devtools.cluster import kubectl
from devtools.images import TRAINER_CPU_IMAGE
from tests.helpers.corpus import CORPUS, CORPUS_TABLE, DEEPSPEED_JSONS, TEMPLATES
from tests.helpers.jobs import JobBuilder, wait_until_finished
from tests.helpers.training import IMAGE_TRAIN_SCRIPT

pytestmark = pytest.mark.timeout(900)

IMAGE = TRAINER_CPU_IMAGE
CONFIGMAP = "accelerate-corpus"
MULTI_NODE_CPU = "multi_node_cpu.yaml"


def key_of(relative: str) -> str:
    """ConfigMap keys are flat: `test_configs/fsdp.yaml` -> `test_configs.fsdp.yaml`."""
    return relative.replace("/", ".")


def job_name(relative: str) -> str:
    stem = re.sub(r"[^a-z0-9]+", "-", Path(relative).stem.lower()).strip("-")
    return ("t-" if relative.startswith("config_yaml_templates") else "c-") + stem


def corpus_job(name: str, key: str, **spec) -> dict:
    return (JobBuilder(name).for_server().config_from(CONFIGMAP, key)
            .unset("numNodes", "numProcPerNode", "masterPort")
            .run_policy(backoffLimit=0, cleanPodPolicy="None").grace(1)
            .image(IMAGE).args(str(IMAGE_TRAIN_SCRIPT), "--max-steps=2", "--log-every=1")
            .env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
            .container(resources={"requests": {"cpu": "10m", "memory": "64Mi"}})
            .spec(**spec).build())


def multi_node_on_cpu() -> str:
    config = yaml.safe_load((TEMPLATES / "multi_node.yaml").read_text())
    config.update(distributed_type="MULTI_CPU", use_cpu=True)
    return yaml.safe_dump(config)


def logged_world_sizes(kubeconfig: str, namespace: str, name: str, nodes: int) -> set[int]:
    sizes = set()
    for index in range(nodes):
        text = kubectl("-n", namespace, "logs", f"{name}-{index}", kubeconfig=kubeconfig).stdout
        sizes |= {int(w) for w in re.findall(r"RANK_INFO rank=\d+ local_rank=\d+ world_size=(\d+)",
                                             text)}
    return sizes


def test_every_accelerate_config_trains_on_cpu_or_fails_naming_why(kubeconfig: str,
                                                                    namespace: str):
    data = {key_of(rel): (CORPUS / rel).read_text() for rel in CORPUS_TABLE}
    data |= {p.name: p.read_text() for p in DEEPSPEED_JSONS.glob("*.json")}
    data[MULTI_NODE_CPU] = multi_node_on_cpu()
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CONFIGMAP},
                 "data": data}
    jobs = {job_name(rel): corpus_job(job_name(rel), key_of(rel)) for rel in CORPUS_TABLE}
    # The case: nodes and processes from the spec, the port (9999) from the YAML.
    jobs["multi-node-cpu"] = corpus_job("multi-node-cpu", MULTI_NODE_CPU,
                                        numNodes=2, numProcPerNode=4)
    kubectl("-n", namespace, "apply", "-f", "-", kubeconfig=kubeconfig,
            input=json.dumps({"apiVersion": "v1", "kind": "List",
                              "items": [configmap, *jobs.values()]}))

    statuses = wait_until_finished(kubeconfig, namespace, list(jobs), timeout=840)
    record = {}
    problems = []
    for relative, expect in CORPUS_TABLE.items():
        name = job_name(relative)
        status = statuses[name]
        failed = next((c for c in status.get("conditions", []) if c["type"] == "Failed"), {})
        record[relative] = (status.get("phase"), status.get("topology", {}).get("summary"),
                            failed.get("message", "")[:160])
        if expect.render or expect.on_cpu_pod:
            wanted = expect.render or expect.on_cpu_pod
            if status.get("phase") != "Failed" or wanted not in failed.get("message", ""):
                problems.append(f"{relative}: expected Failed naming {wanted!r}, "
                                f"got {record[relative]}")
            elif failed.get("reason") != "InvalidConfig" or status.get("restarts"):
                problems.append(f"{relative}: expected InvalidConfig without restarts: {status}")
            if expect.render:
                pods = kubectl("-n", namespace, "get", "pods", "-l",
                               f"accelerate-operator.io/job-name={name}", "-o", "name",
                               kubeconfig=kubeconfig).stdout.split()
                if pods:
                    problems.append(f"{relative}: refused at render, yet pods exist: {pods}")
            continue
        if status.get("phase") != "Succeeded":
            problems.append(f"{relative}: expected Succeeded, got {record[relative]}")
            continue
        warned = next((c for c in status.get("conditions", [])
                       if c["type"] == "ConfigWarnings"), {}).get("message", "")
        missing = [w for w in expect.warns if w not in warned]
        if missing or (warned and not expect.warns):
            problems.append(f"{relative}: ConfigWarnings {warned!r}, expected {expect.warns}")
        nodes, procs, _ = expect.topology
        sizes = logged_world_sizes(kubeconfig, namespace, name, nodes)
        if sizes != {nodes * procs}:
            problems.append(f"{relative}: world size logged {sizes}, expected {nodes * procs}")

    multi = statuses["multi-node-cpu"]
    record["multi-node-cpu"] = (multi.get("phase"), multi.get("topology"), "")
    if multi.get("phase") != "Succeeded" or multi.get("topology") != {
            "numNodes": 2, "numProcPerNode": 4, "worldSize": 8, "masterPort": 9999,
            "summary": "2x4"}:
        problems.append(f"multi_node (MULTI_CPU): {multi}")
    elif logged_world_sizes(kubeconfig, namespace, "multi-node-cpu", 2) != {8}:
        problems.append("multi_node (MULTI_CPU): not every rank logged world size 8")
    print(json.dumps(record, indent=1))
    assert not problems, "\n".join(problems)
