"""A failure's root cause, said first: what the kernel, Kubernetes or the failing rank itself
recorded, not the launcher's summary around it. Pure: a Pod manifest or the trainer's report
(the `exit` of contract.REPORT_BODY_KEY's report) in, one line out.

- The kubelet marks a container the kernel killed for memory `OOMKilled`; the limit it hit is the
  container's own `resources.limits.memory`, read from the same pod.
- A launch that failed inside a running pod is reported by its supervisor with the first failing
  rank's own error (`rootCause`, from torchelastic's error files and the cgroup's memory.events),
  and, for memory, `reason: OOMKilled`, `oomKills` and `memoryLimitBytes`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

OOM_KILLED = "OOMKilled"


def memory_limit(pod: Mapping[str, Any], container: str | None) -> str | None:
    """The container's memory limit as written in its spec (`300Mi`), or None."""
    spec_of = pod.get("spec") or {}
    for spec in (*(spec_of.get("initContainers") or []), *(spec_of.get("containers") or [])):
        if spec.get("name") == container:
            return ((spec.get("resources") or {}).get("limits") or {}).get("memory")
    return None


def read_pod_cause(pod: Mapping[str, Any]) -> str | None:
    """`out of memory: ...` for a pod one of whose containers (init containers first: they run
    first) the kernel killed for memory, naming the pod, the container and its limit; None
    otherwise."""
    name = (pod.get("metadata") or {}).get("name", "")
    status = pod.get("status") or {}
    for container in (*(status.get("initContainerStatuses") or []),
                      *(status.get("containerStatuses") or [])):
        terminated = (container.get("state") or {}).get("terminated") or {}
        if terminated.get("reason") == OOM_KILLED:
            return out_of_memory(name, container.get("name"),
                                 memory_limit(pod, container.get("name")))
    return None


def out_of_memory(pod: str, container: str | None, limit: str | None) -> str:
    bound = (f"at its memory limit {limit}" if limit
             else "with no memory limit of its own (the node ran short of memory)")
    return (f"out of memory: the kernel killed container {container} of pod {pod} {bound} "
            f"(OOMKilled)")


def read_exit_cause(ended: Mapping[str, Any], pod: str) -> str | None:
    """The root cause of a failed launch as its pod reported it: the first failing rank's own
    error, or out of memory (the cgroup's counters said so); None when the report has neither.
    Names the pod and the rank when the report's text does not."""
    text = ended.get("rootCause")
    text = text.strip() if isinstance(text, str) else ""
    rank = ended.get("rank")
    where = f"pod {pod}" + (f", rank {rank}" if isinstance(rank, int) else "")
    if ended.get("reason") == OOM_KILLED and not text:
        limit = ended.get("memoryLimitBytes")
        bound = (f"memory limit {_mebibytes(limit)}" if isinstance(limit, int) and limit > 0
                 else "no memory limit")
        text = (f"out of memory: the kernel's OOM killer ended a training process "
                f"({bound})")
    if not text:
        return None
    first, _, rest = text.partition("\n")
    return f"{first} ({where})" + (f"\n{rest}" if rest else "")


def _mebibytes(limit: int) -> str:
    return f"{limit / 2**20:.0f}Mi"
