"""What a pass reads of Kueue's cluster-scoped objects, through the reader it is given (the pass's
Kube.read_kueue_object: this package makes no API call of its own): the value of the job's
WorkloadPriorityClass until its Workload exists, and the ResourceFlavors its admission names
until its group is all there (its pods are about to be placed on them)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..api import JobSpec
from ..pod_state import PodState
from .workload import PRIORITY_LABEL, KueueView

# (plural, name) -> the object, or None when it does not exist.
ReadObject = Callable[[str, str], Awaitable[Mapping[str, Any] | None]]


async def read_kueue(view: KueueView, job: JobSpec, pods: Sequence[PodState],
                     read: ReadObject) -> tuple[KueueView, str | None]:
    """The view completed with what the job's next step needs, and why the job cannot run
    (its priority class does not exist), or None."""
    if view.workload is None:
        if not view.priority_class:
            return view, None
        found = await read("workloadpriorityclasses", view.priority_class)
        if found is None:
            return view, (f"label {PRIORITY_LABEL} names WorkloadPriorityClass "
                          f"{view.priority_class!r}, which does not exist; create it, or fix "
                          "the label")
        return replace(view, priority=int(found.get("value") or 0)), None
    status = view.workload_status
    if len([p for p in pods if p.live]) >= job.num_nodes or not status.admitted:
        return view, None
    flavors, missing = {}, []
    for name in status.flavors:
        found = await read("resourceflavors", name)
        if found is None:
            missing.append(name)
        else:
            flavors[name] = found.get("spec") or {}
    return replace(view, flavors=flavors, missing_flavors=tuple(missing)), None
