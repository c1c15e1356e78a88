"""Labels on the children: `app.kubernetes.io/*` plus the job name, node index and attempt."""

from __future__ import annotations

from accelerate_trainer.contract import ATTEMPT_LABEL, JOB_NAME_LABEL, NODE_INDEX_LABEL

from .constants import FIELD_MANAGER


def job_labels(job_name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "accelerate-job",
        "app.kubernetes.io/instance": job_name,
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        JOB_NAME_LABEL: job_name,
    }


def pod_labels(job_name: str, index: int, attempt: int) -> dict[str, str]:
    return {**job_labels(job_name), NODE_INDEX_LABEL: str(index), ATTEMPT_LABEL: str(attempt)}
