"""One reconcile pass, in four named steps: parse (api.py), observe (observe.py), plan (plan.py,
pure), apply (apply.py, through kube.py). The work queue (workqueue.py) runs at most one pass per
job at a time, so a pass owns its job's JobState while it runs.

Level-triggered: a pass starts from what is there, never from what happened, so any event of a
job, or a requeue, may run it, and a pass with nothing to change makes no API call. The status is
written once per pass, progress included; a child the API server refuses is planned with at once
(the job fails with the server's reason), in the same pass."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from .api import JobSpec, SpecError, parse_job
from .apply import Applier
from .constants import FINISHED_PHASES
from .kube import Kube
from .kueue import QueueContext
from .observe import observe
from .observed import Observed, PodState, Reporting
from .plan import Actions, plan_pass
from .state import JobState
from .timefmt import utcnow

log = logging.getLogger("accelerate_operator")

# An unfinished job is looked at again at least this often: a pass that changed nothing is
# cheap, and this bounds how long anything missed (a lost event, a failed read) can last.
RESYNC_SECONDS = 30.0


def parse_spec(body: Mapping[str, Any], status: Mapping[str, Any]) -> JobSpec | None:
    """The parsed job, or None (logged) when it cannot be parsed or is being deleted (its
    children go with it). `status` is the latest one (our own last write may be newer than the
    body's): its topology, once resolved, is not read from the ConfigMap again."""
    metadata = body["metadata"]
    try:
        job = parse_job(body, status)
    except SpecError as error:
        log.warning("job %s/%s cannot be parsed: %s", metadata.get("namespace"),
                    metadata["name"], error)
        return None
    return None if metadata.get("deletionTimestamp") else job


def requeue_after(seen: Observed, actions: Actions) -> float | None:
    """When time alone will next change the job: the plan's own time (a deadline, a TTL, a
    stall), what observing held back (a progress write, the trainer's versions), the resync of
    an unfinished job; None for a finished job with none of these. A running job's progress
    needs no timer: pod 0's reports come as events."""
    phase = (actions.status or {}).get("phase") or seen.status.get("phase")
    due = [RESYNC_SECONDS if phase not in FINISHED_PHASES else None, actions.plan.requeue_after,
           seen.due_in]
    known = [d for d in due if d is not None]
    return min(known) if known else None


class Reconciler:
    def __init__(self, kube: Kube, clock: Callable[[], float] = time.monotonic):
        self.kube = kube
        self.clock = clock
        self.applier = Applier(kube, clock)
        self.reporting = Reporting()

    async def reconcile(self, state: JobState, body: Mapping[str, Any],
                        pods: Iterable[PodState], children: Iterable[tuple[str, str]] = (),
                        queue: QueueContext | None = None) -> float | None:
        """Bring one job's children and status in line with its spec. `pods` and `children`
        ((kind, name) of its ConfigMaps and Services) are what the indexes show, `queue` what
        they show of Kueue (None: the Kueue integration is off). Returns when time alone will
        next change the job (seconds), or None."""
        pods = list(pods)
        job = parse_spec(body, state.latest_status(body.get("status") or {}))
        if job is None:
            return None
        now = utcnow()
        seen = await observe(self.kube, state, body, job, pods, children, queue, self.clock(),
                             now, self.reporting)
        actions = plan_pass(seen, now)
        refused = await self.applier.apply(state, seen, actions, now)
        if refused is not None:
            # Planned with at once: the job fails with the server's reason; such a plan creates
            # nothing more, so it cannot be refused again.
            seen = replace(seen, refused=refused)
            actions = plan_pass(seen, now)
            await self.applier.apply(state, seen, actions, now)
        return requeue_after(seen, actions)
