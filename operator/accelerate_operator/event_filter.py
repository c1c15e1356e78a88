"""Which events reach the controller, decided from the event alone: kopf's `when=` filter
(handlers.py) is `hands_over`, and the controller (controller.py) reads the job an event is about
and whether it is a deletion from here. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .constants import KIND, PENDING
from .indexes import JobKey, owning_job

# Children whose creation or change the pass does not read: only their deletion (or a listing)
# runs it.
_CREATED_ONLY = ("ConfigMap", "Service", "PodDisruptionBudget")


def job_key(kind: str, metadata: Mapping[str, Any]) -> JobKey | None:
    """The job an event is about: the job itself, or the owner of a child (its label)."""
    if kind == KIND:
        return metadata.get("namespace") or "", metadata["name"]
    return owning_job(metadata)


def event_matters(kind: str, event_type: str | None, body: Mapping[str, Any]) -> bool:
    """Whether an event (not a deletion) must run its job's pass, from the event alone.
    - A job: created, listed, or its spec changed since a pass last decided from it (its
      generation is not the status's observedGeneration), as controller-runtime's
      GenerationChangedPredicate: the echo of our own status write runs none.
    - A pod: unless it is ADDED just as it was created (unscheduled, no condition): its creator,
      a pass, knows it already; what happens to it next runs the pass. Listed, it always does.
    - A Workload: always. The queue merges a burst of events, and a pass with nothing to
      change makes no API call.
    - A ConfigMap, Service or PDB: only listed (type None, kopf listed again); created or
      changed, it runs none (the pass that created it knows)."""
    if kind == KIND:
        status = body.get("status") or {}
        return (event_type != "MODIFIED"
                or body["metadata"].get("generation") != status.get("observedGeneration"))
    if kind == "Pod" and event_type == "ADDED":
        return not _as_created(body)
    return kind not in _CREATED_ONLY or event_type is None


def _as_created(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return (not (pod.get("spec") or {}).get("nodeName") and not status.get("conditions")
            and status.get("phase", PENDING) == PENDING)


def hands_over(kind: str, event_type: str | None, body: Mapping[str, Any]) -> bool:
    """Whether an event reaches the controller at all: the one decision, used by kopf as its
    `when=` filter (handlers.py), so kopf invokes no handler for an event that changes nothing.
    A job deleted, a child deleted or being deleted, or an event that matters."""
    metadata = body["metadata"]
    return ((kind == KIND and event_type == "DELETED") or is_deletion(kind, event_type, metadata)
            or event_matters(kind, event_type, body))


def is_deletion(kind: str, event_type: str | None, metadata: Mapping[str, Any]) -> bool:
    """A child deleted or being deleted: it may be going with its job (the grace check)."""
    return kind != KIND and (event_type == "DELETED"
                             or bool(metadata.get("deletionTimestamp")))
