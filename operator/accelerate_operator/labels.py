"""Labels on the children: `app.kubernetes.io/*` plus the job name, node index and attempt."""

from __future__ import annotations

from accelerate_trainer.contract import ATTEMPT_LABEL, JOB_NAME_LABEL, NODE_INDEX_LABEL

from .constants import FIELD_MANAGER

# app.kubernetes.io/name of the job's own children (an elastic job's placeholder pods carry the
# job-name label too, under another name: resources/placeholder.py).
JOB_APP_NAME = "accelerate-job"


def job_labels(job_name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": JOB_APP_NAME,
        "app.kubernetes.io/instance": job_name,
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        JOB_NAME_LABEL: job_name,
    }


def pod_labels(job_name: str, index: int, attempt: int) -> dict[str, str]:
    return {**job_labels(job_name), NODE_INDEX_LABEL: str(index), ATTEMPT_LABEL: str(attempt)}


def pod_selector(job_name: str) -> dict[str, str]:
    """The job's own pods, without its placeholders: what its Service and PDB select."""
    return {JOB_NAME_LABEL: job_name, "app.kubernetes.io/name": JOB_APP_NAME}
