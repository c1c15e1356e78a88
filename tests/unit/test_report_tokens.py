"""The report endpoint's tokens checked locally (report_tokens.py), with keys made in the test
and real JWTs: what a projected token bound to a pod says, every way a token is refused, and
when the API server's keys are fetched again."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time

import jwt
import pytest
from accelerate_operator import report_tokens
from accelerate_operator.report_tokens import (
    KEYS_MISS_SECONDS,
    KEYS_REFRESH_SECONDS,
    BadToken,
    Caller,
    IssuerKeys,
    KeysUnavailable,
    read_issuer,
    verify,
)

from tests.helpers.tokens import TestIssuer

ISSUER = TestIssuer()


@pytest.mark.parametrize("kind", ["RSA", "EC"])
def test_a_token_bound_to_a_pod_names_the_pod(kind):
    issuer = ISSUER if kind == "RSA" else TestIssuer(kind="EC")
    caller = verify(issuer.token(), issuer.issuer())
    assert caller == Caller("ml", "train-0", "uid-0", caller.expires)
    assert caller.expires == pytest.approx(time.time() + 3600, abs=5)


def _unsigned(token: str, **header) -> str:
    """The token's claims under another header, with no signature."""
    def encode(part: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(part).encode()).rstrip(b"=").decode()
    claims = jwt.decode(token, options={"verify_signature": False})
    return f"{encode(header)}.{encode(claims)}."


def _hmac_with_public_key(token: str) -> str:
    """Algorithm confusion: HS256 keyed with the issuer's public key (what a careless verifier
    would accept)."""
    claims = jwt.decode(token, options={"verify_signature": False})
    public = ISSUER.jwks()["keys"][0]["n"].encode()
    header = {"alg": "HS256", "kid": ISSUER.kid}
    signing = (base64.urlsafe_b64encode(json.dumps(header).encode()).rstrip(b"=") + b"."
               + base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"="))
    signature = base64.urlsafe_b64encode(hmac.new(public, signing, hashlib.sha256).digest())
    return (signing + b"." + signature.rstrip(b"=")).decode()


@pytest.mark.parametrize("token, words", [
    ("not-a-jwt", "not a JWT"),
    ("a.b.c", "not a JWT"),
    (TestIssuer(kid="key-1").token(), "signature does not hold"),  # same kid, another key
    (TestIssuer(kid="other", kind="EC").token(), "not signed by a key"),
    (ISSUER.token(audience="https://kubernetes.default.svc.cluster.local"), "audience"),
    (ISSUER.token(issued=time.time() - 7200), "expired"),
    (ISSUER.token(issued=time.time() + 600), "not valid yet"),
    (ISSUER.token(pod=None), "not bound to a pod"),
    (ISSUER.token(sub="system:serviceaccount:other:default"), "namespace"),
    (ISSUER.token(sub="alice"), "service account"),
    (ISSUER.token(exp=None), "lacks a claim"),
    (_unsigned(ISSUER.token(), alg="none", kid=ISSUER.kid), "not a valid JWT"),
    (_hmac_with_public_key(ISSUER.token()), "not a valid JWT"),
])
def test_any_other_token_is_refused_naming_why(token, words):
    with pytest.raises(BadToken) as refused:
        verify(token, ISSUER.issuer())
    assert words in str(refused.value)


def test_a_token_of_another_issuer_with_the_same_key_is_refused():
    twin = TestIssuer(url="https://elsewhere", kind="EC")
    twin.key, twin.kid, twin.algorithm = ISSUER.key, ISSUER.kid, ISSUER.algorithm
    with pytest.raises(BadToken, match="another issuer"):
        verify(twin.token(), ISSUER.issuer())


def test_keys_the_endpoint_cannot_use_are_left_out():
    jwks = ISSUER.jwks()
    jwks["keys"] += [{"kty": "oct", "k": "c2VjcmV0", "kid": "hmac", "alg": "HS256"},
                     {"kty": "RSA", "kid": "broken"}]
    assert list(read_issuer({"issuer": ISSUER.url}, jwks).keys) == [ISSUER.kid]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_keys_are_fetched_once_then_when_stale_or_for_a_new_key_at_a_bounded_rate():
    async def test():
        clock, fetched = Clock(), []
        rotated = TestIssuer(kid="key-2", kind="EC")

        async def fetch():
            fetched.append(clock.now)
            return ISSUER.documents() if len(fetched) < 3 else (
                {"issuer": ISSUER.url}, {"keys": ISSUER.jwks()["keys"] + rotated.jwks()["keys"]})

        keys = IssuerKeys(fetch, clock)
        for _ in range(3):
            await keys.verify(ISSUER.token())
        assert len(fetched) == 1
        # a stranger's made-up key ids: one fetch per KEYS_MISS_SECONDS, however many
        made_up = TestIssuer(kid="made-up", kind="EC")
        for _ in range(50):
            with pytest.raises(BadToken):
                await keys.verify(made_up.token())
        assert len(fetched) == 1  # the first fetch was just now
        clock.now += KEYS_MISS_SECONDS
        with pytest.raises(BadToken):
            await keys.verify(rotated.token())  # fetched: the API server has no key-2 yet
        assert len(fetched) == 2
        clock.now += KEYS_MISS_SECONDS
        assert (await keys.verify(rotated.token())).pod_name == "train-0"  # rotated in
        assert len(fetched) == 3
        clock.now += KEYS_REFRESH_SECONDS
        await keys.verify(ISSUER.token())
        assert len(fetched) == 4  # stale: fetched again (the API server may drop a key)
    asyncio.run(test())


def test_keys_that_cannot_be_read_answer_unavailable_and_the_old_ones_serve_on():
    async def test():
        clock, answers = Clock(), [RuntimeError("API server down"), ISSUER.documents(),
                                   RuntimeError("down again")]

        async def fetch():
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        keys = IssuerKeys(fetch, clock)
        with pytest.raises(KeysUnavailable):
            await keys.verify(ISSUER.token())
        clock.now += KEYS_MISS_SECONDS
        await keys.verify(ISSUER.token())
        clock.now += KEYS_REFRESH_SECONDS
        assert (await keys.verify(ISSUER.token())).namespace == "ml"  # the old keys serve
    asyncio.run(test())


def test_a_token_that_held_is_checked_once_until_it_expires_or_the_keys_change(monkeypatch):
    checked = []
    monkeypatch.setattr(report_tokens, "verify",
                        lambda token, issuer: checked.append(token) or verify(token, issuer))

    async def test():
        clock, wall, published = Clock(), [time.time()], [ISSUER.documents()]

        async def fetch():
            return published[0]

        keys = IssuerKeys(fetch, clock, lambda: wall[0])
        token = ISSUER.token(lifetime=600)
        for _ in range(5):
            assert (await keys.verify(token)).pod_uid == "uid-0"
        assert len(checked) == 1  # one signature check for five reports
        wall[0] += 600  # its expiry: checked again
        await keys.verify(token)
        assert len(checked) == 2
        wall[0] -= 600
        published[0] = TestIssuer(kid="key-9", kind="EC").documents()  # key-1 dropped
        clock.now += KEYS_REFRESH_SECONDS
        with pytest.raises(BadToken, match="not signed by a key"):
            await keys.verify(token)  # the refresh changed the keys: the token is forgotten
    asyncio.run(test())


def test_callers_waiting_on_one_fetch_share_it():
    async def test():
        fetched = []

        async def fetch():
            fetched.append(1)
            await asyncio.sleep(0.01)
            return ISSUER.documents()

        keys = IssuerKeys(fetch, Clock())
        callers = await asyncio.gather(*(keys.verify(ISSUER.token()) for _ in range(20)))
        assert len(fetched) == 1 and {c.pod_uid for c in callers} == {"uid-0"}
    asyncio.run(test())
