"""What the API server's answers mean for the operator: the refusals a pass acts on, and the
answers its callers take as a result rather than an error. Pure (the exception's fields)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from ..apierrors import server_message


class Rejected(ValueError):
    """The API server refused a child for good (admission, Pod Security, quota, validation):
    retrying the same manifest cannot succeed. `kind` is the child's."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class NamespaceTerminating(Exception):
    """The job's namespace is being deleted: the API server creates nothing more in it, and
    every object in it, the job included, is on its way out. The pass ends here (no status
    write) and the job is looked at again later."""

    def __init__(self, namespace: str):
        super().__init__(f"namespace {namespace} is being terminated")
        self.namespace = namespace


class ConfigMapMissing(LookupError):
    """The ConfigMap or key named by spec.accelerateConfigFrom does not exist."""


def missing_configmap(namespace: str, name: str) -> str:
    """Why spec.accelerateConfigFrom cannot be read: its ConfigMap does not exist."""
    return (f"spec.accelerateConfigFrom.configMapKeyRef names ConfigMap {name!r}, which does "
            f"not exist in namespace {namespace!r}; create it with `kubectl create configmap "
            f"{name} --from-file=<accelerate config>`")


def missing_key(name: str, key: str, data: Mapping[str, Any]) -> str:
    """Why spec.accelerateConfigFrom cannot be read: its ConfigMap lacks the key."""
    return (f"ConfigMap {name!r} has no key {key!r} (it has: "
            f"{', '.join(sorted(data)) or 'none'}); "
            "fix spec.accelerateConfigFrom.configMapKeyRef.key")


def verb(method: str) -> str:
    """The metrics' verb of an HTTP method."""
    return {"GET": "get", "POST": "create", "PATCH": "patch", "PUT": "update",
            "DELETE": "delete"}.get(method, "other")


def expected(method: str, status: int | None) -> bool:
    """Answers the callers treat as a result, not an error: a create that found the object
    (409), a read, patch or delete of something gone (404)."""
    return (method == "POST" and status == 409) or (method != "POST" and status == 404)


def refusal(manifest: Mapping[str, Any], error: ApiException) -> Exception:
    """What a refused create means for the pass: a namespace being deleted, a refusal for good
    (the job fails with the server's reason), or an error to retry."""
    kind, name = manifest["kind"], manifest["metadata"]["name"]
    if error.status == 404 and kind == "Workload":
        return Rejected(kind, f"the API server refused Workload {name}: it serves no "
                        f"{manifest.get('apiVersion')} Workloads; install Kueue (v0.14 to "
                        "v0.20), or remove the job's label kueue.x-k8s.io/queue-name")
    message = server_message(error)
    if error.status == 403 and "being terminated" in message:
        return NamespaceTerminating(manifest["metadata"]["namespace"])
    if error.status in (400, 403, 422):
        return Rejected(kind, f"the API server refused {kind} {name}: {message}")
    return error
