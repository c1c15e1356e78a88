"""The ConfigMap `<job>-logs-attempt-<N>`: the last lines of each pod of attempt N, kept when the
operator deletes the group to restart it (a deleted pod's log is gone with it).

Pure: the logs are passed in. The whole ConfigMap stays under MAX_TOTAL_BYTES (the API server
refuses objects over 1 MiB): each pod gets an equal share, and a log over its share keeps its
last lines, since the failure is at the end."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from accelerate_trainer.contract import ATTEMPT_LABEL

from ..api import JobSpec
from ..labels import job_labels
from ..naming import logs_configmap_name

ARCHIVED_LINES = 300
MAX_TOTAL_BYTES = 900 * 1024
TRUNCATED_MARKER = "[... earlier lines dropped to fit the archive ...]\n"


def logs_key(pod_name: str) -> str:
    return f"{pod_name}.log"


def _tail(text: str, lines: int, max_bytes: int) -> str:
    kept = "".join(text.splitlines(keepends=True)[-lines:])
    data = kept.encode()
    if len(data) <= max_bytes:
        return kept
    budget = max(max_bytes - len(TRUNCATED_MARKER.encode()), 0)
    cut = data[len(data) - budget:].decode(errors="ignore")
    # Start on a whole line where one fits, so the first line is not half a line.
    newline = cut.find("\n")
    if 0 <= newline < len(cut) - 1:
        cut = cut[newline + 1:]
    return TRUNCATED_MARKER + cut


def build_logs_configmap(job: JobSpec, attempt: int, logs: Mapping[str, str], *,
                         lines: int = ARCHIVED_LINES,
                         max_bytes: int = MAX_TOTAL_BYTES) -> dict[str, Any]:
    """`logs` maps each pod's name to its log text."""
    share = max_bytes // max(len(logs), 1)
    data = {logs_key(pod): _tail(text, lines, share) for pod, text in sorted(logs.items())}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": logs_configmap_name(job.name, attempt),
            "namespace": job.namespace,
            "labels": {**job_labels(job.name), ATTEMPT_LABEL: str(attempt)},
            "ownerReferences": [job.owner_reference],
        },
        "data": data,
    }
