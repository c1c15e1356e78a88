"""Where things are on the API server, for every request the operator makes (client.py) and
every kind it watches (handlers.py, through kopf): the paths, the content types, the label
selectors of the kinds it owns. Names only."""

from __future__ import annotations

from accelerate_trainer.contract import ATTEMPT_LABEL, JOB_NAME_LABEL

from ..constants import GROUP, PLURAL, VERSION
from ..kueue.workload import KUEUE_GROUP

# Namespaced collections, by kind; `{}` is the namespace.
COLLECTIONS = {"ConfigMap": "/api/v1/namespaces/{}/configmaps",
               "Service": "/api/v1/namespaces/{}/services",
               "PodDisruptionBudget": "/apis/policy/v1/namespaces/{}/poddisruptionbudgets",
               "Pod": "/api/v1/namespaces/{}/pods",
               "Event": "/api/v1/namespaces/{}/events",
               "Secret": "/api/v1/namespaces/{}/secrets"}
JOBS = f"/apis/{GROUP}/{VERSION}/namespaces/{{}}/{PLURAL}"
# OIDC discovery of the service-account issuer, which every service account may read (the
# default ClusterRoleBinding system:service-account-issuer-discovery; the chart grants it too).
OPENID_CONFIGURATION = "/.well-known/openid-configuration"
OPENID_KEYS = "/openid/v1/jwks"
PEERING_GROUP, PEERING_VERSION = "kopf.dev", "v1"

# The kinds a job owns, as kopf watches them (group, plural: kopf's resource) and as the index
# audit lists them (the cluster-wide path), with the one label selector both use (the server
# filters). The logs archived at a restart are never recreated: not followed.
OWNED = {
    "Pod": ("v1", "pods", "/api/v1/pods", JOB_NAME_LABEL),
    "Service": ("v1", "services", "/api/v1/services", JOB_NAME_LABEL),
    "ConfigMap": ("v1", "configmaps", "/api/v1/configmaps", f"{JOB_NAME_LABEL},!{ATTEMPT_LABEL}"),
    "PodDisruptionBudget": ("policy", "poddisruptionbudgets",
                            "/apis/policy/v1/poddisruptionbudgets", JOB_NAME_LABEL),
    "Workload": (KUEUE_GROUP, "workloads", None, JOB_NAME_LABEL),  # its version is discovered
}

MERGE = "application/merge-patch+json"
JWKS = "application/jwk-set+json, application/json"
APPLY = "application/apply-patch+yaml"
# Lists come in pages: the audit's listing of 10,000 pods is never one 80 MiB response.
LIST_PAGE = 500
# A list of names needs no spec: the server sends metadata only (PartialObjectMetadataList).
METADATA_ONLY = ("application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io, "
                 "application/json")


def listed_collection(kind: str, namespace: str | None, kueue_group: str, kueue_version: str
                      ) -> tuple[str, str | None]:
    """(path, label selector) of the jobs, or of an owned kind, in one namespace or (None)
    in every one."""
    if kind == "AccelerateJob":
        return (JOBS.format(namespace) if namespace else f"/apis/{GROUP}/{VERSION}/{PLURAL}",
                None)
    if kind == "Workload":
        return workloads(kueue_group, kueue_version, namespace), OWNED[kind][3]
    return (COLLECTIONS[kind].format(namespace) if namespace else OWNED[kind][2],
            OWNED[kind][3])


def peerings(namespace: str | None) -> str:
    """kopf's KopfPeerings in a namespace, or (None) its ClusterKopfPeerings."""
    if namespace:
        return f"/apis/{PEERING_GROUP}/{PEERING_VERSION}/namespaces/{namespace}/kopfpeerings"
    return f"/apis/{PEERING_GROUP}/{PEERING_VERSION}/clusterkopfpeerings"


def workloads(group: str, version: str, namespace: str | None = None) -> str:
    """Workloads in one namespace, or (None) in every one."""
    where = f"namespaces/{namespace}/" if namespace else ""
    return f"/apis/{group}/{version}/{where}workloads"
