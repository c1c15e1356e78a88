"""The report endpoint's bearer tokens, checked here with no API call: a token is a JWT the API
server signed (its service-account issuer), for the endpoint's audience, not expired, bound to a
pod. PyJWT checks the signature against the keys the API server publishes (OIDC discovery:
`/.well-known/openid-configuration` and `/openid/v1/jwks`, which kube/ fetches), the
audience, the issuer and the times; `read_caller` reads the pod the `kubernetes.io` claims name.

Why no TokenReview: it would add an API call per new token and say nothing more for our tokens.
For a token bound to a pod the API server checks the signature, the times, and that the bound pod
still exists with the same uid; the endpoint checks the first here and the last against the
operator's own watch cache on every request (report_checks.job_pod: the token's pod uid must be
a live pod of the job), which is fresher than any cached TokenReview. A bound token cannot be
revoked but by deleting its pod, and then the uid check refuses it at once.

Keys: fetched at the first token, again every KEYS_REFRESH_SECONDS (the API server may drop a
key), and at once for a token signed with a key id not known, at most once per
KEYS_MISS_SECONDS however many such tokens come: a stranger with made-up key ids can delay the
pick-up of a rotated key by that much, and costs the API server at most one request per period.

A token that held is remembered until it expires (the VERIFIED_TOKENS most recently used), so a
pod's reports cost one signature check per token (the kubelet renews it about every 48 minutes),
not one per report; only a token that held is remembered, so junk fills nothing. The keys are
still refreshed when due, and a refresh that changes them forgets every remembered token: a
token signed by a key the API server dropped holds no longer than that refresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jwt
from accelerate_trainer.contract import REPORT_AUDIENCE

log = logging.getLogger("accelerate_operator")

# The API server signs with RSA or ECDSA keys (--service-account-signing-key-file); "none" and
# the HMAC algorithms are never accepted (an attacker would pick them).
ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512")
LEEWAY_SECONDS = 30  # clock skew between the API server and the operator
KEYS_REFRESH_SECONDS = 600.0
KEYS_MISS_SECONDS = 30.0
VERIFIED_TOKENS = 4096  # about 1 KiB each: a few MiB at most
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"


class BadToken(Exception):
    """A token the endpoint refuses (401); the message says why, without echoing the token."""


class KeysUnavailable(Exception):
    """The API server's keys could not be read yet (503: the pod tries again)."""


@dataclass(frozen=True)
class Caller:
    """The pod a token is bound to, as its verified claims say."""

    namespace: str
    pod_name: str
    pod_uid: str
    expires: float  # the token's exp (seconds since the epoch)


@dataclass(frozen=True)
class Issuer:
    """What the API server publishes: its issuer URL and its public keys by key id."""

    url: str
    keys: Mapping[str, jwt.PyJWK]


def read_issuer(configuration: Mapping[str, Any], jwks: Mapping[str, Any]) -> Issuer:
    """The discovery document and the key set, as the API server serves them. Keys of a type
    PyJWT cannot use, or of an algorithm not in ALGORITHMS, are left out."""
    keys: dict[str, jwt.PyJWK] = {}
    for entry in jwks.get("keys") or []:
        try:
            key = jwt.PyJWK(entry)
        except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError):
            continue
        if key.algorithm_name in ALGORITHMS:
            keys[str(entry.get("kid") or "")] = key
    return Issuer(str(configuration.get("issuer") or ""), keys)


def key_id(token: str) -> str:
    """The token's key id (its header's `kid`); BadToken when it is no JWT."""
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        raise BadToken("the bearer token is not a JWT") from None
    return str(header.get("kid") or "")


def verify(token: str, issuer: Issuer) -> Caller:
    """The pod a token is bound to, once its signature (by a key of `issuer`), audience
    (REPORT_AUDIENCE), issuer, expiry and not-before hold; else BadToken."""
    key = issuer.keys.get(key_id(token))
    if key is None:
        raise BadToken("the token is not signed by a key of the cluster's service-account issuer")
    try:
        claims = jwt.decode(token, key.key, algorithms=[key.algorithm_name],
                            audience=REPORT_AUDIENCE, issuer=issuer.url, leeway=LEEWAY_SECONDS,
                            options={"require": ["exp", "iat", "iss", "aud", "sub"]})
    except jwt.PyJWTError as error:
        raise BadToken(_why(error)) from None
    return read_caller(claims)


def _why(error: jwt.PyJWTError) -> str:
    """PyJWT's refusal in our words (its own messages may change)."""
    for kind, why in ((jwt.ExpiredSignatureError, "the token has expired"),
                      (jwt.ImmatureSignatureError, "the token is not valid yet"),
                      (jwt.InvalidAudienceError,
                       f"the token is not for this endpoint's audience {REPORT_AUDIENCE}"),
                      (jwt.InvalidIssuerError, "the token is of another issuer"),
                      (jwt.InvalidSignatureError, "the token's signature does not hold"),
                      (jwt.MissingRequiredClaimError, "the token lacks a claim it needs")):
        if isinstance(error, kind):
            return why
    return "the token is not a valid JWT of the cluster's service-account issuer"


def read_caller(claims: Mapping[str, Any]) -> Caller:
    """The `kubernetes.io` claims of a service account's token bound to a pod."""
    cluster = claims.get("kubernetes.io")
    cluster = cluster if isinstance(cluster, Mapping) else {}
    pod = cluster.get("pod") if isinstance(cluster.get("pod"), Mapping) else {}
    namespace, name, uid = cluster.get("namespace"), pod.get("name"), pod.get("uid")
    subject = str(claims.get("sub") or "")
    if not all(isinstance(v, str) and v for v in (namespace, name, uid)):
        raise BadToken("the token is not bound to a pod")
    if not subject.startswith(f"{SERVICE_ACCOUNT_PREFIX}{namespace}:"):
        raise BadToken("the token is not a service account's of the pod's namespace")
    return Caller(namespace, name, uid, float(claims["exp"]))


# The discovery document and the key set, as the API server serves them (Kube.read_issuer).
Fetch = Callable[[], Awaitable[tuple[Mapping[str, Any], Mapping[str, Any]]]]


class IssuerKeys:
    """The API server's keys as last fetched, fetched again when due, and the tokens they
    verified (the module's docstring). `fetch` reads them (Kube.read_issuer); `clock` is
    monotonic, `wall` the time tokens expire by (seconds since the epoch)."""

    def __init__(self, fetch: Fetch, clock: Callable[[], float],
                 wall: Callable[[], float] = time.time):
        self.fetch, self.clock, self.wall = fetch, clock, wall
        self.issuer: Issuer | None = None
        self._fetched_at = self._tried_at = -float("inf")
        self._lock = asyncio.Lock()
        self._published: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None
        self._verified: OrderedDict[str, Caller] = OrderedDict()

    async def verify(self, token: str) -> Caller:
        """verify() with keys fresh enough for this token, or the token as it held before;
        BadToken or KeysUnavailable."""
        stale = self.clock() - self._fetched_at >= KEYS_REFRESH_SECONDS
        known = self._verified.get(token)
        if known is not None and not stale and self.wall() < known.expires:
            self._verified.move_to_end(token)
            return known
        kid = key_id(token)
        unknown = self.issuer is None or kid not in self.issuer.keys
        if stale or unknown or self._lock.locked():
            await self._refresh()
        if self.issuer is None:
            raise KeysUnavailable("the API server's service-account keys cannot be read now")
        self._verified.pop(token, None)
        caller = verify(token, self.issuer)
        self._verified[token] = caller
        while len(self._verified) > VERIFIED_TOKENS:
            self._verified.popitem(last=False)
        return caller

    async def _refresh(self) -> None:
        """Fetch, unless a fetch was tried in the last KEYS_MISS_SECONDS: one at a time, and a
        caller that waited on one uses its result."""
        async with self._lock:
            if self.clock() - self._tried_at < KEYS_MISS_SECONDS:
                return
            self._tried_at = self.clock()
            try:
                published = await self.fetch()
                self.issuer = read_issuer(*published)
                if published != self._published:
                    self._verified.clear()  # a key may be gone: its tokens are checked again
                self._published = published
                self._fetched_at = self._tried_at
            except Exception as error:  # noqa: BLE001 - the old keys serve; tried again later
                log.warning("reading the API server's service-account keys failed: %r", error)
