"""Pod `<job>-<index>`: the user's template plus hostname, the topology env, the config mount,
the shipped code (spec.code) with a writable workspace, restricted-profile security defaults
the template does not override (no service-account token for the API server unless the template
sets automountServiceAccountToken), and a termination grace period long enough for a
checkpoint."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from accelerate_trainer.contract import (
    CODE_ARCHIVE_KEY,
    CODE_MOUNT_PATH,
    CONFIG_FILE,
    CONFIG_MOUNT_PATH,
    ENV_CHECKPOINT_DIR,
    ENV_CODE_ARCHIVE,
    ENV_CODE_REQUIREMENTS,
    ENV_CODE_SHA256,
    ENV_CODE_WORKSPACE,
    ENV_CONFIG_FILE,
    ENV_JOB_ATTEMPT,
    ENV_JOB_NAME,
    ENV_KUBEFLOW_CA,
    ENV_KUBEFLOW_TOKEN,
    ENV_KUBEFLOW_URL,
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ENV_NODE_RANK,
    ENV_NPROC_PER_NODE,
    ENV_NUM_NODES,
    ENV_REPORT_URL,
    ENV_WORLD_SIZE,
    REPORT_AUDIENCE,
    REPORT_CA_FILE,
    REPORT_CA_KEY,
    REPORT_DIR,
    REPORT_TOKEN_FILE,
    REPORT_TOKEN_SECONDS,
    RUN_ATTEMPT_ANNOTATION,
    RUN_ATTEMPT_FILE,
    WORKSPACE_DIR,
)

from ..api import JobSpec
from ..constants import (
    CODE_VOLUME,
    CONFIG_VOLUME,
    DEFAULT_CONTAINER_ANNOTATION,
    REPORT_VOLUME,
    SHM_VOLUME,
    WORKSPACE_VOLUME,
)
from ..elastic import build_elastic_env
from ..labels import pod_labels
from ..naming import configmap_name, master_address, pod_name, report_path, service_name
from .reserved import SHM_PATH


@dataclass(frozen=True)
class ReportEndpoint:
    """Where the pods reach the operator's report endpoint: `https://<service DNS name>:<port>`
    (report_settings.py reads it from the operator's environment)."""

    base_url: str

    def job_url(self, job: JobSpec) -> str:
        return self.base_url.rstrip("/") + report_path(job.namespace, job.name)


# What the chart's defaults make it: release `accelerate-operator` in `accelerate-system`.
DEFAULT_REPORT_ENDPOINT = ReportEndpoint("https://accelerate-operator.accelerate-system.svc:8443")

# Long enough for every rank to finish its step and save one checkpoint together after SIGTERM
# (accelerate_trainer.checkpoints.checkpoint_on_stop); Kubernetes' own 30 s rarely is. The
# template's terminationGracePeriodSeconds wins.
DEFAULT_TERMINATION_GRACE_SECONDS = 120
# torchrun (under `accelerate launch`) sends SIGKILL to its ranks this long after passing SIGTERM
# on: 30 s unless told. Set to the pod's grace period, so the kubelet's deadline is the one.
ENV_LAUNCHER_SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"

# transformers' own switch for its KubeflowCallback (read as transformers reads it).
ENV_KUBEFLOW_DISABLE = "DISABLE_KUBEFLOW_INTEGRATION"
RESTRICTED_POD_SECURITY = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}


def pod_security_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """The restricted profile's pod-level defaults, less runAsNonRoot where the template runs the
    pod or a container as root (runAsUser 0, as NGC and pytorch images do): the kubelet refuses
    a container whose runAsNonRoot and runAsUser 0 meet (CreateContainerConfigError)."""
    containers = [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]
    contexts = [spec.get("securityContext") or {}, *(c.get("securityContext") or {}
                                                      for c in containers)]
    if any(context.get("runAsUser") == 0 for context in contexts):
        return {key: value for key, value in RESTRICTED_POD_SECURITY.items()
                if key != "runAsNonRoot"}
    return RESTRICTED_POD_SECURITY


def _container_security_defaults(container: dict[str, Any]) -> dict[str, Any]:
    """Restricted-profile defaults, except where the template asks for more: the API server
    refuses allowPrivilegeEscalation false beside privileged or CAP_SYS_ADMIN."""
    security = container.get("securityContext") or {}
    added = (security.get("capabilities") or {}).get("add") or []
    if security.get("privileged") or {"SYS_ADMIN", "CAP_SYS_ADMIN"} & set(added):
        return {key: value for key, value in RESTRICTED_CONTAINER_SECURITY.items()
                if key != "allowPrivilegeEscalation"}
    return RESTRICTED_CONTAINER_SECURITY


def build_topology_env(job: JobSpec, index: int, attempt: int = 0) -> list[dict[str, str]]:
    """The env that tells `accelerate-trainer` where this pod sits. No PET_* names: torchrun
    reads those as defaults and they would leak into the launch."""
    env = {
        ENV_MASTER_ADDR: master_address(job.name),
        ENV_MASTER_PORT: str(job.master_port),
        ENV_NODE_RANK: str(index),
        ENV_NUM_NODES: str(job.num_nodes),
        ENV_NPROC_PER_NODE: str(job.nproc_per_node),
        ENV_WORLD_SIZE: str(job.world_size),
        ENV_CONFIG_FILE: CONFIG_FILE,
        ENV_JOB_NAME: job.name,
        ENV_JOB_ATTEMPT: str(attempt),
        "PYTHONUNBUFFERED": "1",
        **build_elastic_env(job),
    }
    if job.checkpoint:
        env[ENV_CHECKPOINT_DIR] = job.checkpoint.mount_path
    if job.code:
        env[ENV_CODE_ARCHIVE] = f"{CODE_MOUNT_PATH}/{CODE_ARCHIVE_KEY}"
        env[ENV_CODE_SHA256] = job.code.sha256
        env[ENV_CODE_WORKSPACE] = WORKSPACE_DIR
        if job.code.requirements:
            env[ENV_CODE_REQUIREMENTS] = job.code.requirements
    return [{"name": name, "value": value} for name, value in env.items()]


def _with_defaults(current: dict[str, Any] | None, defaults: dict[str, Any]) -> dict[str, Any]:
    """The template's own settings win; defaults fill only what it leaves out."""
    return {**copy.deepcopy(defaults), **(current or {})}


def build_pod(job: JobSpec, index: int, attempt: int, run_attempt: int | None = None,
              endpoint: ReportEndpoint = DEFAULT_REPORT_ENDPOINT) -> dict[str, Any]:
    """Pod `index` of the group created for `attempt` (its label), whose processes run
    `run_attempt` (the same unless the group was restarted in place since); it reports to
    `endpoint`."""
    run_attempt = attempt if run_attempt is None else run_attempt
    template = copy.deepcopy(dict(job.template))
    spec = template.get("spec", {})
    metadata = template.get("metadata") or {}

    _set_pod_defaults(job, index, spec)
    trainer = spec["containers"][0]
    _set_trainer_env(job, index, run_attempt, spec, trainer)
    _add_volumes(job, spec, trainer)
    # The trainer is the pod's main container, for kubectl logs and exec, and for the pass
    # (pod_state.trainer_name) whatever container a mesh's injector puts first.
    annotations = {**(metadata.get("annotations") or {}),
                   DEFAULT_CONTAINER_ANNOTATION: trainer["name"]}
    if index == 0 or job.run_policy.restart_in_place:
        _add_report_channel(job, index, spec, trainer, endpoint)
        annotations.update(_run_attempt(job, run_attempt))

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(job.name, index),
            "namespace": job.namespace,
            "labels": {**(metadata.get("labels") or {}), **pod_labels(job.name, index, attempt)},
            "annotations": annotations,
            "ownerReferences": [job.owner_reference],
        },
        "spec": spec,
    }


def _set_pod_defaults(job: JobSpec, index: int, spec: dict[str, Any]) -> None:
    """The pod's name in the job's Service, a restart policy of Never, and what the template
    does not set itself: a grace period, the restricted security profile, no API token, the
    cluster's DNS on the host's network."""
    spec["hostname"] = pod_name(job.name, index)
    spec["subdomain"] = service_name(job.name)
    spec["restartPolicy"] = "Never"
    # No API credential unless the template asks for one (docs/writing-a-job.md): the pod
    # reports with its own token for the operator's endpoint alone.
    spec.setdefault("automountServiceAccountToken", False)
    spec.setdefault("terminationGracePeriodSeconds", DEFAULT_TERMINATION_GRACE_SECONDS)
    if spec.get("hostNetwork"):
        # ClusterFirst on the host's network resolves through the node's resolv.conf, where
        # MASTER_ADDR (<job>-0.<job>, a name of the cluster's DNS) does not resolve.
        spec.setdefault("dnsPolicy", "ClusterFirstWithHostNet")
    spec["securityContext"] = _with_defaults(spec.get("securityContext"),
                                             pod_security_defaults(spec))
    for container in spec["containers"]:
        container["securityContext"] = _with_defaults(
            container.get("securityContext"), _container_security_defaults(container)
        )


def _add_volumes(job: JobSpec, spec: dict[str, Any], trainer: dict[str, Any]) -> None:
    """The config mount, a memory-backed /dev/shm and the checkpoint volume, on the trainer
    (check_pod_template refused a template whose names or paths collide with ours)."""
    volumes = spec.setdefault("volumes", [])
    # Every key: the rendered config.yaml and the files shipped beside it (a DeepSpeed JSON).
    volumes.append({"name": CONFIG_VOLUME, "configMap": {"name": configmap_name(job.name)}})
    mounts = trainer.setdefault("volumeMounts", [])
    mounts.append({"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT_PATH, "readOnly": True})
    mounted_paths = {mount.get("mountPath") for mount in mounts}
    if SHM_PATH not in mounted_paths:
        # Docker's default 64 MiB /dev/shm breaks NCCL and DataLoader workers.
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": SHM_VOLUME, "mountPath": SHM_PATH})
    if job.checkpoint and job.checkpoint.mount_path not in mounted_paths:
        mounts.append({"name": job.checkpoint.volume_name, "mountPath": job.checkpoint.mount_path})
        mounted_paths.add(job.checkpoint.mount_path)
    if job.code:
        _add_code(job, volumes, mounts, mounted_paths)


def _add_code(job: JobSpec, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]],
              mounted_paths: set[Any]) -> None:
    """The shipped code, read-only, and a writable workspace the trainer unpacks it into: an
    emptyDir, unless the template mounts a volume of its own there. The container cannot start
    before the ConfigMap exists, so no pod ever sees part of the code."""
    volumes.append({"name": CODE_VOLUME, "configMap": {"name": job.code.config_map}})
    mounts.append({"name": CODE_VOLUME, "mountPath": CODE_MOUNT_PATH, "readOnly": True})
    if WORKSPACE_DIR not in mounted_paths:
        volumes.append({"name": WORKSPACE_VOLUME, "emptyDir": {}})
        mounts.append({"name": WORKSPACE_VOLUME, "mountPath": WORKSPACE_DIR})


def _set_trainer_env(job: JobSpec, index: int, run_attempt: int, spec: dict[str, Any],
                     trainer: dict[str, Any]) -> None:
    """The topology env before the template's own, and the launcher's shutdown timeout."""
    # The trainer writes config errors to /dev/termination-log; anything else (a traceback from a
    # training process) reaches the job's status through the last lines of the log.
    trainer.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    user_env = list(trainer.get("env") or [])
    launcher_env = [] if any(e.get("name") == ENV_LAUNCHER_SHUTDOWN_TIMEOUT for e in user_env) \
        else [{"name": ENV_LAUNCHER_SHUTDOWN_TIMEOUT,
               "value": str(spec["terminationGracePeriodSeconds"])}]
    trainer["env"] = build_topology_env(job, index, run_attempt) + launcher_env + user_env


def _run_attempt(job: JobSpec, run_attempt: int) -> dict[str, str]:
    """The attempt the pod's supervisor launches, for a job restarted in place."""
    return {RUN_ATTEMPT_ANNOTATION: str(run_attempt)} if job.run_policy.restart_in_place else {}


def _add_report_channel(job: JobSpec, index: int, spec: dict[str, Any],
                        trainer: dict[str, Any], endpoint: ReportEndpoint) -> None:
    """The pod reports to the operator's endpoint (accelerate_trainer.supervise): its URL, and a
    volume on the trainer container only with a token bound to this pod whose audience is the
    endpoint's (REPORT_AUDIENCE: the API server refuses it, so the container gets no API
    credential from us; build_pod turns the API token off unless the template asks), the CA that
    signed the endpoint's certificate (from the job's ConfigMap) and, with in-place restarts,
    the attempt the operator wants run (the downward API, refreshed by the kubelet within about
    0.2 s of the operator's write). Pod 0 also points transformers' KubeflowCallback there."""
    url = endpoint.job_url(job)
    env = [{"name": ENV_REPORT_URL, "value": url}]
    if index == 0 and _kubeflow_wanted(trainer["env"]):
        env += [{"name": ENV_KUBEFLOW_URL, "value": url},
                {"name": ENV_KUBEFLOW_TOKEN, "value": f"{REPORT_DIR}/{REPORT_TOKEN_FILE}"},
                {"name": ENV_KUBEFLOW_CA, "value": f"{REPORT_DIR}/{REPORT_CA_FILE}"}]
    trainer["env"][:0] = env
    sources: list[dict[str, Any]] = [
        {"serviceAccountToken": {"audience": REPORT_AUDIENCE, "path": REPORT_TOKEN_FILE,
                                 "expirationSeconds": REPORT_TOKEN_SECONDS}},
        # optional: a ConfigMap written before the operator had a CA still starts the pod; the
        # operator adds the key, and the kubelet the file, soon after.
        {"configMap": {"name": configmap_name(job.name), "optional": True,
                       "items": [{"key": REPORT_CA_KEY, "path": REPORT_CA_FILE}]}},
    ]
    if job.run_policy.restart_in_place:
        field = f"metadata.annotations['{RUN_ATTEMPT_ANNOTATION}']"
        sources.append({"downwardAPI": {"items": [
            {"path": RUN_ATTEMPT_FILE, "fieldRef": {"fieldPath": field}}]}})
    spec["volumes"].append({"name": REPORT_VOLUME, "projected": {"sources": sources}})
    trainer["volumeMounts"].append({"name": REPORT_VOLUME, "mountPath": REPORT_DIR,
                                    "readOnly": True})


def _kubeflow_wanted(env: list[dict[str, Any]]) -> bool:
    """Unless the template points transformers' KubeflowCallback elsewhere or turns it off."""
    names = {e.get("name"): e for e in env}
    disable = names.get(ENV_KUBEFLOW_DISABLE)
    disabled = disable is not None and str(disable.get("value", "TRUE")).upper() == "TRUE"
    return ENV_KUBEFLOW_URL not in names and not disabled
