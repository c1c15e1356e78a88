"""What the report endpoint keeps in memory, pure (a clock is passed in): the latest report of
each pod (ReportStore, read by the passes where they read the pod), the callers' request rates
(RateLimiter) and TokenReview answers (ReviewCache). Every map is bounded, and a pod's or job's
entries go with it: nothing outlives the job."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from accelerate_trainer.kubeflow_relay import BadReport, RelayState, TrainerStatus

from .timefmt import format_time

JobKey = tuple[str, str]
V = TypeVar("V")


class ReportStore:
    """Per pod uid, its latest report (the JSON object the passes parse: progress.parse_report,
    observed.read_process_exit). A trainerStatus (KEP-2779) is turned into that report's
    progress as the trainer's relay turns it into a progress line, remembering each pod's step
    counts (RelayState: the last POST of a run carries none)."""

    def __init__(self) -> None:
        self._reports: dict[str, dict[str, Any]] = {}
        self._relays: dict[str, RelayState] = {}
        self._pods: dict[JobKey, set[str]] = {}

    def take_report(self, key: JobKey, uid: str, report: Mapping[str, Any]) -> None:
        """The pod's own report replaces the last; a progress that only came by trainerStatus
        stays while the report brings none."""
        old = self._reports.get(uid) or {}
        new = dict(report)
        if "progress" not in new and "progress" in old:
            new.update({k: old[k] for k in ("progress", "progressTime") if k in old})
        self._put(key, uid, new)

    def take_trainer_status(self, key: JobKey, uid: str, status: TrainerStatus,
                            now: datetime) -> None:
        """A KEP-2779 trainerStatus: the progress of the report, seen now. Raises BadReport
        when it contradicts itself (a step past the total)."""
        progress = self._relays.setdefault(uid, RelayState()).build_report(status)
        new = dict(self._reports.get(uid) or {})
        new["lastOutputTime"] = format_time(now)
        if progress is not None:
            new["progress"] = {k: v for k, v in progress.items() if v is not None}
            new["progressTime"] = format_time(now)
        self._put(key, uid, new)

    def _put(self, key: JobKey, uid: str, report: dict[str, Any]) -> None:
        self._reports[uid] = report
        self._pods.setdefault(key, set()).add(uid)

    def text(self, uid: str) -> str | None:
        report = self._reports.get(uid)
        return json.dumps(report) if report is not None else None

    def forget_pod(self, key: JobKey, uid: str) -> None:
        self._reports.pop(uid, None)
        self._relays.pop(uid, None)
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
        return len(self._reports)


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


@dataclass(frozen=True)
class _Entry(Generic[V]):
    value: V
    until: float


class ReviewCache(Generic[V]):
    """TokenReview answers by the token's hash, each kept `ttl` seconds (a refusal
    `negative_ttl`), at most `max_entries` (the oldest go first)."""

    def __init__(self, ttl: float, negative_ttl: float, max_entries: int = 10_000) -> None:
        self.ttl, self.negative_ttl, self.max_entries = ttl, negative_ttl, max_entries
        self._entries: OrderedDict[str, _Entry[V | None]] = OrderedDict()

    def get(self, digest: str, now: float) -> tuple[bool, V | None]:
        """(found, value): a value None found is a cached refusal."""
        entry = self._entries.get(digest)
        if entry is None or entry.until <= now:
            self._entries.pop(digest, None)
            return False, None
        return True, entry.value

    def put(self, digest: str, value: V | None, now: float) -> None:
        self._entries.pop(digest, None)
        self._entries[digest] = _Entry(value, now + (self.ttl if value is not None
                                                      else self.negative_ttl))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


__all__ = ["BadReport", "RateLimiter", "ReportStore", "ReviewCache"]
