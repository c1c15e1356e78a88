"""The headless Service `<job>`: gives every pod the DNS name `<job>-<index>.<job>`."""

from __future__ import annotations

from typing import Any

from ..api import JobSpec
from ..labels import job_labels, pod_selector
from ..naming import service_name


def build_service(job: JobSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(job.name),
            "namespace": job.namespace,
            "labels": job_labels(job.name),
            "ownerReferences": [job.owner_reference],
        },
        "spec": {
            "clusterIP": "None",
            # Workers must resolve the master before it is Ready: it only listens once the
            # trainer starts, and nothing marks it Ready before that.
            "publishNotReadyAddresses": True,
            "selector": pod_selector(job.name),
            "ports": [{"name": "rendezvous", "port": job.master_port, "protocol": "TCP"}],
        },
    }
