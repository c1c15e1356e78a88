"""The report endpoint's settings, from the operator's environment (the chart sets them; the
defaults fit an install by other means in the same shape): pure.

- ACCELERATE_OPERATOR_REPORT_URL: the endpoint's base URL as the pods reach it, the operator's
  Service: `https://<service>.<namespace>.svc:<port>`. Default: `https://accelerate-operator.
  <the operator's namespace>.svc:8443`, a Service named accelerate-operator in front of it.
- ACCELERATE_OPERATOR_REPORT_PORT: the port it listens on (default the URL's; 0 picks one).
- ACCELERATE_OPERATOR_REPORT_SECRET: the Secret of its CA and certificate, in the operator's
  namespace (default accelerate-operator-report-tls; created if absent).
- ACCELERATE_OPERATOR_POD_NAMESPACE: the operator's namespace (the chart: the downward API);
  else its service account's, else accelerate-system.
- ACCELERATE_OPERATOR_POD_NAME: the operator's pod (the chart: the downward API), which it labels
  while it is the active replica (report_presence.py); none: no label.
- ACCELERATE_OPERATOR_PROGRESS_WRITE_SECONDS: a job's status.progress is written at most this
  often, however often pod 0 reports (default PROGRESS_WRITE_SECONDS)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from .report_tls import service_names
from .resources.pods import ReportEndpoint

ENV_URL = "ACCELERATE_OPERATOR_REPORT_URL"
ENV_PORT = "ACCELERATE_OPERATOR_REPORT_PORT"
ENV_SECRET = "ACCELERATE_OPERATOR_REPORT_SECRET"
ENV_NAMESPACE = "ACCELERATE_OPERATOR_POD_NAMESPACE"
ENV_POD = "ACCELERATE_OPERATOR_POD_NAME"
DEFAULT_NAMESPACE = "accelerate-system"
DEFAULT_SERVICE = "accelerate-operator"
DEFAULT_PORT = 8443
ENV_PROGRESS_WRITE = "ACCELERATE_OPERATOR_PROGRESS_WRITE_SECONDS"
DEFAULT_SECRET = "accelerate-operator-report-tls"
# At most one status.progress write per job this often, and pod 0 reports at that pace
# (controller.take_report). Chosen from bench/running.py (docs/performance.md, "Running jobs"): a
# progress write is the largest cost of a running job to the control plane (the API server's
# status PATCH, its watchers), so the interval is as long as it can be while the PROGRESS column
# stays within 15 s of pod 0, with 3 s left for a report or a pass delayed on a loaded machine.
# Tests set it short rather than wait it out.
PROGRESS_WRITE_SECONDS = 12.0
MAX_PROGRESS_WRITE_SECONDS = 3600.0


@dataclass(frozen=True)
class ReportSettings:
    endpoint: ReportEndpoint
    port: int
    namespace: str
    secret: str
    names: tuple[str, ...]  # the DNS names the serving certificate holds
    pod: str | None = None  # the operator's own pod
    progress_write_seconds: float = PROGRESS_WRITE_SECONDS


def read_report_settings(environ: Mapping[str, str], account_namespace: str | None = None
                         ) -> ReportSettings:
    """Raises ValueError naming the variable and what it must hold."""
    namespace = (environ.get(ENV_NAMESPACE) or account_namespace or DEFAULT_NAMESPACE).strip()
    url = environ.get(ENV_URL) or f"https://{DEFAULT_SERVICE}.{namespace}.svc:{DEFAULT_PORT}"
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname or parts.path.strip("/"):
        raise ValueError(f"{ENV_URL}={url!r}: give https://<service>.<namespace>.svc:<port>, "
                         "the operator's Service as the pods reach it")
    try:
        port = int(environ.get(ENV_PORT) or parts.port or 443)
    except ValueError:
        raise ValueError(f"{ENV_PORT}={environ.get(ENV_PORT)!r}: give a port number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{ENV_PORT}={port}: give a port from 0 to 65535")
    return ReportSettings(ReportEndpoint(f"https://{parts.netloc}"), port, namespace,
                          environ.get(ENV_SECRET) or DEFAULT_SECRET,
                          tuple(service_names(parts.hostname)), environ.get(ENV_POD) or None,
                          read_progress_write_seconds(environ))


def read_progress_write_seconds(environ: Mapping[str, str]) -> float:
    """ENV_PROGRESS_WRITE, or PROGRESS_WRITE_SECONDS; ValueError naming the variable."""
    text = environ.get(ENV_PROGRESS_WRITE) or ""
    if not text.strip():
        return PROGRESS_WRITE_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= MAX_PROGRESS_WRITE_SECONDS:
        raise ValueError(f"{ENV_PROGRESS_WRITE}={text!r}: give a number of seconds above 0 and "
                         f"at most {MAX_PROGRESS_WRITE_SECONDS:g} (default "
                         f"{PROGRESS_WRITE_SECONDS:g})")
    return seconds
