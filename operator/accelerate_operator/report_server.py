"""The report endpoint: an HTTPS server (aiohttp, as kopf's own) where the job's pods POST what
they used to write onto themselves, with no API credential in the pod.

`POST /apis/accelerate-operator.io/v1alpha1/namespaces/{namespace}/acceleratejobs/{name}/status`
with `Authorization: Bearer <token>`: a service-account token projected into the pod with the
audience contract.REPORT_AUDIENCE (the API server refuses it). In order, each step costs less
than the next and no caller costs an API call:
1. 503 (not the active replica); 401 (no bearer token);
2. the token verified locally (report_tokens.py: the API server's published keys, audience,
   expiry, the pod it is bound to): 401, or 503 while the keys cannot be read;
3. the rate of the token's namespace and then of its pod (Limits): 429 with Retry-After;
4. the pod against the operator's watch cache, on every request (controller.report_pod,
   report_checks.job_pod: a live
   pod the operator made for this job, of its current group): 403, or 404 for a job missing in
   the caller's own namespace (a caller of another namespace gets 403 either way);
5. only now the body, read within the body deadline (408) and its size (413), then parsed
   (400 for anything malformed, never a 500) and kept small and printable
   (report_checks.keep_report); progress only from pod 0 (403).
A report taken replaces the pod's last one; the controller decides when the job's pass sees it
(controller.take_report: at once, when a progress write is due, or not at all), and the 200 to
pod 0 says when its next progress report is due (contract.NEXT_REPORT_KEY). Any answer but
200 closes the connection (after the answer, and the rest of the body read unparsed for up to
linger_seconds), so a caller that is refused spends a new TLS handshake to try again.

What a connection may cost is bounded below HTTP (report_listener.py: connections in all and per
peer, TLS handshake and header deadlines) and in aiohttp (LIMITS: idle keep-alive, request line
and header sizes, the body size); a handler whose client went away is cancelled.

Only the active replica takes reports (the standby answers 503 with Retry-After): its passes are
the only ones that read them, and a pod retries, so after a failover the new active replica has
each pod's next report within seconds."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from accelerate_trainer.contract import MAX_BODY_BYTES, NEXT_REPORT_KEY
from aiohttp import web

from .naming import report_path
from .pod_state import PodState
from .report_checks import Refused, ReportBody, parse_body
from .report_listener import Bounds, Listener
from .report_store import RateLimiter
from .report_tokens import BadToken, Caller, IssuerKeys, KeysUnavailable
from .timefmt import utcnow

log = logging.getLogger("accelerate_operator")

ROUTE = report_path("{namespace}", "{name}")
NOT_ACTIVE_RETRY_SECONDS = 5


@dataclass(frozen=True)
class Limits:
    """What one caller may cost (docs/progress-logs-cli.md lists them)."""

    bounds: Bounds = Bounds()
    body_seconds: float = 10.0  # the whole body, once the head has come
    linger_seconds: float = 2.0  # a refused client's body, dropped before the connection closes
    max_line: int = 4096  # the request line: the path is short
    max_field: int = 8190  # one header: a projected token is about 1 KiB
    # Per pod (its token's pod uid): a burst, then one request a second (pods report every few
    # seconds). Per namespace (its token's): what all its pods may send together.
    pod_rate: float = 1.0
    pod_burst: float = 10.0
    namespace_rate: float = 50.0
    namespace_burst: float = 100.0


LIMITS = Limits()


class ReportTaker(Protocol):
    """Who the reports go to: the controller (controller.py). `report_pod` checks the caller
    against the operator's cache before the body is read (report_checks.job_pod: Refused 403 or
    404); `take_report` keeps what that pod may write (Refused 403 or 400)."""

    paused: bool

    def report_pod(self, key: tuple[str, str], caller: Caller) -> PodState: ...

    def take_report(self, key: tuple[str, str], pod: PodState, body: ReportBody,
                    now: datetime) -> float | None: ...


class ReportServer:
    def __init__(self, controller: Callable[[], ReportTaker | None], keys: IssuerKeys,
                 limits: Limits = LIMITS, clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime] = utcnow):
        self.controller, self.keys, self.limits = controller, keys, limits
        self.clock, self.now = clock, now
        self.pods = RateLimiter(limits.pod_rate, limits.pod_burst)
        self.namespaces = RateLimiter(limits.namespace_rate, limits.namespace_burst)
        self._runner: web.AppRunner | None = None
        self._listener: Listener | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post(ROUTE, self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        listener, refused = self._listener, False
        if listener is not None:
            listener.request_started(request.transport)
        try:
            return answer(200, "taken", next_report=await self.take(request))
        except Refused as refusal:
            refused = True
            response = answer(refusal.code, str(refusal), refusal.retry_after)
            response.force_close()
            await response.prepare(request)  # the answer goes now; then what is left is dropped
            await response.write_eof()
            await self.discard(request)
            return response
        finally:
            if listener is not None:
                listener.request_ended(request.transport, refused)

    async def take(self, request: web.Request) -> float | None:
        """One report, taken (for pod 0: when its next progress report is due) or Refused (the
        module's docstring, in order)."""
        controller = self.controller()
        if controller is None or controller.paused:
            raise Refused(503, "this replica is not the active one", NOT_ACTIVE_RETRY_SECONDS)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Refused(401, "no bearer token")
        caller = await self.caller(token.strip())
        key = (request.match_info["namespace"], request.match_info["name"])
        pod = controller.report_pod(key, caller)
        body = parse_body(await self.read(request))
        return controller.take_report(key, pod, body, self.now())

    async def caller(self, token: str) -> Caller:
        """The pod the token is bound to, within its namespace's and its own rates."""
        try:
            caller = await self.keys.verify(token)
        except BadToken as error:
            raise Refused(401, str(error)) from None
        except KeysUnavailable as error:
            raise Refused(503, str(error), NOT_ACTIVE_RETRY_SECONDS) from None
        now = self.clock()
        wait = self.namespaces.take(caller.namespace, now)
        if wait:
            raise Refused(429, f"too many reports from namespace {caller.namespace}", wait)
        wait = self.pods.take(caller.pod_uid, now)
        if wait:
            raise Refused(429, f"too many reports from pod {caller.pod_name}", wait)
        return caller

    async def read(self, request: web.Request) -> bytes:
        """The body, within its size and its deadline."""
        too_large = Refused(413, f"the body is over {MAX_BODY_BYTES} bytes")
        if (request.content_length or 0) > MAX_BODY_BYTES:
            raise too_large
        try:
            return await asyncio.wait_for(request.read(), self.limits.body_seconds)
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except asyncio.TimeoutError:
            raise Refused(408, f"the body did not come within {self.limits.body_seconds:.0f} s"
                          ) from None

    async def discard(self, request: web.Request) -> None:
        """What a refused client still sends of its body (at most MAX_BODY_BYTES, within
        linger_seconds), read and dropped unparsed: a connection closed with unread bytes is
        reset by the kernel, and the client (or a proxy before it) may lose the answer."""
        if (request.content_length or 0) > MAX_BODY_BYTES:
            return
        try:
            await asyncio.wait_for(request.read(), self.limits.linger_seconds)
        except Exception:  # noqa: BLE001 - the connection closes either way
            return

    async def start(self, host: str, port: int, context: ssl.SSLContext) -> int:
        """Serve; returns the port (0 picks a free one)."""
        limits = self.limits
        self._runner = web.AppRunner(
            self.app(), access_log=None, handler_cancellation=True,
            keepalive_timeout=limits.bounds.idle_seconds, max_line_size=limits.max_line,
            max_field_size=limits.max_field)
        await self._runner.setup()
        self._listener = Listener(self._runner.server, context, limits.bounds)
        return await self._listener.start(host, port)

    async def stop(self) -> None:
        if self._listener is not None:
            await self._listener.stop()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def answer(code: int, message: str, retry_after: float | None = None,
           next_report: float | None = None) -> web.Response:
    """A metav1.Status, as KEP-2779's server answers; to pod 0's report, with when its next
    progress report is due (contract.NEXT_REPORT_KEY, in tenths of a second, rounded up: never
    before the write it waits for)."""
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "code": code,
                            "status": "Success" if code == 200 else "Failure",
                            "message": message}
    if next_report is not None:
        body[NEXT_REPORT_KEY] = math.ceil(next_report * 10) / 10
    headers = {"Retry-After": str(max(1, int(retry_after + 0.999)))} if retry_after else {}
    return web.json_response(body, status=code, headers=headers, dumps=json.dumps)
