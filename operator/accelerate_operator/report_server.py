"""The report endpoint: an HTTPS server (aiohttp, as kopf's own) where the job's pods POST what
they used to write onto themselves, with no API credential in the pod.

`POST /apis/accelerate-operator.io/v1alpha1/namespaces/{namespace}/acceleratejobs/{name}/status`
with `Authorization: Bearer <token>`: a service-account token projected into the pod with the
audience contract.REPORT_AUDIENCE (the API server refuses it), checked by a TokenReview (cached
by the token's hash) and then against what the operator watches (report_checks.authorize). In
order, each answer leaving the job's status as it was: 503 (not the active replica), 413, 401 (no
token), 429 (the caller's rate, before any API call), 400, 401 (TokenReview), 404, 403. A report
taken replaces the pod's last one in the controller's ReportStore and queues the job's pass.

Only the active replica takes reports (the standby answers 503 with Retry-After): its passes are
the only ones that read them, and a pod retries, so after a failover the new active replica has
each pod's next report within seconds."""

from __future__ import annotations

import hashlib
import json
import logging
import ssl
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

from accelerate_trainer.contract import MAX_BODY_BYTES
from aiohttp import web

from .kube import Kube
from .naming import report_path
from .report_checks import Caller, Refused, ReportBody, parse_body, read_caller
from .report_store import RateLimiter, ReviewCache
from .timefmt import utcnow

log = logging.getLogger("accelerate_operator")

ROUTE = report_path("{namespace}", "{name}")
# Per caller (token): a burst, then one request a second (pods report every few seconds).
CALLER_RATE, CALLER_BURST = 1.0, 10.0
# TokenReviews of tokens not cached, for all callers together: a flood of made-up tokens costs
# the API server at most this.
REVIEW_RATE, REVIEW_BURST = 20.0, 50.0
REVIEW_TTL, REVIEW_NEGATIVE_TTL = 60.0, 10.0
NOT_ACTIVE_RETRY_SECONDS = 5


class ReportTaker(Protocol):
    """Who the reports go to: the controller (controller.py), through one method."""

    paused: bool

    def take_report(self, key: tuple[str, str], caller: Caller, body: ReportBody,
                    now: datetime) -> None: ...


class ReportServer:
    def __init__(self, controller: Callable[[], ReportTaker | None], kube: Kube,
                 clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime] = utcnow):
        self.controller, self.kube, self.clock, self.now = controller, kube, clock, now
        self.callers = RateLimiter(CALLER_RATE, CALLER_BURST)
        self.reviews_due = RateLimiter(REVIEW_RATE, REVIEW_BURST, max_keys=1)
        self.reviews: ReviewCache[Caller] = ReviewCache(REVIEW_TTL, REVIEW_NEGATIVE_TTL)
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post(ROUTE, self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        try:
            if (request.content_length or 0) > MAX_BODY_BYTES:
                raise Refused(413, f"the body is over {MAX_BODY_BYTES} bytes")
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise Refused(413, f"the body is over {MAX_BODY_BYTES} bytes") from None
            await self.take(request.match_info["namespace"], request.match_info["name"],
                            request.headers.get("Authorization", ""), body)
        except Refused as refused:
            return answer(refused.code, str(refused), refused.retry_after)
        return answer(200, "taken")

    async def take(self, namespace: str, name: str, authorization: str, raw: bytes) -> None:
        """One report, taken or Refused."""
        controller = self.controller()
        if controller is None or controller.paused:
            raise Refused(503, "this replica is not the active one", NOT_ACTIVE_RETRY_SECONDS)
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Refused(401, "no bearer token")
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        wait = self.callers.take(digest, self.clock())
        if wait:
            raise Refused(429, "too many reports from this pod", wait)
        body = parse_body(raw)
        caller = await self.caller(digest, token.strip())
        controller.take_report((namespace, name), caller, body, self.now())

    async def caller(self, digest: str, token: str) -> Caller:
        """The pod a token is bound to, by a TokenReview (cached); Refused 401 or 429."""
        found, caller = self.reviews.get(digest, self.clock())
        if not found:
            wait = self.reviews_due.take(None, self.clock())
            if wait:
                raise Refused(429, "too many new tokens to review", wait)
            try:
                status = await self.kube.review_token(token)
            except Exception as error:  # noqa: BLE001 - the pod retries; nothing is cached
                log.warning("TokenReview failed: %r", error)
                raise Refused(503, "the token cannot be checked now",
                              NOT_ACTIVE_RETRY_SECONDS) from None
            caller = read_caller(status)
            self.reviews.put(digest, caller, self.clock())
        if caller is None:
            raise Refused(401, "the token is not a pod's token for this endpoint's audience")
        return caller

    async def start(self, host: str, port: int, context: ssl.SSLContext) -> int:
        """Serve; returns the port (0 picks a free one)."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, ssl_context=context).start()
        addresses = self._runner.addresses
        return addresses[0][1] if addresses else port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def answer(code: int, message: str, retry_after: float | None = None) -> web.Response:
    """A metav1.Status, as KEP-2779's server answers."""
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "code": code,
                            "status": "Success" if code == 200 else "Failure",
                            "message": message}
    headers = {"Retry-After": str(max(1, int(retry_after + 0.999)))} if retry_after else {}
    return web.json_response(body, status=code, headers=headers, dumps=json.dumps)
