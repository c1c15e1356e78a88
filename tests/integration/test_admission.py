"""Admission against the REAL API server: malformed AccelerateJobs are refused by the CRD's schema
and CEL rules, with a message that names the field and the fix; the examples pass; and the failures
only the operator can see (a ConfigMap that is missing, not YAML, or contradicts the job) fail the
job loudly without stopping the operator from serving other jobs.

Every malformed case goes through `kubectl apply --dry-run=server` (kubectl's default, strict field
validation) into one namespace; a valid base job passes the same path, so each refusal is due to
the one thing the case changes. A case the CRD should refuse but does not is an xfail(strict=True)
test whose reason names the CRD change that fixes it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from accelerate_trainer.contract import JOB_NAME_LABEL

from devtools.cluster import (
    ROOT,
    create_namespace,
    delete_namespace,
    kubectl,
    kubectl_json,
    wait_for,
)
from devtools.images import PYTHON_IMAGE
from tests.helpers.jobs import JobBuilder

pytestmark = pytest.mark.cluster

SLEEP = ["python3", "-c", "import time; time.sleep(20)"]


def read(*args: str, kubeconfig: str) -> dict[str, Any]:
    """A read through kubectl that rides out a short API server restart (the local cluster is
    shared and may be restarted under us)."""
    return wait_for(lambda: [kubectl_json(*args, kubeconfig=kubeconfig)], timeout=60,
                    description=f"kubectl {' '.join(args)}")[0]


def valid_job(name: str = "adm", namespace: str = "default", nodes: int = 2,
              procs: int | str = 2) -> dict[str, Any]:
    """A job the server accepts: cheap container, inline config, no topology keys."""
    return (JobBuilder(name, namespace).nodes(nodes).procs(procs)
            .config(compute_environment="LOCAL_MACHINE", distributed_type="MULTI_CPU",
                    use_cpu=True, mixed_precision="no")
            .container(image=PYTHON_IMAGE, command=SLEEP, args=[]).grace(1)
            .for_server(namespace).build())


def server_apply(kubeconfig: str, body: dict[str, Any], *args: str,
                 dry_run: bool = True) -> Any:
    extra = ["--dry-run=server"] if dry_run else []
    return kubectl("apply", *extra, *args, "-f", "-", kubeconfig=kubeconfig, check=False,
                   input=json.dumps(body))


def assert_refused(proc: Any, expected: list[str]) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"the API server accepted it:\n{output}"
    assert "created" not in proc.stdout and "configured" not in proc.stdout, output
    for text in expected:
        assert text in proc.stderr, (f"the refusal does not say {text!r}; the server said:\n"
                                     f"{proc.stderr}")


@pytest.fixture(scope="module")
def admission_ns(kubeconfig: str) -> Iterator[str]:
    """One namespace for every dry run of this module (dry runs leave nothing behind)."""
    name = create_namespace(kubeconfig, prefix="admission")
    yield name
    delete_namespace(kubeconfig, name)


# --- the malformed cases ----------------------------------------------------------------------

Mutation = Callable[[dict[str, Any]], None]


def spec(**values: Any) -> Mutation:
    return lambda body: body["spec"].update(values)


def config(**values: Any) -> Mutation:
    return lambda body: body["spec"]["accelerateConfig"].update(values)


def replace_config(**values: Any) -> Mutation:
    return lambda body: body["spec"].update(accelerateConfig=dict(values))


def pod_spec(**values: Any) -> Mutation:
    return lambda body: body["spec"]["template"]["spec"].update(values)


def trainer(**values: Any) -> Mutation:
    return lambda body: body["spec"]["template"]["spec"]["containers"][0].update(values)


def run_policy(**values: Any) -> Mutation:
    return lambda body: body["spec"].setdefault("runPolicy", {}).update(values)


def name(value: str) -> Mutation:
    return lambda body: body["metadata"].update(name=value)


def chain(*mutations: Mutation) -> Mutation:
    def apply(body: dict[str, Any]) -> None:
        for mutation in mutations:
            mutation(body)
    return apply


def drop(*path: str) -> Mutation:
    def apply(body: dict[str, Any]) -> None:
        node = body
        for key in path[:-1]:
            node = node[key]
        node.pop(path[-1])
    return apply


def config_from(**ref: str) -> Mutation:
    return chain(drop("spec", "accelerateConfig"),
                 spec(accelerateConfigFrom={"configMapKeyRef": dict(ref)}))


def reserved_env(env_name: str) -> Mutation:
    return trainer(env=[{"name": "OMP_NUM_THREADS", "value": "1"},
                        {"name": env_name, "value": "x"}])


ONE_OF = ("set exactly one of spec.accelerateConfig (the accelerate YAML inline) or "
          "spec.accelerateConfigFrom (a ConfigMap holding it)")
NPROC = 'spec.numProcPerNode must be a positive integer or "auto"'
RESERVED = "env sets a name the operator reserves"
RESERVED_FIX = "remove it: the topology comes from spec.numNodes, spec.numProcPerNode"
HOSTNAME = ("spec.template.spec.hostname and subdomain are set by the operator "
            "(<job>-<index> under the Service <job>); remove them")
RESTART = "spec.template.spec.restartPolicy must be Never (or left out)"
TOO_LONG = ("metadata.name is too long: the pod hostname '<name>-<index>' must fit in 63 "
            "characters; shorten the job name")
DNS1035 = ("metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting "
           "with a letter)")
CHECKPOINT = "spec.checkpoint.volumeName must name a volume of spec.template.spec.volumes"
DEEPSPEED = ("DeepSpeed across several nodes needs "
             "spec.accelerateConfig.deepspeed_config.deepspeed_multinode_launcher: standard")
ELASTIC_CHECKPOINT = ("spec.elastic needs spec.checkpoint: each resize restarts the group from "
                      "its last complete checkpoint")
ELASTIC_MIN = "spec.elastic.minNodes must be at most numNodes (the size the job wants)"
ELASTIC_DIVIDES = ("spec.elastic.minNodes must divide numNodes x "
                   "spec.elastic.gradientAccumulationSteps")
ELASTIC_WAIT = ("spec.elastic.shrinkAfterSeconds must be less than "
                "spec.runPolicy.waitingTimeoutSeconds")
ELASTIC_ENV = ("an elastic job's trainer container may not set "
               "ACCELERATE_GRADIENT_ACCUMULATION_STEPS")


def elastic(**values: Any) -> Mutation:
    """spec.elastic on a job with a checkpoint volume, as an elastic job needs."""
    return chain(spec(elastic=values, checkpoint={"volumeName": "ckpt"}),
                 pod_spec(volumes=[{"name": "ckpt", "emptyDir": {}}]))


MALFORMED = [
    # numNodes
    pytest.param(spec(numNodes=-1), ["spec.numNodes: Invalid value: -1",
                                     "spec.numNodes in body should be greater than or equal to 1"],
                 id="numNodes-negative"),
    pytest.param(spec(numNodes=0), ["spec.numNodes: Invalid value: 0",
                                    "spec.numNodes in body should be greater than or equal to 1"],
                 id="numNodes-zero"),
    pytest.param(spec(numNodes="two"), ["spec.numNodes in body must be of type integer"],
                 id="numNodes-string"),
    pytest.param(spec(numNodes=1025),
                 ["spec.numNodes in body should be less than or equal to 1024"],
                 id="numNodes-over-1024"),
    # numProcPerNode
    pytest.param(spec(numProcPerNode=0), ["spec.numProcPerNode", NPROC], id="numProcPerNode-0"),
    pytest.param(spec(numProcPerNode=-1), ["spec.numProcPerNode", NPROC], id="numProcPerNode-neg"),
    pytest.param(spec(numProcPerNode="many"), ["spec.numProcPerNode", NPROC],
                 id="numProcPerNode-many"),
    pytest.param(spec(numProcPerNode=2.5),
                 ["spec.numProcPerNode in body must be of type integer,string"],
                 id="numProcPerNode-2.5"),
    # where the accelerate config comes from
    pytest.param(spec(accelerateConfigFrom={"configMapKeyRef": {"name": "cfg", "key": "c.yaml"}}),
                 [ONE_OF], id="both-config-and-config-from"),
    pytest.param(drop("spec", "accelerateConfig"), [ONE_OF], id="neither-config-nor-config-from"),
    pytest.param(config_from(name="cfg"),
                 ["spec.accelerateConfigFrom.configMapKeyRef.key: Required value"],
                 id="config-from-without-key"),
    pytest.param(config_from(name="", key="c.yaml"),
                 ["spec.accelerateConfigFrom.configMapKeyRef.name",
                  "should be at least 1 chars long"], id="config-from-empty-name"),
    # accelerate's own keys
    pytest.param(config(distributed_type="MULTI_GPUS"),
                 ['spec.accelerateConfig.distributed_type: Unsupported value: "MULTI_GPUS"',
                  '"MULTI_GPU"', '"MULTI_CPU"'], id="distributed_type-MULTI_GPUS"),
    pytest.param(config(mixed_precision="fp32"),
                 ['spec.accelerateConfig.mixed_precision: Unsupported value: "fp32"',
                  'supported values: "no", "fp16", "bf16", "fp8"'], id="mixed_precision-fp32"),
    pytest.param(config(mixed_precision=False),
                 ["spec.accelerateConfig.mixed_precision in body must be of type string"],
                 id="mixed_precision-bare-no-read-as-false"),
    pytest.param(config(num_gpus=2),
                 ['unknown field "spec.accelerateConfig.num_gpus"'], id="unknown-accelerate-key"),
    pytest.param(spec(replicas=2), ['unknown field "spec.replicas"'], id="unknown-spec-field"),
    pytest.param(replace_config(distributed_type="FSDP", fsdp_config={"fsdp_version": 3}),
                 ["spec.accelerateConfig.fsdp_config.fsdp_version: Unsupported value: 3"],
                 id="fsdp_version-3"),
    pytest.param(replace_config(distributed_type="DEEPSPEED",
                                deepspeed_config={"zero_stage": 4,
                                                  "deepspeed_multinode_launcher": "standard"}),
                 ["spec.accelerateConfig.deepspeed_config.zero_stage: Unsupported value: 4"],
                 id="zero_stage-4"),
    # topology keys that contradict the job
    pytest.param(config(num_machines=3),
                 ["spec.accelerateConfig.num_machines contradicts spec.numNodes",
                  "remove one or make them equal"], id="num_machines-contradicts-numNodes"),
    pytest.param(config(num_processes=3),
                 ["spec.accelerateConfig.num_processes (the TOTAL over all machines) contradicts "
                  "spec.numNodes x spec.numProcPerNode", "remove num_processes or make it equal"],
                 id="num_processes-contradicts-numNodes-x-numProcPerNode"),
    pytest.param(config(num_processes=2),  # the per-node count, the classic mistake
                 ["spec.accelerateConfig.num_processes (the TOTAL over all machines) contradicts"],
                 id="num_processes-per-node-instead-of-total"),
    pytest.param(config(main_process_port=29501),
                 ["spec.accelerateConfig.main_process_port contradicts spec.masterPort",
                  "remove one or make them equal"],
                 id="main_process_port-contradicts-masterPort"),
    # topology from the YAML alone: num_processes must divide over the machines
    pytest.param(chain(drop("spec", "numNodes"), drop("spec", "numProcPerNode"),
                       config(num_machines=2, num_processes=3)),
                 ["spec.accelerateConfig.num_processes (the TOTAL over all machines)",
                  "does not divide evenly over the machines"],
                 id="yaml-num_processes-not-divisible-by-num_machines"),
    pytest.param(chain(drop("spec", "numNodes"), config(num_machines=3, num_processes=4)),
                 ["spec.accelerateConfig.num_processes (the TOTAL over all machines) contradicts"],
                 id="yaml-num_machines-times-spec-procs-contradicts-num_processes"),
    # numProcPerNode auto: the operator checks num_processes once it is resolved; it must divide
    pytest.param(chain(spec(numProcPerNode="auto"), config(num_processes=15)),
                 ["spec.accelerateConfig.num_processes (the TOTAL over all machines)",
                  "does not divide evenly over the machines"],
                 id="auto-procs-num_processes-not-divisible-by-numNodes"),
    pytest.param(config(num_machines=1025),
                 ["spec.accelerateConfig.num_machines in body should be less than or equal to "
                  "1024"], id="yaml-num_machines-above-1024"),
    pytest.param(chain(name("a" * 61), drop("spec", "numNodes"), config(num_machines=11),
                       spec(numProcPerNode=1)), [TOO_LONG],
                 id="name-too-long-for-num_machines-from-the-yaml"),
    pytest.param(spec(accelerateConfigFiles={"ds.json": 3}),
                 ["spec.accelerateConfigFiles.ds.json in body must be of type string"],
                 id="accelerateConfigFiles-not-text"),
    pytest.param(spec(masterPort=0),
                 ["spec.masterPort in body should be greater than or equal to 1024"],
                 id="masterPort-0"),
    pytest.param(spec(masterPort=70000),
                 ["spec.masterPort in body should be less than or equal to 65535"],
                 id="masterPort-70000"),
    # distribution that cannot work across pods
    pytest.param(
        config(distributed_type="NO"),
        ["spec.accelerateConfig.distributed_type NO runs a single process",
         "use MULTI_GPU (or MULTI_CPU with use_cpu: true)"],
        id="distributed_type-NO-with-2-nodes"),
    pytest.param(replace_config(distributed_type="DEEPSPEED",
                                deepspeed_config={"zero_stage": 2,
                                                  "deepspeed_multinode_launcher": "pdsh"}),
                 [DEEPSPEED, "pdsh and the others need SSH between pods"],
                 id="deepspeed-multinode-pdsh"),
    # the pod template
    pytest.param(pod_spec(containers=[]),
                 ["spec.template.spec.containers in body should have at least 1 items"],
                 id="template-no-containers"),
    pytest.param(drop("spec", "template", "spec", "containers"),
                 ["spec.template.spec.containers: Required value"],
                 id="template-containers-missing"),
    pytest.param(lambda body: body["spec"]["template"]["spec"]["containers"][0].pop("image"),
                 ["spec.template.spec.containers[0].image: Required value"],
                 id="container-without-image"),
    pytest.param(trainer(image=""),
                 ["spec.template.spec.containers[0].image", "should be at least 1 chars long"],
                 id="container-empty-image"),
    pytest.param(reserved_env("MASTER_ADDR"),
                 ["spec.template.spec.containers[0].env", RESERVED, RESERVED_FIX],
                 id="reserved-env-MASTER_ADDR"),
    pytest.param(reserved_env("WORLD_SIZE"),
                 ["spec.template.spec.containers[0].env", RESERVED, RESERVED_FIX],
                 id="reserved-env-WORLD_SIZE"),
    pytest.param(reserved_env("PET_NNODES"),
                 ["spec.template.spec.containers[0].env", RESERVED, "PET_*"],
                 id="reserved-env-PET_NNODES"),
    pytest.param(lambda b: b["spec"]["template"]["spec"]["containers"].append(
                     {"name": "sidecar", "image": "busybox",
                      "env": [{"name": "NODE_RANK", "value": "0"}]}),
                 ["spec.template.spec.containers[1].env", RESERVED], id="reserved-env-in-sidecar"),
    pytest.param(pod_spec(hostname="node"), [HOSTNAME], id="template-hostname"),
    pytest.param(pod_spec(subdomain="mine"), [HOSTNAME], id="template-subdomain"),
    pytest.param(pod_spec(restartPolicy="OnFailure"),
                 [RESTART, "see spec.runPolicy.backoffLimit"],
                 id="template-restartPolicy-OnFailure"),
    pytest.param(pod_spec(restartPolicy="Always"), [RESTART], id="template-restartPolicy-Always"),
    # names: pods are <name>-<index> and hostnames under the headless Service <name>
    pytest.param(name("a" * 62), [TOO_LONG], id="name-too-long-for-pod-hostname"),
    pytest.param(chain(name("a" * 61), spec(numNodes=11)), [TOO_LONG],
                 id="name-too-long-for-two-digit-index"),
    pytest.param(name("Train"), [DNS1035], id="name-uppercase"),
    pytest.param(name("1train"), [DNS1035], id="name-starts-with-digit"),
    pytest.param(name("my.train"), [DNS1035], id="name-with-dot"),
    # checkpoint
    pytest.param(spec(checkpoint={"volumeName": "ckpt"}), [CHECKPOINT],
                 id="checkpoint-volume-without-volumes"),
    pytest.param(chain(spec(checkpoint={"volumeName": "ckpt"}),
                       pod_spec(volumes=[{"name": "data", "emptyDir": {}}])), [CHECKPOINT],
                 id="checkpoint-volume-not-among-volumes"),
    pytest.param(chain(spec(checkpoint={"volumeName": "ckpt", "mountPath": "ckpt"}),
                       pod_spec(volumes=[{"name": "ckpt", "emptyDir": {}}])),
                 ["spec.checkpoint.mountPath in body should match '^/'"],
                 id="checkpoint-relative-mountPath"),
    # elastic
    pytest.param(spec(elastic={"minNodes": 1, "gradientAccumulationSteps": 1}),
                 [ELASTIC_CHECKPOINT], id="elastic-without-checkpoint"),
    pytest.param(elastic(minNodes=3, gradientAccumulationSteps=3), [ELASTIC_MIN],
                 id="elastic-minNodes-above-numNodes"),
    pytest.param(chain(drop("spec", "numNodes"), drop("spec", "numProcPerNode"),
                       config(num_machines=2), elastic(minNodes=3, gradientAccumulationSteps=3)),
                 [ELASTIC_MIN], id="elastic-minNodes-above-yaml-num_machines"),
    pytest.param(chain(spec(numNodes=4), elastic(minNodes=3, gradientAccumulationSteps=1)),
                 [ELASTIC_DIVIDES], id="elastic-minNodes-does-not-divide"),
    pytest.param(elastic(minNodes=0, gradientAccumulationSteps=1),
                 ["spec.elastic.minNodes in body should be greater than or equal to 1"],
                 id="elastic-minNodes-0"),
    pytest.param(elastic(minNodes=1), ["spec.elastic.gradientAccumulationSteps: Required value"],
                 id="elastic-without-accumulation"),
    pytest.param(chain(elastic(minNodes=1, gradientAccumulationSteps=1, shrinkAfterSeconds=900)),
                 [ELASTIC_WAIT], id="elastic-shrinks-after-the-job-fails"),
    pytest.param(chain(elastic(minNodes=1, gradientAccumulationSteps=1),
                       trainer(env=[{"name": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                                     "value": "8"}])),
                 [ELASTIC_ENV], id="elastic-with-its-own-accumulation-env"),
    # runPolicy
    pytest.param(run_policy(cleanPodPolicy="Always"),
                 ['spec.runPolicy.cleanPodPolicy: Unsupported value: "Always"',
                  'supported values: "Running", "All", "None"'], id="cleanPodPolicy-invalid"),
    pytest.param(run_policy(backoffLimit=-1),
                 ["spec.runPolicy.backoffLimit in body should be greater than or equal to 0"],
                 id="backoffLimit-negative"),
    pytest.param(run_policy(activeDeadlineSeconds=0),
                 ["spec.runPolicy.activeDeadlineSeconds in body should be greater than or equal "
                  "to 1"], id="activeDeadlineSeconds-0"),
    pytest.param(run_policy(permanentExitCodes=[0]),
                 ["spec.runPolicy.permanentExitCodes[0] in body should be greater than or equal "
                  "to 1"], id="permanentExitCodes-0"),
]


def test_the_valid_base_job_passes_server_dry_run(kubeconfig: str, admission_ns: str):
    """The control for every case below: only the mutation makes them fail."""
    proc = server_apply(kubeconfig, valid_job(namespace=admission_ns))
    assert proc.returncode == 0, proc.stderr
    assert "created (server dry run)" in proc.stdout


@pytest.mark.parametrize(("mutate", "expected"), MALFORMED)
def test_malformed_job_is_refused_with_a_message_naming_field_and_fix(
        kubeconfig: str, admission_ns: str, mutate: Mutation, expected: list[str]):
    body = valid_job(namespace=admission_ns)
    mutate(body)
    assert_refused(server_apply(kubeconfig, body), expected)


@pytest.mark.parametrize(("job_name", "nodes"), [("a" * 61, 2), ("a" * 60, 11), ("b" * 61, 1)],
                         ids=["61-chars-2-nodes", "60-chars-11-nodes", "61-chars-1-node"])
def test_longest_names_that_fit_a_pod_hostname_are_accepted(
        kubeconfig: str, admission_ns: str, job_name: str, nodes: int):
    """The boundary of the hostname rule: '<name>-<highest index>' of exactly 63 characters."""
    body = valid_job(job_name, admission_ns, nodes=nodes, procs=1)
    proc = server_apply(kubeconfig, body)
    assert proc.returncode == 0, proc.stderr


def test_an_elastic_job_is_accepted_with_its_wait_defaulted(kubeconfig: str, admission_ns: str):
    """The control of the elastic cases: 4 nodes x accumulation 3 may shrink to 3 or 2."""
    body = valid_job("elastic", admission_ns, nodes=4)
    elastic(minNodes=2, gradientAccumulationSteps=3)(body)
    proc = server_apply(kubeconfig, body, "-o", "json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["spec"]["elastic"] == {
        "minNodes": 2, "gradientAccumulationSteps": 3, "shrinkAfterSeconds": 120}


def test_topology_left_out_of_the_spec_is_not_defaulted(kubeconfig: str, admission_ns: str):
    """No numNodes, numProcPerNode or masterPort is written into the object: the operator takes
    them from the accelerate YAML (here its num_machines, num_processes and main_process_port)."""
    body = valid_job(namespace=admission_ns)
    for key in ("numNodes", "numProcPerNode", "masterPort"):
        del body["spec"][key]
    body["spec"]["accelerateConfig"].update(num_machines=2, num_processes=8,
                                            main_process_port=9999)
    proc = server_apply(kubeconfig, body, "-o", "json")
    assert proc.returncode == 0, proc.stderr
    stored = json.loads(proc.stdout)["spec"]
    assert not {"numNodes", "numProcPerNode", "masterPort"} & set(stored), stored


def test_spec_and_yaml_may_each_give_part_of_the_topology(kubeconfig: str, admission_ns: str):
    """The issue's case: numNodes and numProcPerNode in the spec, the port from the YAML."""
    body = valid_job(namespace=admission_ns, nodes=2, procs=4)
    del body["spec"]["masterPort"]
    body["spec"]["accelerateConfig"].update(num_machines=2, num_processes=8,
                                            main_process_port=9999)
    proc = server_apply(kubeconfig, body)
    assert proc.returncode == 0, proc.stderr


def test_files_beside_the_config_are_accepted(kubeconfig: str, admission_ns: str):
    body = valid_job(namespace=admission_ns)
    body["spec"]["accelerateConfigFiles"] = {"ds_config.json": '{"zero_optimization": {}}'}
    proc = server_apply(kubeconfig, body)
    assert proc.returncode == 0, proc.stderr


def test_consistent_topology_keys_are_accepted(kubeconfig: str, admission_ns: str):
    body = valid_job(namespace=admission_ns)
    body["spec"]["accelerateConfig"].update(num_machines=2, num_processes=4,
                                            main_process_port=29500)
    proc = server_apply(kubeconfig, body)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("procs", [1, "auto"])
def test_distributed_type_no_is_accepted_for_one_process(kubeconfig: str, admission_ns: str,
                                                        procs: int | str):
    """With "auto" the GPU limit decides, which the operator checks once it has resolved it."""
    body = valid_job(namespace=admission_ns, nodes=1, procs=procs)
    body["spec"]["accelerateConfig"] = {"distributed_type": "NO"}
    proc = server_apply(kubeconfig, body)
    assert proc.returncode == 0, proc.stderr


def test_auto_processes_with_the_yamls_num_processes_are_accepted(kubeconfig: str,
                                                                  admission_ns: str):
    """`accelerate config` always writes num_processes; with numProcPerNode "auto" the operator
    checks it against the GPU limit (as for a ConfigMap's YAML)."""
    body = valid_job(namespace=admission_ns, nodes=2, procs="auto")
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {
        "limits": {"nvidia.com/gpu": 8}}
    body["spec"]["accelerateConfig"].update(num_machines=2, num_processes=16)
    proc = server_apply(kubeconfig, body)
    assert proc.returncode == 0, proc.stderr


# --- immutability: create a job, then try to change it -------------------------------------------

IMMUTABLE_TOPOLOGY = ("spec.numNodes, spec.numProcPerNode and spec.masterPort are immutable; "
                      "delete the job and create it again")
IMMUTABLE_TEMPLATE = "spec.template is immutable; delete the job and create it again"
IMMUTABLE_CONFIG = ("spec.accelerateConfig, spec.accelerateConfigFrom and "
                    "spec.accelerateConfigFiles are immutable; delete the job and create it again")


@pytest.fixture(scope="module")
def existing_job(kubeconfig: str, admission_ns: str) -> dict[str, Any]:
    """A real job, suspended so it never runs a pod."""
    body = valid_job("immutable", admission_ns)
    body["spec"]["runPolicy"]["suspend"] = True
    proc = server_apply(kubeconfig, body, dry_run=False)
    assert proc.returncode == 0, proc.stderr
    return body


IMMUTABLE_PATCHES = [
    pytest.param({"spec": {"numNodes": 3}}, IMMUTABLE_TOPOLOGY, id="numNodes"),
    pytest.param({"spec": {"numProcPerNode": 1}}, IMMUTABLE_TOPOLOGY, id="numProcPerNode"),
    pytest.param({"spec": {"masterPort": 29600}}, IMMUTABLE_TOPOLOGY, id="masterPort"),
    pytest.param({"spec": {"masterPort": None}}, IMMUTABLE_TOPOLOGY, id="masterPort-removed"),
    pytest.param({"spec": {"accelerateConfigFiles": {"ds.json": "{}"}}}, IMMUTABLE_CONFIG,
                 id="accelerateConfigFiles-added"),
    pytest.param({"spec": {"template": {"spec": {"containers": [
        {"name": "trainer", "image": "python:3.13-slim", "command": SLEEP}]}}}},
        IMMUTABLE_TEMPLATE, id="template-image"),
    pytest.param({"spec": {"template": {"metadata": {"labels": {"team": "nlp"}}}}},
                 IMMUTABLE_TEMPLATE, id="template-labels"),
    pytest.param({"spec": {"accelerateConfig": {"mixed_precision": "bf16"}}}, IMMUTABLE_CONFIG,
                 id="accelerateConfig-value"),
    pytest.param({"spec": {"accelerateConfig": {"debug": True}}}, IMMUTABLE_CONFIG,
                 id="accelerateConfig-new-key"),
    pytest.param({"spec": {"accelerateConfig": None,
                           "accelerateConfigFrom": {"configMapKeyRef": {"name": "cfg",
                                                                        "key": "config.yaml"}}}},
                 IMMUTABLE_CONFIG, id="accelerateConfig-to-accelerateConfigFrom"),
    pytest.param({"spec": {"elastic": {"minNodes": 1, "gradientAccumulationSteps": 1}}},
                 "spec.elastic cannot be added or removed", id="elastic-added"),
]


@pytest.mark.parametrize(("patch", "expected"), IMMUTABLE_PATCHES)
def test_update_of_immutable_field_is_refused(kubeconfig: str, admission_ns: str,
                                              existing_job: dict, patch: dict, expected: str):
    proc = kubectl("-n", admission_ns, "patch", "acceleratejob", "immutable", "--type=merge",
                   "-p", json.dumps(patch), kubeconfig=kubeconfig, check=False)
    assert_refused(proc, [expected])


def test_apply_of_changed_topology_is_refused(kubeconfig: str, admission_ns: str,
                                              existing_job: dict):
    """The same through `kubectl apply` of an edited manifest, as users do it."""
    body = json.loads(json.dumps(existing_job))
    body["spec"]["numNodes"] = 4
    assert_refused(server_apply(kubeconfig, body, dry_run=False), [IMMUTABLE_TOPOLOGY])


def test_mutable_run_policy_can_still_be_changed(kubeconfig: str, admission_ns: str,
                                                 existing_job: dict):
    """The control of the immutability cases: runPolicy (suspend, backoffLimit) may change."""
    kubectl("-n", admission_ns, "patch", "acceleratejob", "immutable", "--type=merge", "-p",
            json.dumps({"spec": {"runPolicy": {"backoffLimit": 5}}}), kubeconfig=kubeconfig)
    got = read("-n", admission_ns, "get", "acceleratejob", "immutable",
                       kubeconfig=kubeconfig)
    assert got["spec"]["runPolicy"]["backoffLimit"] == 5
    assert got["spec"]["numNodes"] == 2


# --- the shipped examples -----------------------------------------------------------------------

EXAMPLES = sorted(p for p in (ROOT / "examples").iterdir() if p.suffix in (".yaml", ".yml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_passes_server_side_dry_run(kubeconfig: str, admission_ns: str, path: Path):
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert documents, f"{path} holds no object"
    for document in documents:
        document.setdefault("metadata", {})["namespace"] = admission_ns
    proc = kubectl("apply", "--dry-run=server", "-f", "-", kubeconfig=kubeconfig, check=False,
                   input=json.dumps({"apiVersion": "v1", "kind": "List", "items": documents}))
    assert proc.returncode == 0, f"{path.name} is refused:\n{proc.stderr}"
    assert not proc.stderr.strip(), f"{path.name} draws warnings:\n{proc.stderr}"


# --- what only the operator can know ------------------------------------------------------------

def job_status(kubeconfig: str, namespace: str, job: str) -> dict[str, Any]:
    return read("-n", namespace, "get", "acceleratejob", job,
                        kubeconfig=kubeconfig).get("status") or {}


def pods_of(kubeconfig: str, namespace: str, job: str) -> list[dict[str, Any]]:
    return read("-n", namespace, "get", "pods", "-l", f"{JOB_NAME_LABEL}={job}",
                        kubeconfig=kubeconfig)["items"]


def warning_events(kubeconfig: str, namespace: str, job: str) -> list[dict[str, Any]]:
    return read("-n", namespace, "get", "events", "--field-selector",
                        f"involvedObject.name={job},involvedObject.kind=AccelerateJob,"
                        "type=Warning", kubeconfig=kubeconfig)["items"]


def create(kubeconfig: str, namespace: str, *objects: dict[str, Any]) -> None:
    for obj in objects:
        obj.setdefault("metadata", {})["namespace"] = namespace
    kubectl("create", "-f", "-", kubeconfig=kubeconfig,
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))


def configmap(cm_name: str, text: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": cm_name},
            "data": {"config.yaml": text}}


def job_from_configmap(job: str, cm_name: str) -> dict[str, Any]:
    body = valid_job(job)
    del body["spec"]["accelerateConfig"]
    body["spec"]["accelerateConfigFrom"] = {"configMapKeyRef": {"name": cm_name,
                                                                "key": "config.yaml"}}
    return body


CORPUS = ROOT / "tests" / "accelerate_corpus"
DEEPSPEED_TEMPLATE = (CORPUS / "config_yaml_templates" / "deepspeed.yaml").read_text()


def with_files(cm: dict[str, Any], **files: str) -> dict[str, Any]:
    cm["data"].update(files)
    return cm


BAD_CONFIGMAPS = {
    # case: (ConfigMap to create or None, text in the Failed condition)
    "missing": (None, "which does not exist"),
    # accelerate's DeepSpeed template without the JSON it names, then with a broken one
    "deepspeed-json-missing": (configmap("accel-cfg", DEEPSPEED_TEMPLATE),
                               "zero_stage1_config.json' is not shipped with the config"),
    "deepspeed-json-malformed": (with_files(configmap("accel-cfg", DEEPSPEED_TEMPLATE),
                                            **{"zero_stage1_config.json": '{"fp16": {'}),
                                 "is not valid JSON"),
    "invalid-yaml": (configmap("accel-cfg", "distributed_type: [MULTI_CPU\n  use_cpu: {\n"),
                     "is not valid YAML"),
    "contradicts-numNodes": (configmap("accel-cfg", "distributed_type: MULTI_CPU\nuse_cpu: true\n"
                                                    "num_machines: 3\n"),
                             "num_machines=3 contradicts spec.numNodes = 2"),
}


def wait_failed_invalid_config(kubeconfig: str, namespace: str, job: str) -> dict[str, Any]:
    def failed() -> dict[str, Any] | None:
        status = job_status(kubeconfig, namespace, job)
        return status if status.get("phase") == "Failed" else None
    status = wait_for(failed, timeout=90, description=f"job {job} to be Failed")
    conditions = {c["type"]: c for c in status.get("conditions") or []}
    assert conditions["Failed"]["status"] == "True", status
    assert conditions["Failed"]["reason"] == "InvalidConfig", status
    return conditions["Failed"]


@pytest.mark.parametrize("case", list(BAD_CONFIGMAPS))
def test_bad_config_from_fails_the_job_with_invalid_config_and_no_pod(
        kubeconfig: str, namespace: str, case: str):
    cm, says = BAD_CONFIGMAPS[case]
    cm_name = cm["metadata"]["name"] if cm else "no-such-config"
    create(kubeconfig, namespace, *([cm] if cm else []), job_from_configmap("bad", cm_name))

    condition = wait_failed_invalid_config(kubeconfig, namespace, "bad")
    assert says in condition["message"], condition

    events = wait_for(lambda: [e for e in warning_events(kubeconfig, namespace, "bad")
                               if e["reason"] == "InvalidConfig"],
                      timeout=30, description="a Warning event InvalidConfig on the job")
    assert says in events[0]["message"], events
    assert cm_name in events[0]["message"], events

    time.sleep(3)  # a late pod would show up by now
    assert pods_of(kubeconfig, namespace, "bad") == []
    assert read("-n", namespace, "get", "pods", kubeconfig=kubeconfig)["items"] == []


def test_topology_from_the_configmap_yaml_is_used_and_shown(kubeconfig: str, namespace: str):
    """The issue's case: accelerate's multi_node template (switched to CPU) in a ConfigMap, a job
    with numNodes 2 and numProcPerNode 4 and no masterPort: the YAML's port 9999 is used, and
    the status and `kubectl get` show the topology. Suspended: no pod needs to run."""
    template = yaml.safe_load((CORPUS / "config_yaml_templates" / "multi_node.yaml").read_text())
    template.update(distributed_type="MULTI_CPU", use_cpu=True)
    job = job_from_configmap("multi-node", "multi-node-cfg")
    job["spec"]["numProcPerNode"] = 4
    del job["spec"]["masterPort"]
    job["spec"]["runPolicy"]["suspend"] = True
    create(kubeconfig, namespace, configmap("multi-node-cfg", yaml.safe_dump(template)), job)

    status = wait_for(lambda: job_status(kubeconfig, namespace, "multi-node").get("topology"),
                      timeout=60, description="status.topology")
    assert status == {"numNodes": 2, "numProcPerNode": 4, "worldSize": 8, "masterPort": 9999,
                      "summary": "2x4"}
    assert job_status(kubeconfig, namespace, "multi-node")["phase"] == "Suspended"
    rendered = read("-n", namespace, "get", "configmap", "multi-node-accelerate-config",
                    kubeconfig=kubeconfig)
    config = yaml.safe_load(rendered["data"]["config.yaml"])
    assert (config["num_machines"], config["num_processes"], config["main_process_port"]) == (
        2, 8, 9999)
    row = kubectl("-n", namespace, "get", "ajob", "multi-node", "-o", "wide",
                  kubeconfig=kubeconfig).stdout
    assert "2x4" in row and "9999" in row, row


def test_contradicting_configmap_is_named_in_the_failure(kubeconfig: str, namespace: str):
    cm, _ = BAD_CONFIGMAPS["contradicts-numNodes"]
    create(kubeconfig, namespace, json.loads(json.dumps(cm)),
           job_from_configmap("bad", "accel-cfg"))
    condition = wait_failed_invalid_config(kubeconfig, namespace, "bad")
    events = wait_for(lambda: warning_events(kubeconfig, namespace, "bad"), timeout=30,
                      description="a Warning event on the job")
    assert "accel-cfg" in condition["message"], condition
    assert "accel-cfg" in events[0]["message"], events


def test_operator_keeps_serving_while_other_jobs_fail(kubeconfig: str, namespace: str):
    """Three jobs with bad ConfigMaps and one valid job in one namespace, all at once."""
    create(kubeconfig, namespace,
           configmap("not-yaml", "distributed_type: [MULTI_CPU\n"),
           configmap("contradicts", "distributed_type: MULTI_CPU\nnum_machines: 5\n"),
           job_from_configmap("bad-missing", "no-such-config"),
           job_from_configmap("bad-yaml", "not-yaml"),
           job_from_configmap("bad-contradicts", "contradicts"),
           valid_job("good"))

    for job in ("bad-missing", "bad-yaml", "bad-contradicts"):
        wait_failed_invalid_config(kubeconfig, namespace, job)

    def good_pods() -> list[dict[str, Any]] | None:
        pods = pods_of(kubeconfig, namespace, "good")
        return pods if len(pods) == 2 else None
    pods = wait_for(good_pods, timeout=90, description="the 2 pods of the valid job")
    assert sorted(p["metadata"]["name"] for p in pods) == ["good-0", "good-1"]
    wait_for(lambda: job_status(kubeconfig, namespace, "good").get("phase") == "Running",
             timeout=90, description="the valid job to be Running")
    for job in ("bad-missing", "bad-yaml", "bad-contradicts"):
        assert pods_of(kubeconfig, namespace, job) == [], job
