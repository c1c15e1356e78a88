"""The operator's Prometheus metrics (`prometheus_client`), and the small calls the runtime makes.

What moved between two statuses of a job (a restart and why, the first Running, the first training
step) is computed by a pure function, `compute_status_change`, from the status before and after a
pass: the same status the operator writes anyway, so a restarted operator never counts a restart
twice (it starts from the stored status). Everything else is a one-line call at the place where
the runtime already knows the number.

Where the runtime calls what (the operator's runtime wires these; nothing here starts itself):
    start_metrics_server(int(os.environ["ACCELERATE_OPERATOR_METRICS_PORT"]))   at start-up,
        when the env is set (the chart sets it from metrics.port);
    count_jobs_from(lambda: the jobs held (metadata and status))                 once, at start-up;
    observe_pass(seconds)                                                        after each pass;
    record_status_change(old, merge_patch(old, patch), created_at, now)          after each
        accepted status patch (status.merge_patch);
    record_api_error(verb, code)                                                 where an API call
        fails.

Exported, all prefixed `accelerate_operator_`:

    jobs{phase}                    gauge      AccelerateJobs by status.phase
    job_goodput_ratio{namespace,job}            gauge  status.goodput.percent / 100
    job_lost_seconds{namespace,job,cause}       gauge  status.goodput.lostSeconds, by cause
    job_interruptions{namespace,job}            gauge  status.goodput.interruptions
    job_last_recovery_seconds{namespace,job}    gauge  status.goodput.lastRecoverySeconds
    restarts_total{reason}         counter    whole-group restarts, by the failure that caused them
    job_seconds_to_running         histogram  creation -> first Running
    job_seconds_to_first_step      histogram  creation -> first progress step > 0
    pass_duration_seconds          histogram  one reconcile pass of one job
    api_errors_total{verb,code}    counter    API requests that failed

The label values are bounded (phases, verbs and causes are fixed sets, reasons and codes are
checked), so no label can grow without end; the per-job gauges have one series per job the
operator holds (as kube-state-metrics has), gone with the job. The job gauges are read from the
jobs' stored status at scrape time: the values of their last status write. No API calls here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from .goodput import LOST_KEYS

PHASES = ("Pending", "Queued", "Running", "Restarting", "Suspended", "Succeeded", "Failed")
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete")
STARTUP_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600, 7200)
PASS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class Metrics:
    """Every metric the operator exports, in one registry (a fresh one per test)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        prefix = "accelerate_operator_"
        # jobs{phase} is counted when scraped, from the source the runtime registers (its job
        # index): no timer keeps it fresh.
        self.jobs_source: Callable[[], Iterable[Mapping[str, Any]]] | None = None
        self.served_on: int | None = None  # the port /metrics is served on
        self.registry.register(_JobsByPhase(self))
        self.registry.register(_JobGoodput(self))
        self.restarts = Counter(f"{prefix}restarts", "Whole-group restarts, by the failure "
                                "that caused them", ["reason"], registry=self.registry)
        self.to_running = Histogram(f"{prefix}job_seconds_to_running", "Seconds from a job's "
                                    "creation to its first Running", buckets=STARTUP_BUCKETS,
                                    registry=self.registry)
        self.to_first_step = Histogram(f"{prefix}job_seconds_to_first_step", "Seconds from a "
                                       "job's creation to its first reported training step",
                                       buckets=STARTUP_BUCKETS, registry=self.registry)
        self.pass_duration = Histogram(f"{prefix}pass_duration_seconds", "Seconds one "
                                       "reconcile pass of one job took", buckets=PASS_BUCKETS,
                                       registry=self.registry)
        self.api_errors = Counter(f"{prefix}api_errors", "API requests that failed, by verb "
                                  "and HTTP status code (0: no answer)", ["verb", "code"],
                                  registry=self.registry)


class _JobsByPhase:
    """The jobs{phase} gauge, computed at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily("accelerate_operator_jobs", "AccelerateJobs by phase",
                                  labels=["phase"])]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily("accelerate_operator_jobs", "AccelerateJobs by phase",
                                   labels=["phase"])
        source = self.metrics.jobs_source
        counts = count_phases(job.get("status") for job in (source() if source else ()))
        for phase in PHASES:
            family.add_metric([phase], counts.get(phase, 0))
        yield family


GOODPUT_FAMILIES = (
    ("job_goodput_ratio", "The share of a job's wall time spent on training that was kept"),
    ("job_lost_seconds", "Seconds of a job's wall time lost, by cause (waiting, startup, "
     "recovery, recomputed, idle)"),
    ("job_interruptions", "Faults that stopped a job's group (restarts, Kueue evictions)"),
    ("job_last_recovery_seconds", "A job's last fault to its next group's first step"),
)


class _JobGoodput:
    """The per-job goodput gauges, from each job's status.goodput at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self._families().values())

    def collect(self) -> Iterable[GaugeMetricFamily]:
        families = self._families()
        source = self.metrics.jobs_source
        for job in source() if source is not None else ():
            add_goodput(families, job)
        yield from families.values()

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily]:
        return {name: GaugeMetricFamily(
            f"accelerate_operator_{name}", text,
            labels=["namespace", "job", "cause"] if name == "job_lost_seconds"
            else ["namespace", "job"]) for name, text in GOODPUT_FAMILIES}


def add_goodput(families: Mapping[str, GaugeMetricFamily], job: Mapping[str, Any]) -> None:
    """One job's samples, when its status has a goodput."""
    metadata, goodput = job.get("metadata") or {}, (job.get("status") or {}).get("goodput")
    if not isinstance(goodput, Mapping) or not isinstance(goodput.get("percent"), int | float):
        return
    labels = [metadata.get("namespace") or "", metadata.get("name") or ""]
    families["job_goodput_ratio"].add_metric(labels, goodput["percent"] / 100.0)
    for cause, seconds in (goodput.get("lostSeconds") or {}).items():
        if cause in LOST_KEYS and isinstance(seconds, int | float):
            families["job_lost_seconds"].add_metric([*labels, cause], seconds)
    families["job_interruptions"].add_metric(labels, int(goodput.get("interruptions") or 0))
    if isinstance(goodput.get("lastRecoverySeconds"), int | float):
        families["job_last_recovery_seconds"].add_metric(labels, goodput["lastRecoverySeconds"])


METRICS = Metrics()


@dataclass(frozen=True)
class StatusChange:
    """What one pass moved, for the metrics: restart reasons (one per restart counted), and the
    seconds since creation when the job first ran or first reported a step (None otherwise)."""
    restart_reasons: tuple[str, ...] = ()
    seconds_to_running: float | None = None
    seconds_to_first_step: float | None = None


def restart_reason(reason: Any) -> str:
    """The label for status.lastFailureReason: the pod's reason (OOMKilled, Evicted...), a
    disruption's (EvictionByEvictionAPI...), Error for a plain non-zero exit, PodDeleted,
    NodeLost, Stalled; Other when there is none or it is not a short CamelCase word (a label
    must stay bounded)."""
    if isinstance(reason, str) and reason.isascii() and reason.isalpha() and len(reason) <= 40:
        return reason
    return "Other"


def _has_condition(status: Mapping[str, Any], type_: str, value: str | None = None) -> bool:
    return any(c.get("type") == type_ and (value is None or c.get("status") == value)
               for c in status.get("conditions") or () if isinstance(c, Mapping))


def _step(status: Mapping[str, Any]) -> int:
    step = (status.get("progress") or {}).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else 0


def compute_status_change(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None,
                          created_at: datetime, now: datetime) -> StatusChange:
    """What moved from `old` to `new` (status dicts as stored; `new` is `old` with the pass's
    patch merged in). Pure. "First" is read from the status itself: the Running condition exists
    once a job ever ran, progress stays after a restart, so neither is counted twice."""
    old, new = old or {}, new or {}
    seconds = max((now - created_at).total_seconds(), 0.0)
    restarts = int(new.get("restarts") or 0) - int(old.get("restarts") or 0)
    reasons = (restart_reason(new.get("lastFailureReason")),) * max(restarts, 0)
    first_running = (_has_condition(new, "Running", "True")
                     and not _has_condition(old, "Running"))
    first_step = _step(new) > 0 and _step(old) == 0 and not old.get("progress")
    return StatusChange(reasons, seconds if first_running else None,
                        seconds if first_step else None)


def record_status_change(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None,
                         created_at: datetime, now: datetime,
                         metrics: Metrics = METRICS) -> StatusChange:
    """Count what one status write moved; call it where the pass's status patch was accepted."""
    change = compute_status_change(old, new, created_at, now)
    for reason in change.restart_reasons:
        metrics.restarts.labels(reason).inc()
    if change.seconds_to_running is not None:
        metrics.to_running.observe(change.seconds_to_running)
    if change.seconds_to_first_step is not None:
        metrics.to_first_step.observe(change.seconds_to_first_step)
    return change


def count_phases(statuses: Iterable[Mapping[str, Any] | None]) -> dict[str, int]:
    """Jobs per phase over the statuses of every job the operator holds (a job with no status
    yet is Pending). Pure."""
    counts = dict.fromkeys(PHASES, 0)
    for status in statuses:
        phase = (status or {}).get("phase") or "Pending"
        if phase in counts:
            counts[phase] += 1
    return counts


def count_jobs_from(source: Callable[[], Iterable[Mapping[str, Any]]],
                    metrics: Metrics = METRICS) -> None:
    """Count jobs{phase} and the per-job goodput at each scrape from `source()`: the jobs the
    runtime holds, each with its metadata and status (for example `lambda: store.values()`).
    The source runs in the metrics server's thread: it must only read."""
    metrics.jobs_source = source


def observe_pass(seconds: float, metrics: Metrics = METRICS) -> None:
    metrics.pass_duration.observe(max(seconds, 0.0))


def record_api_error(verb: str, code: int | None, metrics: Metrics = METRICS) -> None:
    """One failed API request; code None (or 0) when no HTTP answer came (a timeout, a reset)."""
    verb = verb.lower() if verb.lower() in VERBS else "other"
    label = str(code) if isinstance(code, int) and 100 <= code <= 599 else "0"
    metrics.api_errors.labels(verb, label).inc()


def start_metrics_server(port: int, addr: str = "0.0.0.0",  # noqa: S104 (scraped from the pod IP)
                         metrics: Metrics = METRICS) -> tuple[Any, Any] | None:
    """Serve /metrics on `port` from a daemon thread, once per registry: (server, thread), or
    None when it is served already (kopf run again in the same process, as the tests do)."""
    if metrics.served_on is not None:
        return None
    metrics.served_on = port
    return start_http_server(port, addr=addr, registry=metrics.registry)
