"""Placeholder pod `<job>-placeholder-<index>`: while an elastic job runs reduced, one per missing
node asks the scheduler whether that node's capacity is back. It has what decides where the
missing pod could go (every container's resources and host ports, node selector, affinity,
tolerations, topology spread, scheduler, runtime class, the PersistentVolumeClaims, the DRA
resource claims) and nothing that trains: each container only waits for SIGTERM, in the
trainer's image, which the node then holds for the job's own pod. Once the scheduler binds it,
the job can grow (elastic.decide_grow).

It runs at the lowest priority (a PriorityClass the chart installs, preemptionPolicy Never), so
it never takes a node from anyone and any pod, the job's own included, preempts it. It carries
the job-name label, so the operator's pod watch (filtered on the server by that label) sees it,
and its node index, but not the job's app.kubernetes.io/name: the job's Service and
PodDisruptionBudget (labels.pod_selector) never count it, and the operator indexes it apart from
the job's pods by the placeholder label. The template's own labels stay, for the template's pod
affinity may name them. Pure: no API calls."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from accelerate_trainer.contract import JOB_NAME_LABEL, NODE_INDEX_LABEL

from ..api import JobSpec
from ..constants import FIELD_MANAGER
from .pods import RESTRICTED_CONTAINER_SECURITY, pod_security_defaults

PLACEHOLDER_LABEL = "accelerate-operator.io/placeholder-for"
# The chart's PriorityClass for placeholders (value -10: the lowest the cluster autoscaler still
# adds nodes for, --expendable-pods-priority-cutoff; preemptionPolicy Never).
PLACEHOLDER_PRIORITY_CLASS = "accelerate-operator-placeholder"
# Waits for SIGTERM and ends at once: python3 is in every image that runs accelerate.
HOLD_COMMAND = ["python3", "-c", "import signal; signal.pause()"]
EXIT_COMMAND = ["python3", "-c", "pass"]
# Fields of the pod spec that decide where a pod can be placed, copied as the template has them.
# resourceClaims: the DRA claims the containers' resources.claims name (the API server refuses a
# name the pod does not list), allocated for the placeholder as for the pod it stands for.
SCHEDULING_FIELDS = ("nodeSelector", "affinity", "tolerations", "topologySpreadConstraints",
                     "schedulerName", "runtimeClassName", "imagePullSecrets", "hostNetwork",
                     "resourceClaims")
# Who a container runs as: kept, so the image starts under the same Pod Security rules.
IDENTITY_FIELDS = ("runAsUser", "runAsGroup", "runAsNonRoot")


def placeholder_name(job_name: str, index: int) -> str:
    return f"{job_name}-placeholder-{index}"


def placeholder_labels(job: JobSpec, index: int) -> dict[str, str]:
    template_labels = (job.template.get("metadata") or {}).get("labels") or {}
    return {**template_labels,
            "app.kubernetes.io/name": "accelerate-job-placeholder",
            "app.kubernetes.io/instance": job.name,
            "app.kubernetes.io/managed-by": FIELD_MANAGER,
            JOB_NAME_LABEL: job.name, NODE_INDEX_LABEL: str(index),
            PLACEHOLDER_LABEL: job.name}


def _holder(container: Mapping[str, Any], image: str, *, exits: bool) -> dict[str, Any]:
    """A container with `container`'s name, resources and host ports that trains nothing."""
    held: dict[str, Any] = {
        "name": container["name"],
        "image": image,
        "command": list(EXIT_COMMAND if exits else HOLD_COMMAND),
        "resources": copy.deepcopy(container.get("resources") or {}),
        "securityContext": {**RESTRICTED_CONTAINER_SECURITY, **{
            key: value for key, value in (container.get("securityContext") or {}).items()
            if key in IDENTITY_FIELDS}},
    }
    ports = [dict(port) for port in container.get("ports") or [] if port.get("hostPort")]
    if ports:
        held["ports"] = ports
    if container.get("restartPolicy"):  # a native sidecar (an init container that keeps running)
        held["restartPolicy"] = container["restartPolicy"]
    return held


def _init_holders(spec: Mapping[str, Any], image: str) -> list[dict[str, Any]]:
    """Init containers keep their resources (the scheduler counts the largest one); a sidecar
    keeps running, the others exit at once."""
    return [_holder(c, image, exits=c.get("restartPolicy") != "Always")
            for c in spec.get("initContainers") or []]


def _claims(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The template's PersistentVolumeClaims: their topology and attach limits bind the pod."""
    return [copy.deepcopy(v) for v in spec.get("volumes") or [] if v.get("persistentVolumeClaim")]


def build_placeholder_pod(job: JobSpec, index: int, *,
                          priority_class: str = PLACEHOLDER_PRIORITY_CLASS) -> dict[str, Any]:
    """The placeholder for node `index` of `job` (an index the group lacks while reduced,
    elastic.placeholder_indices)."""
    template_spec = job.template.get("spec") or {}
    containers = template_spec["containers"]
    image = containers[0]["image"]
    spec: dict[str, Any] = {key: copy.deepcopy(template_spec[key])
                            for key in SCHEDULING_FIELDS if key in template_spec}
    spec.update({
        "securityContext": {**pod_security_defaults(template_spec),
                            **copy.deepcopy(template_spec.get("securityContext") or {})},
        "priorityClassName": priority_class,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [_holder(c, image, exits=False) for c in containers],
    })
    if template_spec.get("initContainers"):
        spec["initContainers"] = _init_holders(template_spec, image)
    if _claims(template_spec):
        spec["volumes"] = _claims(template_spec)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": placeholder_name(job.name, index),
            "namespace": job.namespace,
            "labels": placeholder_labels(job, index),
            "ownerReferences": [job.owner_reference],
        },
        "spec": spec,
    }
