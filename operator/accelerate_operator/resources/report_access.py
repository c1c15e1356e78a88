"""The Role and RoleBinding `<job>-report`: the service account the job's pods run as may patch
those pods (by name), so each can push its report onto itself (accelerate_trainer.supervise):
pod `<job>-0` its progress, every pod of a job restarted in place a failed launch.

RBAC alone would let any pod running as that account (often `default`) patch those pods, in
any way. The chart's ValidatingAdmissionPolicy narrows it: such a patch must come with a token
bound to the patched pod itself and may change only the report annotation. Both are owned by
the job, so they go with it."""

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
                   "resourceNames": [pod_name(job.name, index) for index in
                                     range(job.num_nodes if job.run_policy.restart_in_place
                                           else 1)]}],
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
