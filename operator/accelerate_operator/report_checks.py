"""What the report endpoint (report_server.py) decides, pure: whether the caller is a pod the
operator made for the job in the URL, the request body's shape, what of it the job may keep, and
whether that pod may write it. Nothing here calls the API server or reads a clock of its own.

The endpoint speaks KEP-2779's protocol (Kubeflow Trainer's status server): a POST of
`{"trainerStatus": {...}}` (transformers' KubeflowCallback, validated and mapped by
accelerate_trainer.kubeflow_status) and our extension
`{REPORT_BODY_KEY: <the pod's report>}` (accelerate_trainer.contract's report object).

Everything a pod sends is the user's program's writing: a body that is not what the contract
says is refused (400), never an error of the operator's; a report taken keeps only the fields
the operator reads, each string cut to its cap (contract.MAX_MESSAGE_CHARS for a failure's
message and root cause, MAX_FIELD_CHARS for any other) and stripped of control characters but
the newline, so whatever pods send, the job stays small and prints as plain text."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from accelerate_trainer.contract import (
    EXIT_REASONS,
    MAX_BODY_BYTES,
    MAX_FIELD_CHARS,
    MAX_MESSAGE_CHARS,
    NEXT_REPORT_SECONDS,
    REPORT_BODY_KEY,
    printable_text,
)
from accelerate_trainer.kubeflow_status import BadReport, TrainerStatus, trainer_status

from .naming import pod_name
from .pod_state import PodState, read_process_exit
from .progress import MAX_METRICS, MAX_VERSIONS, parse_report
from .report_tokens import Caller

TRAINER_STATUS_KEY = "trainerStatus"
# Keys of the pod's report that only pod 0 may send: its progress and its signs of life.
PROGRESS_KEYS = ("progress", "lastOutputTime", "progressTime", "previous", "versions")
# What the passes read of a report (progress.parse_report, pod_state.read_process_exit,
# build_progress_status); anything else a pod sends is dropped.
PROGRESS_FIELDS = ("step", "total_steps", "epoch", "loss", "samples_per_second", "eta_seconds")
EXIT_NUMBERS = ("attempt", "exitCode", "rank", "oomKills", "memoryLimitBytes")
EXIT_TEXTS = ("time", "signal")
# Numbers past this are garbage (an int of 4,000 digits would overflow a float in the pass).
MAX_NUMBER = 2**63


class Refused(Exception):
    """A request the endpoint refuses: `code` is the HTTP answer, the message says why."""

    def __init__(self, code: int, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.code, self.retry_after = code, retry_after


@dataclass(frozen=True)
class ReportBody:
    """One valid POST: the pod's report (our extension) and/or a KEP-2779 trainerStatus."""

    report: Mapping[str, Any] | None = None
    trainer_status: TrainerStatus | None = None

    @property
    def progress(self) -> bool:
        """Whether it carries what only pod 0 may send."""
        return self.trainer_status is not None or any(
            (self.report or {}).get(key) is not None for key in PROGRESS_KEYS)


# ---- text ------------------------------------------------------------------------------------
def _number(value: Any) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int):
        return value if abs(value) < MAX_NUMBER else None
    return value if math.isfinite(value) and abs(value) < MAX_NUMBER else None


def _text(value: Any, limit: int = MAX_FIELD_CHARS, keep_end: bool = False) -> str | None:
    return printable_text(value, limit, keep_end) if isinstance(value, str) else None


def _kept(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in fields.items() if value is not None}


# ---- the body --------------------------------------------------------------------------------
def parse_body(body: bytes) -> ReportBody:
    """Validate one POST body; raises Refused (413 or 400) naming what is wrong, whatever the
    bytes (nesting too deep for the parser included)."""
    if len(body) > MAX_BODY_BYTES:
        raise Refused(413, f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise Refused(400, "the body is not JSON (or nests too deep)") from None
    if not isinstance(document, dict) or not ({TRAINER_STATUS_KEY, REPORT_BODY_KEY}
                                              & set(document)):
        raise Refused(400, f"the body is not an object with {TRAINER_STATUS_KEY!r} or "
                           f"{REPORT_BODY_KEY!r}")
    status = None
    if TRAINER_STATUS_KEY in document:
        if not isinstance(document[TRAINER_STATUS_KEY], dict):
            raise Refused(400, f"{TRAINER_STATUS_KEY} is not an object")
        try:
            status = trainer_status(document[TRAINER_STATUS_KEY])
        except BadReport as error:
            raise Refused(400, f"{TRAINER_STATUS_KEY}: {error}") from None
    report = document.get(REPORT_BODY_KEY)
    if report is not None:
        report = check_report(report)
    return ReportBody(report, status)


def check_report(report: Any) -> dict[str, Any]:
    """The pod's report as the passes read it (progress.parse_report, pod_state
    .read_process_exit): an object whose `exit`, `progress` and `lastOutputTime`, where not
    null, are what those read; anything else is refused. Returns what the job keeps of it
    (keep_report). A report with all three null (a pod whose failed launch was replaced by a new
    attempt) clears the last one."""
    if not isinstance(report, dict):
        raise Refused(400, f"{REPORT_BODY_KEY} is not an object")
    kept = keep_report(report)
    text = json.dumps(kept)
    if report.get("exit") is not None and read_process_exit(text) is None:
        raise Refused(400, f"{REPORT_BODY_KEY}.exit needs an integer attempt and a non-zero "
                           "integer exitCode")
    parsed = parse_report(text)
    if report.get("progress") is not None and (parsed is None or parsed.progress is None):
        raise Refused(400, f"{REPORT_BODY_KEY}.progress needs a step (a whole number >= 0)")
    if report.get("lastOutputTime") is not None and (parsed is None or parsed.last_output
                                                      is None):
        raise Refused(400, f"{REPORT_BODY_KEY}.lastOutputTime is not an RFC 3339 time")
    return kept


def keep_report(report: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a report the operator reads, each number finite and each string capped
    and printable (the module's docstring); keys present as null stay null."""
    kept: dict[str, Any] = {key: None for key in ("progress", "lastOutputTime", "exit")
                            if key in report and report[key] is None}
    progress, ended = report.get("progress"), report.get("exit")
    if isinstance(progress, dict):
        kept["progress"] = _keep_progress(progress)
    if isinstance(ended, dict):
        kept["exit"] = _keep_exit(ended)
    previous = report.get("previous")
    if isinstance(previous, dict):
        kept["previous"] = _kept({"attempt": _number(previous.get("attempt")),
                                  "step": _number(previous.get("step")),
                                  "progressTime": _text(previous.get("progressTime"))})
    versions = report.get("versions")
    if isinstance(versions, dict):
        kept["versions"] = _kept({printable_text(name, MAX_FIELD_CHARS): _text(version)
                                  for name, version in list(versions.items())[:MAX_VERSIONS]
                                  if isinstance(name, str)}) or None
    return {**kept, **_kept({"lastOutputTime": _text(report.get("lastOutputTime")),
                             "progressTime": _text(report.get("progressTime")),
                             "attempt": _number(report.get("attempt"))})}


def _keep_progress(progress: Mapping[str, Any]) -> dict[str, Any]:
    kept = _kept({key: _number(progress.get(key)) for key in PROGRESS_FIELDS})
    metrics = progress.get("metrics")
    if isinstance(metrics, dict):
        numbers = {printable_text(name, MAX_FIELD_CHARS): _number(value)
                   for name, value in list(metrics.items())[:MAX_METRICS]
                   if isinstance(name, str)}
        kept["metrics"] = _kept(numbers) or None
    return _kept(kept)


def _keep_exit(ended: Mapping[str, Any]) -> dict[str, Any]:
    kept: dict[str, Any] = {key: _number(ended.get(key)) for key in EXIT_NUMBERS}
    kept.update({key: _text(ended.get(key)) for key in EXIT_TEXTS})
    kept["message"] = _text(ended.get("message"), MAX_MESSAGE_CHARS, keep_end=True)
    kept["rootCause"] = _text(ended.get("rootCause"), MAX_MESSAGE_CHARS)
    kept["reason"] = ended.get("reason") if ended.get("reason") in EXIT_REASONS else None
    return _kept(kept)


# ---- the caller ------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobGroup:
    """What the endpoint reads of a job from the operator's cache: its uid, the attempt of its
    current group, its number of nodes, and (controller owner uid, pod) of each pod indexed
    under its name."""

    uid: str
    attempt: int
    num_nodes: int | None  # None: not resolved yet (no index is checked against it)
    pods: Iterable[tuple[str | None, PodState]]


def job_pod(caller: Caller, namespace: str, job: str, group: JobGroup | None) -> PodState:
    """The caller's pod when it is a live pod the operator made for job `namespace/job`, of
    its current group; else Refused. `group` is None when the job is not indexed.

    The pod must be the job's by what the operator sets together: its name `<job>-<index>`
    (naming.pod_name, unique in the namespace) for an index below the job's numNodes, its
    controller ownerReference to the job's uid, and the token's pod uid (so not a pod of the
    same name made before or after). A caller from another namespace learns nothing: the same
    403 whether the job exists or not."""
    nobody = Refused(403, f"the token's pod is no live pod of AccelerateJob {namespace}/{job}")
    if caller.namespace != namespace:
        raise nobody
    if group is None:
        raise Refused(404, f"no AccelerateJob {namespace}/{job}")
    pod = next((state for owner, state in group.pods
                if owner == group.uid and state.uid == caller.pod_uid), None)
    if pod is None or pod.name != caller.pod_name or pod.name != pod_name(job, pod.index) \
            or not 0 <= pod.index < (group.num_nodes or pod.index + 1):
        raise nobody
    if pod.deleting or pod.finished:
        raise Refused(403, f"pod {pod.name} is no longer live")
    if pod.attempt != group.attempt:
        raise Refused(403, f"pod {pod.name} is of attempt {pod.attempt}, not of the current "
                           f"group ({group.attempt})")
    return pod


def may_write(pod: PodState, body: ReportBody, job: str) -> None:
    """Progress only from pod 0; else Refused (403)."""
    if body.progress and pod.index != 0:
        raise Refused(403, f"progress comes only from pod 0 of job {job}, not {pod.name}")


# ---- when the job's pass sees it -------------------------------------------------------------
PASS_NOW, PASS_WHEN_DUE = "now", "when due"


def pass_for_report(before: str | None, after: str) -> str | None:
    """When the job's pass must run after a pod's report (its text as the passes read it, before
    and after the report was taken): PASS_NOW for what changes a decision (a failed launch
    reported or withdrawn, another attempt, the attempt's first step); PASS_WHEN_DUE for what only
    the status shows (new progress, the versions), written when the progress write interval
    allows; None for a sign of life alone (lastOutputTime), which the stall check's own timer
    reads from the store."""
    if read_process_exit(before) != read_process_exit(after):
        return PASS_NOW
    old, new = _fields(before), _fields(after)
    if before is not None and old.get("attempt") != new.get("attempt"):
        return PASS_NOW
    if _step(before) is None and _step(after) is not None:
        return PASS_NOW
    if old.get("progress") != new.get("progress") or old.get("versions") != new.get("versions"):
        return PASS_WHEN_DUE
    return None


def next_report_seconds(clock: float, next_write: float, write_seconds: float) -> float:
    """When pod 0's next progress report is due (contract.NEXT_REPORT_KEY), by the operator's
    monotonic `clock`: one write interval after the write the report just taken goes into (now,
    or `next_write` when the last write's interval has not ended), so that the next report comes
    as the next write falls due and is written as it comes. Within NEXT_REPORT_SECONDS."""
    low, high = NEXT_REPORT_SECONDS
    return min(max(max(clock, next_write) + write_seconds - clock, low), high)


def _fields(text: str | None) -> dict[str, Any]:
    value = json.loads(text) if text else {}
    return value if isinstance(value, dict) else {}


def _step(text: str | None) -> int | None:
    report = parse_report(text)
    return report.step if report is not None else None
