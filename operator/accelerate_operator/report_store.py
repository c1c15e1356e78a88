"""What the report endpoint keeps in memory, pure (a clock is passed in): the latest report of
each pod (ReportStore, read by the passes where they read the pod) and the callers' request rates
(RateLimiter). Every map is bounded, and a pod's or job's entries go with it: nothing outlives
the job."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping
from datetime import datetime
from typing import Any

from accelerate_trainer.kubeflow_status import BadReport, KubeflowProgress, TrainerStatus

from .progress import RECEIVED_KEY
from .timefmt import format_time, parse_time

JobKey = tuple[str, str]


class ReportStore:
    """Per pod uid, its latest report (the JSON object the passes parse: progress.parse_report,
    observed.read_process_exit), and what its KEP-2779 trainerStatus POSTs said: a progress as
    accelerate_trainer.kubeflow_status maps it (KubeflowProgress remembers the run's step
    counts: the last POST of a run carries none) and a sign of life. The pod's own progress
    wins over transformers'; a new attempt starts transformers' afresh. Each report gets
    progress.RECEIVED_KEY, when the operator took it (its own clock, never the pod's): the time
    status.progress says it is from."""

    def __init__(self) -> None:
        self._reports: dict[str, dict[str, Any]] = {}
        self._kubeflow: dict[str, tuple[KubeflowProgress, Any, dict[str, Any]]] = {}
        self._pods: dict[JobKey, set[str]] = {}

    def take_report(self, key: JobKey, uid: str, report: Mapping[str, Any],
                    now: datetime) -> None:
        self._reports[uid] = {**report, RECEIVED_KEY: format_time(now, precise=True)}
        self._pods.setdefault(key, set()).add(uid)
        kubeflow = self._kubeflow.get(uid)
        if kubeflow is not None and kubeflow[1] != report.get("attempt"):
            del self._kubeflow[uid]

    def take_trainer_status(self, key: JobKey, uid: str, status: TrainerStatus,
                            now: datetime) -> None:
        """Raises BadReport when it contradicts itself (a step past the total)."""
        attempt = (self._reports.get(uid) or {}).get("attempt")
        tracker, seen_attempt, view = self._kubeflow.get(uid) or (KubeflowProgress(), attempt,
                                                                   {})
        if seen_attempt != attempt:
            tracker, view = KubeflowProgress(), {}
        progress, stamp = tracker.build_report(status), format_time(now, precise=True)
        view = {**view, "lastOutputTime": stamp}
        if progress is not None:
            view.update({"progress": {k: v for k, v in progress.items() if v is not None},
                         "progressTime": stamp, RECEIVED_KEY: stamp})
        self._kubeflow[uid] = (tracker, attempt, view)
        self._pods.setdefault(key, set()).add(uid)

    def text(self, uid: str) -> str | None:
        """The pod's report as the passes read it, or None before its first."""
        report, kubeflow = self._reports.get(uid), self._kubeflow.get(uid)
        if report is None and kubeflow is None:
            return None
        merged = dict(report or {})
        if kubeflow is not None:
            view = kubeflow[2]
            if merged.get("progress") is None and "progress" in view:
                merged.update({key: view[key] for key in ("progress", "progressTime",
                                                          RECEIVED_KEY)})
            own = parse_time(merged.get("lastOutputTime"))
            if own is None or own < parse_time(view["lastOutputTime"]):
                merged["lastOutputTime"] = view["lastOutputTime"]
        return json.dumps(merged)

    def forget_pod(self, key: JobKey, uid: str) -> None:
        self._reports.pop(uid, None)
        self._kubeflow.pop(uid, None)
        pods = self._pods.get(key)
        if pods is not None:
            pods.discard(uid)
            if not pods:
                del self._pods[key]

    def keep_only(self, key: JobKey, uids: Iterable[str]) -> None:
        """The job's pods now: reports of any other pod of it are dropped."""
        for uid in self._pods.get(key, set()) - set(uids):
            self.forget_pod(key, uid)

    def forget_job(self, key: JobKey) -> None:
        self.keep_only(key, ())

    def __len__(self) -> int:
        return len(set(self._reports) | set(self._kubeflow))


class RateLimiter:
    """A token bucket per key: `burst` requests at once, then `rate` per second. Bounded: the
    least recently seen key is dropped past `max_keys` (it starts again with a full bucket)."""

    def __init__(self, rate: float, burst: float, max_keys: int = 10_000) -> None:
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()

    def take(self, key: Hashable, now: float) -> float:
        """0 when the request may go, else the seconds until it may (Retry-After)."""
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        wait = 0.0 if tokens >= 1 else (1 - tokens) / self.rate
        self._buckets[key] = (tokens - 1 if wait == 0 else tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return wait


__all__ = ["BadReport", "RateLimiter", "ReportStore"]
