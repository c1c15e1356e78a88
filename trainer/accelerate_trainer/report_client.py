"""The pod's side of the operator's report endpoint (contract.py, "the report endpoint"): one
HTTPS POST of a JSON body with the pod's projected token, over a kept-alive connection that
verifies the endpoint's certificate and host name against the CA the operator hands the pod.

Why the standard library: this runs in the user's training image, which must gain no
dependency (nor clash with the user's pins). Why the token file is read for every POST and the
CA file's identity checked before each: the kubelet rotates the token (at 80 % of
REPORT_TOKEN_SECONDS) and the operator rotates its CA, each by swapping the projected volume's
files; a POST goes at most every few seconds, so a small read each time costs nothing and is
never stale. What to do with an answer (retry, wait, give up on that report) is the caller's:
report_push.Pusher.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from .contract import (
    ENV_REPORT_URL,
    NEXT_REPORT_KEY,
    NEXT_REPORT_SECONDS,
    REPORT_BODY_KEY,
    REPORT_CA_FILE,
    REPORT_DIR,
    REPORT_TOKEN_FILE,
)

REQUEST_TIMEOUT = 5.0
# A Retry-After longer than this is read as this: a report is news for seconds, and an `exit`
# must reach the operator while the pod holds (supervise.HOLD_SECONDS).
RETRY_AFTER_MAX = 30.0
MAX_ANSWER_BYTES = 4096  # the endpoint's answers are a short {"message": ...}


class BadReportURL(ValueError):
    """ENV_REPORT_URL is not an https URL with a host."""


@dataclass(frozen=True)
class Answer:
    """The endpoint's answer: its status, its message, its Retry-After in seconds, and (a 200
    to pod 0) when the next progress report is due, in seconds (contract.NEXT_REPORT_KEY)."""

    status: int
    message: str = ""
    retry_after: float | None = None
    next_report: float | None = None


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After's delay-seconds, bounded to RETRY_AFTER_MAX; None when absent or not a
    number (an HTTP date: the caller backs off on its own)."""
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return None
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_MAX)


def split_url(url: str) -> tuple[str, int, str]:
    """(host, port, path with query) of an https URL; raises BadReportURL naming the env."""
    parts = urlsplit(url)
    try:
        port = parts.port or 443
    except ValueError:
        port = 0
    if parts.scheme != "https" or not parts.hostname or not port:
        raise BadReportURL(f"{ENV_REPORT_URL}={url!r} is not an https://HOST[:PORT]/PATH URL; "
                           "the operator sets it: recreate the pod with this operator's "
                           "version, or unset it")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, port, path


def read_answer(status: int, body: bytes, retry_after: str | None) -> Answer:
    """The endpoint's answer: its own message ({"message": ...}), else the start of its text;
    its next-report time held within contract.NEXT_REPORT_SECONDS (None when absent or not a
    number)."""
    try:
        document = json.loads(body)
    except ValueError:
        document = None
    if not isinstance(document, dict):
        document = {"message": body.decode("utf-8", "replace")}
    return Answer(status, str(document.get("message") or "").strip()[:200],
                  parse_retry_after(retry_after), _next_report(document.get(NEXT_REPORT_KEY)))


def _next_report(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an int past a float's range
        return None
    low, high = NEXT_REPORT_SECONDS
    return min(max(seconds, low), high) if math.isfinite(seconds) else None


class ReportClient:
    """POSTs to one report endpoint; not thread-safe (one Pusher uses it)."""

    def __init__(self, url: str, directory: str = REPORT_DIR,
                 timeout: float = REQUEST_TIMEOUT):
        self.url = url
        self.host, self.port, self.path = split_url(url)
        self.token_path = os.path.join(directory, REPORT_TOKEN_FILE)
        self.ca_path = os.path.join(directory, REPORT_CA_FILE)
        self.timeout = timeout
        self._context: ssl.SSLContext | None = None
        self._ca_identity: tuple[int, int, int] | None = None
        self._connection: http.client.HTTPSConnection | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str],
                 directory: str = REPORT_DIR) -> ReportClient | None:
        """The client the operator's env and volume describe, or None when they are not both
        there (a pod made by something else): nothing is reported."""
        url = environ.get(ENV_REPORT_URL)
        if not url or not os.path.isfile(os.path.join(directory, REPORT_TOKEN_FILE)):
            return None
        return cls(url, directory)

    def post_report(self, report: str) -> Answer:
        """Our extension's body around one report (report_push.encode's JSON object)."""
        return self.post(("{" + json.dumps(REPORT_BODY_KEY) + ":" + report + "}").encode())

    def post(self, body: bytes) -> Answer:
        """One POST of `body`; raises OSError (ssl.SSLError included: a certificate the CA did
        not sign, or for another host) or http.client.HTTPException when no answer came. A
        kept-alive connection the server closed while idle is opened again once."""
        with open(self.token_path, encoding="utf-8") as file:
            token = file.read().strip()
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                   "Accept": "application/json"}
        while True:
            connection, reused = self._connect()
            try:
                connection.request("POST", self.path, body, headers)
                response = connection.getresponse()
                answer = response.read(MAX_ANSWER_BYTES)
            except (OSError, http.client.HTTPException):
                self.close()
                if reused:
                    continue
                raise
            if not response.isclosed():  # an answer longer than read: the connection is spent
                self.close()
            return read_answer(response.status, answer, response.getheader("Retry-After"))

    def _ca_current(self) -> bool:
        """Whether the CA file is the one the open connection was verified with."""
        stat = os.stat(self.ca_path)
        return (stat.st_ino, stat.st_mtime_ns, stat.st_size) == self._ca_identity

    def _connect(self) -> tuple[http.client.HTTPSConnection, bool]:
        """The kept-alive connection (True), or a new one verified with the CA file as it is
        now (False)."""
        if self._connection is not None and self._ca_current():
            return self._connection, True
        self.close()
        stat = os.stat(self.ca_path)
        self._context = ssl.create_default_context(cafile=self.ca_path)
        self._ca_identity = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        self._connection = http.client.HTTPSConnection(self.host, self.port,
                                                       timeout=self.timeout,
                                                       context=self._context)
        return self._connection, False

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
