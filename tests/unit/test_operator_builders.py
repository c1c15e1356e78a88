"""The builders turn a job into whole manifests; compared as whole objects."""

from __future__ import annotations

import re

import pytest
import yaml
from accelerate_operator.api import SpecError, parse_job
from accelerate_operator.resources.configmap import (
    build_configmap,
    prepare_config,
    render_accelerate_config,
)
from accelerate_operator.resources.pods import ReportEndpoint, build_pod
from accelerate_operator.resources.service import build_service
from accelerate_trainer.config import ConfigError

from devtools.images import TRAINER_CPU_IMAGE
from tests.helpers.jobs import JobBuilder

OWNER = {
    "apiVersion": "accelerate-operator.io/v1alpha1",
    "kind": "AccelerateJob",
    "name": "train",
    "uid": "uid-train",
    "controller": True,
    "blockOwnerDeletion": True,
}
LABELS = {
    "app.kubernetes.io/name": "accelerate-job",
    "app.kubernetes.io/instance": "train",
    "app.kubernetes.io/managed-by": "accelerate-operator",
    "accelerate-operator.io/job-name": "train",
}


# The chart's default endpoint: the operator's Service, KEP-2779's path for job ml/train.
URL = ("https://accelerate-operator.accelerate-system.svc:8443"
       "/apis/accelerate-operator.io/v1alpha1/namespaces/ml/acceleratejobs/train/status")
# A token for the operator's endpoint only (the API server refuses its audience), and the CA
# that signed the endpoint's certificate, from the job's own ConfigMap.
REPORT_TOKEN = {"serviceAccountToken": {"audience": "accelerate-operator.io/report",
                                        "path": "token", "expirationSeconds": 3600}}
REPORT_CA = {"configMap": {"name": "train-accelerate-config", "optional": True,
                           "items": [{"key": "report-ca.crt", "path": "ca.crt"}]}}


def test_pod_is_built_whole_with_topology_env_hostname_and_config_mount():
    """Pod 1 of the group created for attempt 2, whose processes run attempt 3 (restarted in
    place once): the label keeps the group, the env and the annotation the attempt."""
    job = parse_job(JobBuilder().build())
    assert build_pod(job, 1, attempt=2, run_attempt=3) == {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "train-1",
            "namespace": "ml",
            "labels": {**LABELS, "accelerate-operator.io/node-index": "1",
                       "accelerate-operator.io/attempt": "2"},
            "annotations": {"kubectl.kubernetes.io/default-container": "trainer",
                            "accelerate-operator.io/run-attempt": "3"},
            "ownerReferences": [OWNER],
        },
        "spec": {
            "hostname": "train-1",
            "automountServiceAccountToken": False,
            "subdomain": "train",
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 120,
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "trainer",
                "image": TRAINER_CPU_IMAGE,
                "command": ["accelerate-trainer"],
                "args": ["train.py"],
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}},
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "env": [
                    {"name": "ACCELERATE_REPORT_URL", "value": URL},
                    {"name": "MASTER_ADDR", "value": "train-0.train"},
                    {"name": "MASTER_PORT", "value": "29500"},
                    {"name": "NODE_RANK", "value": "1"},
                    {"name": "NUM_NODES", "value": "2"},
                    {"name": "NPROC_PER_NODE", "value": "2"},
                    {"name": "WORLD_SIZE", "value": "4"},
                    {"name": "ACCELERATE_CONFIG_FILE", "value": "/etc/accelerate/config.yaml"},
                    {"name": "ACCELERATE_JOB_NAME", "value": "train"},
                    {"name": "ACCELERATE_JOB_ATTEMPT", "value": "3"},
                    {"name": "PYTHONUNBUFFERED", "value": "1"},
                    {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": "120"},
                ],
                "volumeMounts": [
                    {"name": "accelerate-config", "mountPath": "/etc/accelerate", "readOnly": True},
                    {"name": "dshm", "mountPath": "/dev/shm"},
                    {"name": "accelerate-report",
                     "mountPath": "/var/run/secrets/accelerate-operator.io/report",
                     "readOnly": True},
                ],
            }],
            "volumes": [
                {"name": "accelerate-config", "configMap": {
                    "name": "train-accelerate-config"}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                {"name": "accelerate-report", "projected": {"sources": [
                    REPORT_TOKEN, REPORT_CA,
                    {"downwardAPI": {"items": [{"path": "attempt", "fieldRef": {
                        "fieldPath":
                            "metadata.annotations['accelerate-operator.io/run-attempt']"}}]}},
                ]}},
            ],
        },
    }


def test_pods_get_machine_rank_from_index_and_share_the_master_address():
    job = parse_job(JobBuilder().nodes(3).build())
    envs = [{e["name"]: e["value"] for e in build_pod(job, i, 0)["spec"]["containers"][0]["env"]}
            for i in range(3)]
    assert [e["NODE_RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["MASTER_ADDR"] for e in envs} == {"train-0.train"}
    assert {e["WORLD_SIZE"] for e in envs} == {"6"}
    assert not any(name.startswith("PET_") for e in envs for name in e)


def test_user_env_volumes_and_security_settings_are_kept():
    job = parse_job(
        JobBuilder()
        .container(env=[{"name": "HF_HOME", "value": "/cache"}],
                   securityContext={"runAsUser": 0, "allowPrivilegeEscalation": True},
                   volumeMounts=[{"name": "data", "mountPath": "/data"}])
        .pod_spec(volumes=[{"name": "data", "emptyDir": {}}],
                  securityContext={"runAsNonRoot": False})
        .build()
    )
    pod = build_pod(job, 0, 0)
    container = pod["spec"]["containers"][0]
    assert container["env"][-1] == {"name": "HF_HOME", "value": "/cache"}
    assert container["securityContext"] == {"allowPrivilegeEscalation": True, "runAsUser": 0,
                                            "capabilities": {"drop": ["ALL"]}}
    assert pod["spec"]["securityContext"] == {"runAsNonRoot": False,
                                              "seccompProfile": {"type": "RuntimeDefault"}}
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["data", "accelerate-config", "dshm",
                                                           "accelerate-report"]


@pytest.mark.parametrize("where", ["container", "init container", "pod"])
def test_a_template_that_runs_as_root_gets_no_run_as_non_root_default(where):
    """runAsUser 0 (how NGC and pytorch images run) beside the default runAsNonRoot true would
    make the kubelet refuse the container: the template's choice stays alone."""
    root = {"securityContext": {"runAsUser": 0}}
    builder = JobBuilder()
    if where == "container":
        builder.container(**root)
    elif where == "init container":
        builder.pod_spec(initContainers=[{"name": "fetch", "image": "busybox", **root}])
    else:
        builder.pod_spec(**root)
    pod = build_pod(parse_job(builder.build()), 0, 0)
    assert "runAsNonRoot" not in pod["spec"]["securityContext"]
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_on_the_hosts_network_pods_resolve_through_the_clusters_dns():
    """With hostNetwork, Kubernetes' ClusterFirst resolves through the node's resolv.conf, where
    MASTER_ADDR (train-0.train) does not resolve; a dnsPolicy of the template's own stays."""
    def dns_policy(**pod_spec):
        pod = build_pod(parse_job(JobBuilder().pod_spec(**pod_spec).build()), 1, 0)
        return pod["spec"].get("dnsPolicy")

    assert dns_policy(hostNetwork=True) == "ClusterFirstWithHostNet"
    assert dns_policy(hostNetwork=True, dnsPolicy="None") == "None"
    assert dns_policy(hostNetwork=False) is None
    assert dns_policy() is None


CODE = {"configMap": "train-code", "sha256": "a" * 64}


@pytest.mark.parametrize("builder,refused", [
    (JobBuilder().volume(name="accelerate-config", configMap={"name": "mine"})
     .container(volumeMounts=[{"name": "accelerate-config", "mountPath": "/cfg"}]),
     "spec.template.spec.volumes[0].name 'accelerate-config' is reserved"),
    (JobBuilder().volume(name="dshm", emptyDir={})
     .container(volumeMounts=[{"name": "dshm", "mountPath": "/scratch"}]),
     "spec.template.spec.volumes[0].name 'dshm' is reserved"),
    (JobBuilder().volume(name="accelerate-report", emptyDir={}),
     "spec.template.spec.volumes[0].name 'accelerate-report' is reserved"),
    (JobBuilder().spec(code=CODE).volume(name="accelerate-workspace", emptyDir={}),
     "spec.template.spec.volumes[0].name 'accelerate-workspace' is reserved"),
    (JobBuilder().volume(name="mine", configMap={"name": "mine"})
     .container(volumeMounts=[{"name": "mine", "mountPath": "/etc/accelerate/"}]),
     "volumeMounts[0].mountPath '/etc/accelerate/' is reserved: the operator mounts the "
     "rendered accelerate config at /etc/accelerate"),
    (JobBuilder().volume(name="mine", emptyDir={}).spec(code=CODE)
     .container(volumeMounts=[{"name": "mine", "mountPath": "/etc/accelerate-code/x"}]),
     "mountPath '/etc/accelerate-code/x' is reserved"),
    (JobBuilder().volume(name="mine", emptyDir={})
     .container(volumeMounts=[{"name": "mine",
                               "mountPath": "/var/run/secrets/accelerate-operator.io/report"}]),
     "mountPath '/var/run/secrets/accelerate-operator.io/report' is reserved"),
    (JobBuilder().spec(code=CODE).volume(name="ck", emptyDir={}).checkpoint("ck", "/workspace"),
     "spec.checkpoint.mountPath '/workspace' is reserved: the operator mounts the workspace "
     "spec.code is unpacked into at /workspace; set another path"),
    (JobBuilder().volume(name="ck", emptyDir={}).checkpoint("ck", "/dev/shm"),
     "spec.checkpoint.mountPath '/dev/shm' is reserved"),
    (JobBuilder().volume(name="ck", emptyDir={}).checkpoint("ck", "/etc/accelerate"),
     "spec.checkpoint.mountPath '/etc/accelerate' is reserved"),
], ids=["config-volume", "dshm-elsewhere", "report-volume", "workspace-volume", "config-path",
        "below-code-path", "report-path", "checkpoint-on-workspace", "checkpoint-on-shm",
        "checkpoint-on-config"])
def test_a_template_that_takes_a_name_or_path_of_ours_is_refused_naming_it(builder, refused):
    """The API server would refuse every pod (a duplicate name or mount path) without naming
    either the operator's volume or the fix."""
    with pytest.raises(SpecError, match=re.escape(refused)):
        prepare_config(parse_job(builder.build()), None)


def test_names_and_paths_of_ours_that_the_pod_would_not_use_are_the_templates():
    """A template's own /dev/shm or /workspace replaces ours; without spec.code neither the
    code's paths nor /workspace are ours."""
    shm = {"name": "dshm", "mountPath": "/dev/shm"}
    own = [
        JobBuilder().volume(name="dshm", emptyDir={"medium": "Memory"}).container(
            volumeMounts=[shm]),
        JobBuilder().spec(code=CODE).volume(name="ws", emptyDir={}).container(
            volumeMounts=[{"name": "ws", "mountPath": "/workspace"}]),
        JobBuilder().volume(name="accelerate-code", emptyDir={}).volume(name="ck", emptyDir={})
        .checkpoint("ck", "/workspace"),
    ]
    for builder in own:
        job, _ = prepare_config(parse_job(builder.build()), None)
        mounts = [m["mountPath"] for m in build_pod(job, 0, 0)["spec"]["containers"][0]
                  ["volumeMounts"]]
        assert len(mounts) == len(set(mounts))


def test_a_refused_template_fails_the_job_at_once_without_children():
    from accelerate_operator.decide import decide

    from tests.helpers.passes import snapshot

    body = JobBuilder().volume(name="accelerate-config", emptyDir={}).build()
    actions = decide(snapshot(body))
    assert actions.status["phase"] == "Failed" and not actions.pods and not actions.children
    failed = next(c for c in actions.status["conditions"] if c["type"] == "Failed")
    assert failed["message"].startswith(
        "spec.template.spec.volumes[0].name 'accelerate-config' is reserved")


def test_builders_do_not_mutate_the_job():
    body = JobBuilder().build()
    job = parse_job(body)
    before = repr(job.template)
    build_pod(job, 0, 0)
    build_pod(job, 1, 0)
    assert repr(job.template) == before


def test_checkpoint_volume_is_mounted_and_announced():
    job = parse_job(JobBuilder().checkpoint("ckpt", "/ckpt")
                    .pod_spec(volumes=[{"name": "ckpt",
                                        "persistentVolumeClaim": {"claimName": "c"}}])
                    .build())
    container = build_pod(job, 0, 0)["spec"]["containers"][0]
    assert {"name": "ckpt", "mountPath": "/ckpt"} in container["volumeMounts"]
    assert {"name": "ACCELERATE_CHECKPOINT_DIR", "value": "/ckpt"} in container["env"]


def test_auto_processes_follow_the_gpu_limit():
    with_gpus = JobBuilder().procs("auto").container(resources={"limits": {"nvidia.com/gpu": 8}})
    assert parse_job(with_gpus.build()).nproc_per_node == 8
    assert parse_job(JobBuilder().procs("auto").build()).nproc_per_node == 1
    with pytest.raises(SpecError, match="numProcPerNode"):
        parse_job(JobBuilder().procs(0).build())


def test_service_is_headless_and_publishes_not_ready_pods():
    job = parse_job(JobBuilder().build())
    assert build_service(job) == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "train", "namespace": "ml", "labels": LABELS,
                     "ownerReferences": [OWNER]},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"accelerate-operator.io/job-name": "train",
                         "app.kubernetes.io/name": "accelerate-job"},
            "ports": [{"name": "rendezvous", "port": 29500, "protocol": "TCP"}],
        },
    }


def test_configmap_renders_the_topology_into_the_users_config():
    job = parse_job(JobBuilder().build())
    user = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU",
            "use_cpu": True, "machine_rank": 0, "main_process_ip": "10.0.0.1",
            "mixed_precision": "bf16"}
    manifest = build_configmap(job, render_accelerate_config(job, user))
    assert manifest["metadata"] == {"name": "train-accelerate-config", "namespace": "ml",
                                    "labels": LABELS, "ownerReferences": [OWNER]}
    assert yaml.safe_load(manifest["data"]["config.yaml"]) == {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_CPU",
        "use_cpu": True,
        "mixed_precision": "bf16",
        "num_machines": 2,
        "num_processes": 4,
        "main_process_port": 29500,
    }


def test_multinode_deepspeed_gets_the_standard_launcher():
    job = parse_job(JobBuilder().build())
    rendered = render_accelerate_config(
        job, {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2}})
    assert rendered["deepspeed_config"] == {"zero_stage": 2,
                                            "deepspeed_multinode_launcher": "standard"}


@pytest.mark.parametrize("key,value,owner", [
    ("num_machines", 4, "spec.numNodes"),
    ("num_processes", 8, "spec.numNodes x spec.numProcPerNode"),
    ("main_process_port", 1234, "spec.masterPort"),
])
def test_topology_contradictions_name_the_key_and_the_winner(key, value, owner):
    job = parse_job(JobBuilder().build())
    with pytest.raises(ConfigError) as error:
        render_accelerate_config(job, {"distributed_type": "MULTI_GPU", key: value})
    assert key in str(error.value) and owner in str(error.value)


def test_pod_disruption_budget_is_built_whole_and_planned_only_when_asked():
    from accelerate_operator.decide import decide
    from accelerate_operator.resources.pdb import build_pdb

    from tests.helpers.passes import snapshot

    body = JobBuilder().run_policy(podDisruptionBudget=True).build()
    job = parse_job(body)
    assert build_pdb(job) == {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "train", "namespace": "ml", "labels": LABELS,
                     "ownerReferences": [OWNER]},
        "spec": {"minAvailable": 2,
                 "selector": {"matchLabels": {"accelerate-operator.io/job-name": "train",
                                              "app.kubernetes.io/name": "accelerate-job"}},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }
    children = frozenset({("ConfigMap", "train-accelerate-config"), ("Service", "train")})
    planned = decide(snapshot(body, children=children))
    assert [c["kind"] for c in planned.children] == ["PodDisruptionBudget"]
    with_pdb = decide(snapshot(body, children=children | {("PodDisruptionBudget", "train")}))
    assert with_pdb.children == ()
    plain = JobBuilder().build()
    assert decide(snapshot(plain, children=children)).children == ()


def test_the_templates_grace_period_wins_and_the_launcher_waits_as_long():
    job = parse_job(JobBuilder().build())
    template = {**job.template, "spec": {**job.template["spec"],
                                         "terminationGracePeriodSeconds": 600}}
    import dataclasses
    pod = build_pod(dataclasses.replace(job, template=template), 0, attempt=0)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 600
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "600"


def test_nulls_in_the_template_are_missing_keys_and_get_the_defaults():
    """kubectl create, Helm and Python clients store null for a key left unset, and the template
    keeps unknown fields: each default applies as if the key were left out."""
    body = (JobBuilder()
            .container(volumeMounts=None, securityContext={"runAsUser": None}, resources=None)
            .pod_spec(automountServiceAccountToken=None, terminationGracePeriodSeconds=None,
                      securityContext=None, tolerations=None)
            .build())
    pod = build_pod(parse_job(body), 0, 0)
    trainer = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["terminationGracePeriodSeconds"] == 120
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "120"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert [m["name"] for m in trainer["volumeMounts"]] == ["accelerate-config", "dshm",
                                                            "accelerate-report"]
    assert "tolerations" not in pod["spec"] and "resources" not in trainer


def test_without_in_place_restarts_pod_0_alone_reports_with_a_token_for_the_endpoint_only():
    job = parse_job(JobBuilder("train", "ml").nodes(2).run_policy(restartInPlace=False).pod_spec(
        serviceAccountName="trainer", automountServiceAccountToken=False).build())
    first, second = build_pod(job, 0, 0), build_pod(job, 1, 0)
    assert first["spec"]["volumes"][-1] == {"name": "accelerate-report", "projected": {
        "sources": [REPORT_TOKEN, REPORT_CA]}}
    trainer = first["spec"]["containers"][0]
    assert trainer["volumeMounts"][-1] == {
        "name": "accelerate-report", "mountPath": "/var/run/secrets/accelerate-operator.io/report",
        "readOnly": True}
    # pod 0 also points transformers' KubeflowCallback (KEP-2779) at the same endpoint
    assert trainer["env"][:4] == [
        {"name": "ACCELERATE_REPORT_URL", "value": URL},
        {"name": "KUBEFLOW_TRAINER_SERVER_URL", "value": URL},
        {"name": "KUBEFLOW_TRAINER_SERVER_TOKEN",
         "value": "/var/run/secrets/accelerate-operator.io/report/token"},
        {"name": "KUBEFLOW_TRAINER_SERVER_CA_CERT",
         "value": "/var/run/secrets/accelerate-operator.io/report/ca.crt"}]
    assert first["spec"]["automountServiceAccountToken"] is False  # the template's choice stays
    assert "accelerate-report" not in [v["name"] for v in second["spec"]["volumes"]]
    assert not any(e["name"].startswith(("ACCELERATE_REPORT_", "KUBEFLOW_"))
                   for e in second["spec"]["containers"][0]["env"])
    assert first["metadata"]["annotations"] == {
        "kubectl.kubernetes.io/default-container": "trainer"}


def test_no_service_account_token_of_the_api_servers_audience_unless_the_template_asks():
    """Every token we project has the endpoint's audience, and the API server's own token is
    not mounted; a template that sets automountServiceAccountToken (true: its training code
    calls the API) keeps its choice."""
    job = parse_job(JobBuilder("train", "ml").nodes(2).build())
    for index in range(2):
        pod = build_pod(job, index, 0)
        tokens = [source["serviceAccountToken"] for volume in pod["spec"]["volumes"]
                  for source in (volume.get("projected") or {}).get("sources", [])
                  if "serviceAccountToken" in source]
        assert tokens == [REPORT_TOKEN["serviceAccountToken"]]
        assert pod["spec"]["automountServiceAccountToken"] is False
    asking = JobBuilder("train", "ml").build()
    asking["spec"]["template"]["spec"]["automountServiceAccountToken"] = True
    assert build_pod(parse_job(asking), 0, 0)["spec"]["automountServiceAccountToken"] is True


def test_a_template_that_points_kubeflow_elsewhere_or_turns_it_off_keeps_its_choice():
    mine = [{"name": "KUBEFLOW_TRAINER_SERVER_URL", "value": "http://mine:8080/"}]
    off = [{"name": "DISABLE_KUBEFLOW_INTEGRATION", "value": "true"}]
    for env in (mine, off):
        job = parse_job(JobBuilder("train", "ml").container(env=env).build())
        given = build_pod(job, 0, 0)["spec"]["containers"][0]["env"]
        assert [e for e in given if e["name"].startswith(("KUBEFLOW", "DISABLE_KUBEFLOW"))] == env
        assert "ACCELERATE_REPORT_URL" in [e["name"] for e in given]


def test_the_report_endpoint_is_the_one_the_operator_was_given():
    job = parse_job(JobBuilder("train", "ml").build())
    pod = build_pod(job, 0, 0, endpoint=ReportEndpoint("https://ops.team-a.svc:9443/"))
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["ACCELERATE_REPORT_URL"] == (
        "https://ops.team-a.svc:9443/apis/accelerate-operator.io/v1alpha1/namespaces/ml/"
        "acceleratejobs/train/status")
