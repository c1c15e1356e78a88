"""The contract between the operator and the trainer: what one side writes and the other reads.

The operator (accelerate_operator) sets these env vars on every trainer container, mounts the
rendered accelerate YAML at CONFIG_FILE, labels the pods with these keys, reads the trainer's exit
code and takes the pods' reports at its endpoint (the one channel from the trainer: no pod log is
read while a job runs). The trainer (accelerate_trainer) reads the env, opens the file, exits
with CONFIG_ERROR_EXIT_CODE on a bad config, and its supervisor POSTs the reports. Both import
the names from here, so they cannot drift apart.

It lives in the trainer package because the training image must not need the operator's
dependencies; the operator imports nothing else of the trainer but this module and the config
checks (.importlinter). Names and one line format only: no I/O, no imports beyond the standard
library.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

# ---- the env of every trainer container (users may not set these: a CEL rule in the CRD) ----
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
ENV_NODE_RANK = "NODE_RANK"
ENV_NUM_NODES = "NUM_NODES"
ENV_NPROC_PER_NODE = "NPROC_PER_NODE"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_CONFIG_FILE = "ACCELERATE_CONFIG_FILE"
ENV_CHECKPOINT_DIR = "ACCELERATE_CHECKPOINT_DIR"
ENV_JOB_NAME = "ACCELERATE_JOB_NAME"
# Which attempt the training processes run: 0, then 1 after the first restart (in place or of
# the whole group)... Set on the pod for its first launch; the supervisor sets it for the
# launches after an in-place restart (RUN_ATTEMPT_FILE).
ENV_JOB_ATTEMPT = "ACCELERATE_JOB_ATTEMPT"
# accelerate's own name: `Accelerator` takes it over the gradient_accumulation_steps the script
# passes (accelerate 1.15 accelerator.py, parse_choice_from_env). The operator sets it on the pods
# of an elastic job (spec.elastic): the accumulation at the size the group runs at, so the global
# batch stays; the trainer also passes it to a DeepSpeed launch, whose launcher would otherwise
# set it from the accelerate YAML.
ENV_GRADIENT_ACCUMULATION = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"

# ---- the rendered accelerate YAML, mounted from the ConfigMap `<job>-accelerate-config` ----
CONFIG_MOUNT_PATH = "/etc/accelerate"
CONFIG_KEY = "config.yaml"
CONFIG_FILE = f"{CONFIG_MOUNT_PATH}/{CONFIG_KEY}"

# ---- the user's code, shipped by `accelerate-job submit` (spec.code) ----
# The ConfigMap spec.code.configMap names is mounted read-only here; its binaryData key
# CODE_ARCHIVE_KEY holds a gzip tarball that the trainer checks against ENV_CODE_SHA256 and
# unpacks into a writable WORKSPACE_DIR (an emptyDir the operator adds when the template mounts
# nothing there) before `accelerate launch`. ENV_CODE_REQUIREMENTS, when set, is a pip
# requirements file in the workspace, installed first. Users may not set ACCELERATE_CODE_* names.
CODE_MOUNT_PATH = "/etc/accelerate-code"
CODE_ARCHIVE_KEY = "code.tar.gz"
WORKSPACE_DIR = "/workspace"
ENV_CODE_ARCHIVE = "ACCELERATE_CODE_ARCHIVE"
ENV_CODE_SHA256 = "ACCELERATE_CODE_SHA256"
ENV_CODE_REQUIREMENTS = "ACCELERATE_CODE_REQUIREMENTS"
ENV_CODE_WORKSPACE = "ACCELERATE_CODE_WORKSPACE"

# ---- exit codes ----
# EX_CONFIG from sysexits.h: the operator treats this exit code as permanent (no restart can fix
# a bad config), so a job with a broken config fails at once instead of using up its restarts.
CONFIG_ERROR_EXIT_CODE = 78
# EX_TEMPFAIL: installing spec.code.requirements failed. Not permanent (a package index outage
# passes), so the group restarts; list 75 in spec.runPolicy.permanentExitCodes to fail at once.
REQUIREMENTS_EXIT_CODE = 75
# A rank asked to stop (SIGTERM: a drain, a preemption, the operator stopping the group) that
# saved a complete checkpoint with the others first (accelerate_trainer.checkpoints
# .checkpoint_on_stop). Not 0, so a stopped group is never taken for a finished one.
STOPPED_EXIT_CODE = 83

# ---- labels on every child; the job-name label is how the operator finds a job's pods ----
JOB_NAME_LABEL = "accelerate-operator.io/job-name"
NODE_INDEX_LABEL = "accelerate-operator.io/node-index"
ATTEMPT_LABEL = "accelerate-operator.io/attempt"

# ---- the progress line: `ACCELERATE_PROGRESS {json}` on rank 0's stdout ----
PROGRESS_PREFIX = "ACCELERATE_PROGRESS"
PROGRESS_LINE = re.compile(rf"^{PROGRESS_PREFIX} (\{{.*\}})\s*$", re.M)


def format_progress_line(report: Mapping[str, Any]) -> str:
    """One progress line, newline included; keys whose value is None are left out."""
    return f"{PROGRESS_PREFIX} {json.dumps({k: v for k, v in report.items() if v is not None})}\n"


# ---- the report: what a pod POSTs to the operator's endpoint (accelerate_trainer.report_push) ----
# One JSON object (REPORT_BODY_KEY's value, below):
#   {"progress": {<the newest ACCELERATE_PROGRESS object>}, "lastOutputTime": "<RFC 3339 UTC>",
#    "progressTime": "<RFC 3339 UTC>", "versions": {"accelerate": "1.15.0", ...},
#    "exit": {"attempt": N, "exitCode": C, "time": "<RFC 3339 UTC>", "message": "<last lines>"},
#    "attempt": N, "previous": {"attempt": N-1, "step": S, "progressTime": "<RFC 3339 UTC>"}}
# `lastOutputTime` is when rank 0's container last wrote anything (stall detection),
# `progressTime` when the progress line came (the step's time, for goodput), `versions` the
# libraries the training runs with (status.trainer); all from pod 0 only; `attempt` the attempt
# of the launch the progress is from, `previous` (after an in-place restart) the last step of
# the attempt before and when it came: where its recovery began.
# `exit`, from any pod restarted in place: its launcher of attempt N ended with C and the pod
# waits for the operator's decision (RUN_ATTEMPT_ANNOTATION). Where the launch's root cause is
# known (accelerate_trainer.root_cause), `exit` also has EXIT_ROOT_CAUSE_FIELDS: "rootCause" (the
# first failing rank's own error line and the traceback lines above it, python's own line for a
# script it could not open, "out of memory: ..." with the limit, or "the rendezvous did not
# complete ..."), "rank" (that rank's global rank), "signal" ("SIGKILL"... when a signal ended
# it), "reason" (EXIT_REASONS: OOMKilled, RendezvousTimeout, RendezvousFailed, PeerLost: the
# rank failed only because another rank went away under it), "oomKills" (OOM
# kills the container's cgroup counted during the launch) and "memoryLimitBytes" (its limit).
# What the operator keeps of a report it takes: these fields only (of `progress`, step,
# total_steps, epoch, loss, samples_per_second, eta_seconds and up to 16 `metrics`; up to 16
# `versions`), numbers finite, `exit.message` cut to its last MAX_MESSAGE_CHARS characters and
# `exit.rootCause` to its first, every other string to MAX_FIELD_CHARS, control characters but
# the newline dropped (accelerate_operator.report_checks).
EXIT_ROOT_CAUSE_FIELDS = ("rootCause", "rank", "signal", "reason", "oomKills", "memoryLimitBytes")
EXIT_REASONS = ("OOMKilled", "RendezvousTimeout", "RendezvousFailed", "PeerLost")
MAX_MESSAGE_CHARS = 2048
MAX_FIELD_CHARS = 128
# Control characters (C0 but newline and tab, DEL, C1), bidirectional overrides and lone
# surrogates: a terminal would act on them, or they would print other text than they hold.
UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


# Terminal escape sequences, whole: CSI (colours, cursor moves: ESC [ ... final byte, or the
# one-byte C1 CSI), OSC (titles, links: ESC ] ... BEL or ESC backslash) and the two-byte ones.
ESCAPE_SEQUENCE = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
                             r"|\x1b[@-_]")


def as_shown(value: str) -> str:
    """The text a terminal would show: escape sequences dropped whole (not only their ESC,
    which left "[31m" litter), and of each line what follows its last carriage return (a
    progress bar redraws itself so; a line's closing CR, CRLF's, erases nothing)."""
    text = ESCAPE_SEQUENCE.sub("", value)
    return "\n".join(line.rstrip("\r").rpartition("\r")[2] for line in text.split("\n"))


def printable_text(value: str, limit: int, keep_end: bool = False) -> str:
    """`value` as the job keeps text a pod wrote: as a terminal shows it (as_shown), UNPRINTABLE
    dropped, a tab a space, at most `limit` characters: its start, or with `keep_end` its end (a
    log's last lines say most), marked `[...]` where cut."""
    text = UNPRINTABLE.sub("", as_shown(value).replace("\t", " "))
    if len(text) <= limit:
        return text
    mark = "[...]"
    return mark + text[-(limit - len(mark)):] if keep_end else text[:limit - len(mark)] + mark


# The trainer's own budget for one report (report_push.encode cuts its metrics to fit); the
# endpoint does not check it: its caps above and MAX_BODY_BYTES are what holds.
MAX_REPORT_BYTES = 4096
# ---- in-place restarts: the attempt a pod's processes run, set by the operator ----
# The operator writes RUN_ATTEMPT_ANNOTATION on every pod of the group (the creation's attempt
# first); the downward API mounts it at REPORT_DIR/RUN_ATTEMPT_FILE, where the supervisor sees a
# new value within about 0.2 s, stops whatever runs and launches that attempt in the same pod.
RUN_ATTEMPT_ANNOTATION = "accelerate-operator.io/run-attempt"
RUN_ATTEMPT_FILE = "attempt"
# ---- the report endpoint the operator serves (HTTPS; the pods hold no API credential) ----
# Every trainer container that reports gets ENV_REPORT_URL, the full URL of its job's endpoint
# (https://<operator service>.<namespace>.svc:<port>/apis/accelerate-operator.io/v1alpha1/
# namespaces/<ns>/acceleratejobs/<job>/status, KEP-2779's path shape), and a projected volume at
# REPORT_DIR holding: REPORT_TOKEN_FILE, a service-account token bound to the pod whose audience
# is REPORT_AUDIENCE (never the API server's, so the API server refuses it); REPORT_CA_FILE, the
# CA that signed the endpoint's certificate (key REPORT_CA_KEY of the job's ConfigMap
# `<job>-accelerate-config`); RUN_ATTEMPT_FILE (the downward API, RUN_ATTEMPT_ANNOTATION).
# A POST carries `Authorization: Bearer <token>` and one JSON object of at most MAX_BODY_BYTES:
# KEP-2779's {"trainerStatus": {...}} (what transformers' KubeflowCallback sends: pod 0 gets
# ENV_KUBEFLOW_URL/TOKEN/CA pointing at the same endpoint), and/or our extension
# {REPORT_BODY_KEY: <the report object above>}. Answers: 200 taken; 400 malformed; 401 no or
# bad token; 403 a token of a pod that may not write this (not a live pod of the job, progress
# not from pod 0, an exit not from the current attempt; a pod of another namespace, whether the
# job exists or not); 404 no such job (in the pod's own namespace); 408 the body came too
# slowly; 413 too large; 429 too often (Retry-After); 503 not the active replica, or the
# cluster's keys not readable yet (Retry-After). Any answer but 200 closes the connection. The
# pod retries 429/503 and connection errors; an `exit` report is retried until answered 200.
# A 200 to pod 0 holds NEXT_REPORT_KEY: the seconds until the job's next progress write, when
# pod 0's next progress report is due. Pod 0 reports its progress no more often than that, so
# the operator writes each report as it comes (status.progress is fresh, and no report is
# posted only to be held back); within NEXT_REPORT_SECONDS, at most half the least
# stallTimeoutSeconds (30), so the signs of life the stall check reads come twice within it.
ENV_REPORT_URL = "ACCELERATE_REPORT_URL"
REPORT_AUDIENCE = "accelerate-operator.io/report"
REPORT_CA_KEY = "report-ca.crt"
REPORT_BODY_KEY = "acceleratePodReport"
NEXT_REPORT_KEY = "nextReportSeconds"
NEXT_REPORT_SECONDS = (1.0, 15.0)
MAX_BODY_BYTES = 64 * 1024
REPORT_TOKEN_SECONDS = 3600  # the projected token's lifetime; the kubelet renews it at 80 %
ENV_KUBEFLOW_URL = "KUBEFLOW_TRAINER_SERVER_URL"
ENV_KUBEFLOW_TOKEN = "KUBEFLOW_TRAINER_SERVER_TOKEN"
ENV_KUBEFLOW_CA = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
REPORT_DIR = "/var/run/secrets/accelerate-operator.io/report"
REPORT_TOKEN_FILE = "token"
REPORT_CA_FILE = "ca.crt"
