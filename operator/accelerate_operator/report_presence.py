"""Which replica the report Service sends to: the active one only. The chart's Service selects
the operator pods labelled ACTIVE_LABEL, and each replica labels its own pod when peering makes
it the active one and unlabels it when it pauses. So the pods' reports (transformers' POSTs
included, which are not retried) reach the replica that takes them; a standby that still gets
one (the label not yet removed) answers 503, and the pod retries."""

from __future__ import annotations

import asyncio
import logging

from .kube import Kube

log = logging.getLogger("accelerate_operator")

ACTIVE_LABEL = "accelerate-operator.io/report-endpoint"
RETRY_SECONDS = 5.0


class Presence:
    """Keeps this replica's pod label in line with whether it is active and its endpoint
    serves, in order, retrying a failed write. Without a pod name (the operator not in a pod)
    it labels nothing."""

    def __init__(self, api: Kube, namespace: str, pod: str | None):
        self.api, self.namespace, self.pod = api, namespace, pod
        self.active = self.serving = False
        self.wanted: bool | None = None
        self.applied: bool | None = None
        self._task: asyncio.Task | None = None

    def set(self, *, active: bool | None = None, serving: bool | None = None) -> None:
        self.active = self.active if active is None else active
        self.serving = self.serving if serving is None else serving
        self.wanted = self.active and self.serving
        if self.pod and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._apply(), name="report endpoint label")

    async def _apply(self) -> None:
        while self.wanted != self.applied:
            wanted = self.wanted
            try:
                await self.api.label_pod(self.namespace, self.pod, ACTIVE_LABEL,
                                         "true" if wanted else None)
            except Exception as error:  # noqa: BLE001 - tried again
                log.warning("labelling pod %s for the report Service failed: %r", self.pod,
                            error)
                await asyncio.sleep(RETRY_SECONDS)
                continue
            self.applied = wanted

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
