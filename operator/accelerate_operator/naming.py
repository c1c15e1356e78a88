"""Deterministic child names: a restarted operator finds what it created before. Also which
container of the pod template is the trainer's (its name picks the log to read)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def pod_name(job_name: str, index: int) -> str:
    return f"{job_name}-{index}"


def service_name(job_name: str) -> str:
    return job_name


def configmap_name(job_name: str) -> str:
    return f"{job_name}-accelerate-config"


def master_address(job_name: str) -> str:
    """Pod 0's DNS name through the headless Service; resolvable from any pod of the namespace."""
    return f"{pod_name(job_name, 0)}.{service_name(job_name)}"


def logs_configmap_name(job_name: str, attempt: int) -> str:
    """The archived logs of the pods of `attempt`, kept when the group restarts."""
    return f"{job_name}-logs-attempt-{attempt}"


def trainer_container_name(template: Mapping[str, Any]) -> str | None:
    """The first container of the pod template trains (as the pod builder assumes)."""
    containers = (template.get("spec") or {}).get("containers") or [{}]
    return containers[0].get("name")


def workload_name(job_name: str, uid: str) -> str:
    """The job's Kueue Workload. The uid tells apart a job deleted and created again under the
    same name, whose old Workload may not be collected yet."""
    return f"acceleratejob-{job_name}-{uid[:8]}" if uid else f"acceleratejob-{job_name}"


def pdb_name(job_name: str) -> str:
    """The job's PodDisruptionBudget (spec.runPolicy.podDisruptionBudget)."""
    return job_name


def report_path(namespace: str, job_name: str) -> str:
    """The job's report endpoint on the operator (KEP-2779's path shape): report_server.py."""
    return (f"/apis/accelerate-operator.io/v1alpha1/namespaces/{namespace}/acceleratejobs/"
            f"{job_name}/status")
