"""What the report endpoint (report_server.py) decides, pure: the request body's shape, who the
caller is (a TokenReview's answer), whether that pod may write what it sent, and how often a
caller may ask. Nothing here calls the API server or reads a clock of its own.

The endpoint speaks KEP-2779's protocol (Kubeflow Trainer's status server): a POST of
`{"trainerStatus": {...}}` (transformers' KubeflowCallback, validated and mapped by
accelerate_trainer.kubeflow_status) and our extension
`{REPORT_BODY_KEY: <the pod's report>}` (accelerate_trainer.contract's report object)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from accelerate_trainer.contract import MAX_BODY_BYTES, REPORT_AUDIENCE, REPORT_BODY_KEY
from accelerate_trainer.kubeflow_status import BadReport, TrainerStatus, trainer_status

from .pod_state import PodState, read_process_exit
from .progress import parse_report

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
TRAINER_STATUS_KEY = "trainerStatus"
# Keys of the pod's report that only pod 0 may send: its progress and its signs of life.
PROGRESS_KEYS = ("progress", "lastOutputTime", "progressTime", "previous")


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

    @property
    def exit(self) -> bool:
        return (self.report or {}).get("exit") is not None


def parse_body(body: bytes) -> ReportBody:
    """Validate one POST body; raises Refused (413 or 400) naming what is wrong."""
    if len(body) > MAX_BODY_BYTES:
        raise Refused(413, f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise Refused(400, "the body is not JSON") from None
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
    null, are what those read; anything else is refused. A report with all three null (a pod
    whose failed launch was replaced by a new attempt) clears the last one."""
    if not isinstance(report, dict):
        raise Refused(400, f"{REPORT_BODY_KEY} is not an object")
    text = json.dumps(report)
    if report.get("exit") is not None and read_process_exit(text) is None:
        raise Refused(400, f"{REPORT_BODY_KEY}.exit needs an integer attempt and a non-zero "
                           "integer exitCode")
    parsed = parse_report(text)
    if report.get("progress") is not None and (parsed is None or parsed.progress is None):
        raise Refused(400, f"{REPORT_BODY_KEY}.progress needs a step (a whole number >= 0)")
    if report.get("lastOutputTime") is not None and (parsed is None or parsed.last_output
                                                      is None):
        raise Refused(400, f"{REPORT_BODY_KEY}.lastOutputTime is not an RFC 3339 time")
    return report


@dataclass(frozen=True)
class Caller:
    """Who a token belongs to, as the API server's TokenReview said: a service account's token
    bound to a pod."""

    namespace: str
    pod_name: str
    pod_uid: str


def read_caller(status: Mapping[str, Any] | None) -> Caller | None:
    """A TokenReview's status -> the pod the token is bound to; None for a token that is not
    authenticated, not of REPORT_AUDIENCE, not a service account's, or bound to no pod."""
    status = status or {}
    if not status.get("authenticated") or REPORT_AUDIENCE not in (status.get("audiences")
                                                                  or []):
        return None
    user = status.get("user") or {}
    username, extra = user.get("username") or "", user.get("extra") or {}
    parts = username[len(SERVICE_ACCOUNT_PREFIX):].split(":")
    names, uids = extra.get(POD_NAME_EXTRA) or [], extra.get(POD_UID_EXTRA) or []
    if not username.startswith(SERVICE_ACCOUNT_PREFIX) or len(parts) != 2 or not all(parts) \
            or len(names) != 1 or len(uids) != 1:
        return None
    return Caller(parts[0], names[0], uids[0])


def authorize(caller: Caller, namespace: str, job: str, job_uid: str, group_attempt: int,
              pods: Iterable[tuple[str | None, PodState]], body: ReportBody) -> PodState:
    """The caller's pod when it may write `body` to job `namespace/job`; else Refused (403):
    it must be a live pod of that job (same namespace, the job's uid as owner, the token's
    pod name and uid); progress only from pod 0; anything only from the current group."""
    where = f"job {namespace}/{job}"
    if caller.namespace != namespace:
        raise Refused(403, f"the token is of namespace {caller.namespace}, not {namespace}")
    pod = next((state for owner, state in pods
                if owner == job_uid and state.uid == caller.pod_uid), None)
    if pod is None or pod.name != caller.pod_name:
        raise Refused(403, f"the token's pod {caller.pod_name} ({caller.pod_uid}) is no pod "
                           f"of {where}")
    if pod.deleting or pod.finished:
        raise Refused(403, f"pod {pod.name} is no longer live")
    if pod.attempt != group_attempt:
        raise Refused(403, f"pod {pod.name} is of attempt {pod.attempt}, not of the current "
                           f"group ({group_attempt})")
    if body.progress and pod.index != 0:
        raise Refused(403, f"progress comes only from pod 0 of {where}, not {pod.name}")
    return pod
