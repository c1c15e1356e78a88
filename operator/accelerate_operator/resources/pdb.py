"""PodDisruptionBudget `<job>` (spec.runPolicy.podDisruptionBudget): voluntary disruptions
(`kubectl drain`, the eviction API, the cluster autoscaler's scale-down) wait while the training
group runs, instead of stopping it.

One budget per job, selecting every pod of the job whatever its attempt: minAvailable is the
number of nodes, so no running rank may be evicted, and only Ready pods count as available, so
the pods of an old attempt (terminating) or of a new one (starting) hold nothing back.
`unhealthyPodEvictionPolicy: AlwaysAllow` lets a drain evict a pod that is not Ready (still
pulling its image, or failed), which a budget would otherwise hold for ever. Owned by the job:
garbage collection deletes it with the job. Involuntary disruptions (a node that fails, the
kubelet's eviction under memory pressure, a preemption by the scheduler) ignore budgets."""

from __future__ import annotations

from typing import Any

from ..api import JobSpec
from ..labels import job_labels, pod_selector
from ..naming import pdb_name


def build_pdb(job: JobSpec) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": pdb_name(job.name),
            "namespace": job.namespace,
            "labels": job_labels(job.name),
            "ownerReferences": [job.owner_reference],
        },
        "spec": {
            "minAvailable": job.num_nodes,
            "selector": {"matchLabels": pod_selector(job.name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
