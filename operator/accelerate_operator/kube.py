"""The only module that talks to the API server: create-if-absent, delete, status patches,
events and reads. Everything else is pure and testable without a cluster.

Calls are synchronous (the official client); handlers run them in threads."""

from __future__ import annotations

import logging
import os
import random
import string
from collections.abc import Mapping
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from .apierrors import server_message
from .constants import FIELD_MANAGER, GROUP, KIND, PLURAL, VERSION
from .kueue import KUEUE_GROUP, KUEUE_VERSION
from .resources.configmap import ConfigSource
from .status import Event, format_time

log = logging.getLogger("accelerate_operator.kube")

# A node agent that does not answer must not hold a reconcile (or the clock's progress read) long.
LOG_REQUEST_TIMEOUT = 10
WORKLOADS = "workloads"
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"


class Rejected(ValueError):
    """The API server refused a child for good (admission, Pod Security, quota, validation):
    retrying the same manifest cannot succeed."""


def _drain(response: Any) -> None:
    """Writes return the object written; the operator never reads it. Skipping the client's
    model deserialisation (_preload_content=False) saves most of the operator's CPU per job
    (docs/benchmarks.md); reading the raw body returns the connection to the pool."""
    response.read()
    response.release_conn()


class ConfigMapMissing(LookupError):
    """The ConfigMap or key named by spec.accelerateConfigFrom does not exist."""


class Kube:
    """A thin wrapper of the clients the operator needs."""

    def __init__(self, api_client: kubernetes.client.ApiClient):
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.custom = kubernetes.client.CustomObjectsApi(api_client)

    @classmethod
    def from_environment(cls, pool_size: int = 32) -> Kube:
        """In-cluster credentials when running in a pod, else the current kubeconfig."""
        configuration = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException:
            # $KUBECONFIG read now: the client's own default was fixed when it was imported.
            kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                               client_configuration=configuration)
        # Pods of many jobs are created in parallel: urllib3's default pool of 4 would
        # serialise them.
        configuration.connection_pool_maxsize = pool_size
        return cls(kubernetes.client.ApiClient(configuration))

    def create_if_absent(self, manifest: Mapping[str, Any]) -> bool:
        """Create a child; an existing one (a restarted operator, a repeated event) is kept.
        Returns whether it was created."""
        namespace = manifest["metadata"]["namespace"]
        create = {
            "ConfigMap": self.core.create_namespaced_config_map,
            "Service": self.core.create_namespaced_service,
            "Pod": self.core.create_namespaced_pod,
            "Workload": self._create_workload,
        }[manifest["kind"]]
        try:
            _drain(create(namespace, manifest, field_manager=FIELD_MANAGER,
                          _preload_content=False))
        except ApiException as error:
            if error.status == 409:
                return False
            if error.status == 404 and manifest["kind"] == "Workload":
                raise Rejected(
                    f"the API server refused Workload {manifest['metadata']['name']}: it serves "
                    f"no {KUEUE_GROUP}/{KUEUE_VERSION} Workloads; install Kueue, or remove the "
                    "job's label kueue.x-k8s.io/queue-name"
                ) from None
            message = server_message(error)
            if error.status == 403 and "being terminated" in message:
                return False  # the namespace is going away, and the job with it
            if error.status in (400, 403, 422):
                raise Rejected(
                    f"the API server refused {manifest['kind']} {manifest['metadata']['name']}: "
                    f"{message}"
                ) from None
            raise
        return True

    def _create_workload(self, namespace: str, manifest: Mapping[str, Any], **kwargs: Any) -> Any:
        return self.custom.create_namespaced_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOADS, manifest, **kwargs)

    def patch_workload(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """A merge patch of the Workload's spec (spec.active)."""
        self._ignore_gone(self.custom.patch_namespaced_custom_object, KUEUE_GROUP, KUEUE_VERSION,
                          namespace, WORKLOADS, name, dict(patch), field_manager=FIELD_MANAGER,
                          _content_type=MERGE, _preload_content=False)

    def apply_workload_status(self, namespace: str, name: str, body: Mapping[str, Any],
                              manager: str) -> None:
        """A server-side apply of the Workload's status under `manager`, forced, as Kueue's
        own controllers write it. A Workload changed since it was read (its resourceVersion
        in `body`) answers 409: its watch event brings the next pass, which plans again."""
        try:
            self._ignore_gone(self.custom.patch_namespaced_custom_object_status, KUEUE_GROUP,
                              KUEUE_VERSION, namespace, WORKLOADS, name, dict(body),
                              field_manager=manager, force=True, _content_type=APPLY,
                              _preload_content=False)
        except ApiException as error:
            if error.status != 409:
                raise
            log.info("workload %s/%s changed meanwhile: %s", namespace, name,
                     server_message(error))

    def read_kueue_object(self, plural: str, name: str) -> dict[str, Any] | None:
        """A cluster-scoped Kueue object (a ResourceFlavor, a WorkloadPriorityClass), or None."""
        try:
            return self.custom.get_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, plural,
                                                         name)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    @staticmethod
    def _ignore_gone(call: Any, *args: Any, **kwargs: Any) -> None:
        try:
            _drain(call(*args, **kwargs))
        except ApiException as error:
            if error.status != 404:  # the Workload went with its job
                raise

    def delete_pod(self, namespace: str, name: str) -> None:
        try:
            _drain(self.core.delete_namespaced_pod(name, namespace, _preload_content=False))
        except ApiException as error:
            if error.status != 404:
                raise

    def read_pod_log(self, namespace: str, name: str, tail_lines: int, previous: bool = False,
                     container: str | None = None) -> str:
        """The last `tail_lines` lines of a pod's log; "" when the pod (or its log) is gone or
        has not started (400: the container is still waiting)."""
        try:
            return self.core.read_namespaced_pod_log(
                name, namespace, container=container, tail_lines=tail_lines, previous=previous,
                _request_timeout=LOG_REQUEST_TIMEOUT,
            ) or ""
        except ApiException as error:
            if error.status in (400, 404):
                return ""
            raise

    def read_config_source(self, namespace: str, name: str, key: str) -> ConfigSource:
        """The accelerate YAML under `key` and every other key of the ConfigMap (the files
        shipped beside it)."""
        configmap = self._read_configmap(namespace, name, key)
        return ConfigSource(name=name, key=key, text=configmap.data[key],
                            files=dict(configmap.data or {}),
                            binary_files=dict(configmap.binary_data or {}))

    def _read_configmap(self, namespace: str, name: str, key: str) -> Any:
        try:
            configmap = self.core.read_namespaced_config_map(name, namespace)
        except ApiException as error:
            if error.status == 404:
                raise ConfigMapMissing(
                    f"spec.accelerateConfigFrom.configMapKeyRef names ConfigMap {name!r}, which "
                    f"does not exist in namespace {namespace!r}; create it with "
                    f"`kubectl create configmap "
                    f"{name} --from-file=<accelerate config>`"
                ) from None
            raise
        data = configmap.data or {}
        if key not in data:
            raise ConfigMapMissing(
                f"ConfigMap {name!r} has no key {key!r} "
                f"(it has: {', '.join(sorted(data)) or 'none'}); "
                "fix spec.accelerateConfigFrom.configMapKeyRef.key"
            )
        return configmap

    def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        try:
            _drain(self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": dict(status)},
                field_manager=FIELD_MANAGER, _preload_content=False,
            ))
        except ApiException as error:
            if error.status != 404:  # the job was deleted meanwhile: nothing to report on
                raise

    def delete_job(self, namespace: str, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, propagation_policy="Background"
            )
        except ApiException as error:
            if error.status != 404:
                raise

    def post_event(self, job: Mapping[str, Any], event: Event, now) -> None:
        """Events are best effort: failing to post one must not fail the reconcile."""
        metadata = job["metadata"]
        suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=10))
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{metadata['name']}.{suffix}",
                         "namespace": metadata["namespace"]},
            "involvedObject": {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "name": metadata["name"],
                "namespace": metadata["namespace"],
                "uid": metadata.get("uid"),
            },
            "type": event.type,
            "reason": event.reason,
            "message": event.message[:1024],
            "firstTimestamp": format_time(now),
            "lastTimestamp": format_time(now),
            "count": 1,
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
        }
        try:
            _drain(self.core.create_namespaced_event(metadata["namespace"], body,
                                                     _preload_content=False))
        except ApiException as error:
            log.warning("could not post event %s on %s: %s", event.reason, metadata["name"],
                        error.reason)
