"""The Role and RoleBinding `<job>-report`: the service account pod `<job>-0` runs as may patch
that one pod, so the pod can push its progress onto itself (accelerate_trainer.supervise).

RBAC alone would let any pod running as that account (often `default`) patch pod `<job>-0`, in
any way. The chart's ValidatingAdmissionPolicy narrows it: such a patch must come with a token
bound to pod `<job>-0` itself and may change only the report annotation. Both are owned by the
job, so they go with it."""

from __future__ import annotations

from typing import Any

from ..api import JobSpec
from ..labels import job_labels
from ..naming import pod_name, report_access_name


def service_account(job: JobSpec) -> str:
    """The account the job's pods run as: the template's, else the namespace's `default`."""
    spec = job.template.get("spec") or {}
    return spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"


def _metadata(job: JobSpec) -> dict[str, Any]:
    return {"name": report_access_name(job.name), "namespace": job.namespace,
            "labels": job_labels(job.name), "ownerReferences": [job.owner_reference]}


def build_report_role(job: JobSpec) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(job),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"],
                   "resourceNames": [pod_name(job.name, 0)]}],
    }


def build_report_binding(job: JobSpec) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(job),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": report_access_name(job.name)},
        "subjects": [{"kind": "ServiceAccount", "name": service_account(job),
                      "namespace": job.namespace}],
    }
