"""The placeholder pod of an elastic job's missing node, built whole: what decides where the
missing pod could go is copied, nothing that trains is, and nothing of the job counts it."""

from __future__ import annotations

from accelerate_operator.api import parse_job
from accelerate_operator.elastic import at_size
from accelerate_operator.resources.pdb import build_pdb
from accelerate_operator.resources.placeholder import build_placeholder_pod
from accelerate_operator.resources.service import build_service

from devtools.images import TRAINER_CPU_IMAGE
from tests.helpers.jobs import JobBuilder

HOLD = ["python3", "-c", "import signal; signal.pause()"]
RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
GPU_NODES = {"cloud.example.com/pool": "a100"}
AFFINITY = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
    "labelSelector": {"matchLabels": {"team": "nlp"}}, "topologyKey": "kubernetes.io/hostname"}]}}
TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
RESOURCES = {"requests": {"cpu": "8", "memory": "64Gi"},
             "limits": {"memory": "64Gi", "nvidia.com/gpu": "8"}}


def gpu_job():
    builder = (JobBuilder().nodes(4).elastic(2, 1)
               .container(resources=RESOURCES, ports=[{"containerPort": 29500},
                                                      {"containerPort": 9000, "hostPort": 9000}],
                          securityContext={"runAsUser": 1000, "privileged": True},
                          volumeMounts=[{"name": "data", "mountPath": "/data"}])
               .volume(name="data", persistentVolumeClaim={"claimName": "corpus"})
               .pod_spec(nodeSelector=GPU_NODES, affinity=AFFINITY, tolerations=TOLERATIONS,
                         priorityClassName="training", serviceAccountName="trainer",
                         initContainers=[
                             {"name": "fetch", "image": "busybox", "command": ["wget"],
                              "resources": {"requests": {"cpu": "16"}}},
                             {"name": "proxy", "image": "envoy", "restartPolicy": "Always",
                              "resources": {"requests": {"cpu": "1"}}}]))
    builder.body["spec"]["template"]["metadata"] = {"labels": {"team": "nlp"}}
    return parse_job(builder.build())


def test_placeholder_is_built_whole_with_what_decides_placement_and_nothing_that_trains():
    job = at_size(gpu_job(), 2)
    assert build_placeholder_pod(job, 3) == {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "train-placeholder-3",
            "namespace": "ml",
            "labels": {"team": "nlp",
                       "app.kubernetes.io/name": "accelerate-job-placeholder",
                       "app.kubernetes.io/instance": "train",
                       "app.kubernetes.io/managed-by": "accelerate-operator",
                       "accelerate-operator.io/job-name": "train",
                       "accelerate-operator.io/node-index": "3",
                       "accelerate-operator.io/placeholder-for": "train"},
            "ownerReferences": [job.owner_reference],
        },
        "spec": {
            "nodeSelector": GPU_NODES,
            "affinity": AFFINITY,
            "tolerations": TOLERATIONS,
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "priorityClassName": "accelerate-operator-placeholder",
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "containers": [{
                "name": "trainer", "image": TRAINER_CPU_IMAGE, "command": HOLD,
                "resources": RESOURCES,
                "securityContext": {**RESTRICTED, "runAsUser": 1000},
                "ports": [{"containerPort": 9000, "hostPort": 9000}],
            }],
            "initContainers": [
                {"name": "fetch", "image": TRAINER_CPU_IMAGE,
                 "command": ["python3", "-c", "pass"],
                 "resources": {"requests": {"cpu": "16"}}, "securityContext": RESTRICTED},
                {"name": "proxy", "image": TRAINER_CPU_IMAGE, "command": HOLD,
                 "resources": {"requests": {"cpu": "1"}}, "securityContext": RESTRICTED,
                 "restartPolicy": "Always"},
            ],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}}],
        },
    }


def test_a_placeholder_is_never_one_of_the_jobs_pods():
    """A placeholder carries the job-name label (the operator's pod watch is filtered by it)
    but not the job's app.kubernetes.io/name, which the job's Service and PodDisruptionBudget
    select too: it is neither an endpoint nor a pod the budget protects."""
    job = gpu_job()
    labels = build_placeholder_pod(job, 3)["metadata"]["labels"]
    for selector in (build_service(job)["spec"]["selector"],
                     build_pdb(job)["spec"]["selector"]["matchLabels"]):
        assert not set(selector.items()) <= set(labels.items())


def test_the_priority_class_is_the_callers():
    pod = build_placeholder_pod(gpu_job(), 2, priority_class="lowest")
    assert pod["spec"]["priorityClassName"] == "lowest"


def test_nulls_in_the_template_are_missing_keys():
    """A null the client stored for an unset key neither lands in the placeholder nor
    overrides its defaults."""
    body = (JobBuilder().nodes(4).elastic(2, 1)
            .container(securityContext={"runAsUser": None}, resources=None)
            .pod_spec(securityContext={"runAsNonRoot": None}, nodeSelector=None).build())
    spec = build_placeholder_pod(parse_job(body), 3)["spec"]
    assert spec["securityContext"] == {"runAsNonRoot": True,
                                       "seccompProfile": {"type": "RuntimeDefault"}}
    assert "nodeSelector" not in spec
    assert spec["containers"][0]["securityContext"] == RESTRICTED


def test_a_placeholder_of_a_template_that_runs_as_root_gets_no_run_as_non_root_default():
    """Its holders keep the trainer's runAsUser 0: with runAsNonRoot true beside it, the kubelet
    would refuse them."""
    body = JobBuilder().nodes(4).elastic(2, 1).container(securityContext={"runAsUser": 0}).build()
    spec = build_placeholder_pod(parse_job(body), 3)["spec"]
    assert spec["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert spec["containers"][0]["securityContext"]["runAsUser"] == 0


def test_a_placeholder_keeps_the_dra_claims_its_containers_name():
    """A container's resources.claims must name one of the pod's resourceClaims (the API server
    refuses it otherwise), and the devices they allocate decide where the pod fits."""
    claims = [{"name": "gpu", "resourceClaimTemplateName": "gpu-template"}]
    body = (JobBuilder().nodes(4).elastic(2, 1)
            .container(resources={"claims": [{"name": "gpu"}]})
            .pod_spec(resourceClaims=claims).build())
    spec = build_placeholder_pod(parse_job(body), 3)["spec"]
    assert spec["resourceClaims"] == claims
    assert spec["containers"][0]["resources"] == {"claims": [{"name": "gpu"}]}
