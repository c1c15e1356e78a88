"""Service-account tokens as the API server issues them, made with real keys in the test: an
issuer (a signing key and its JWKS, as /openid/v1/jwks serves it) and JWTs with the claims of a
projected token bound to a pod (iss, sub, aud, exp, iat, nbf, kubernetes.io)."""

from __future__ import annotations

import json
import time
from typing import Any

import jwt
from accelerate_operator.report_tokens import Issuer, read_issuer
from accelerate_trainer.contract import REPORT_AUDIENCE
from cryptography.hazmat.primitives.asymmetric import ec, rsa

ISSUER_URL = "https://kubernetes.default.svc.cluster.local"


class TestIssuer:
    """One API server's signing key: `kind` "RSA" (RS256, kube-apiserver's usual) or "EC"."""

    __test__ = False  # not a pytest class

    def __init__(self, kid: str = "key-1", kind: str = "RSA", url: str = ISSUER_URL):
        self.kid, self.url = kid, url
        if kind == "RSA":
            self.key: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            self.algorithm, self.jwk = "RS256", jwt.algorithms.RSAAlgorithm
        else:
            self.key = ec.generate_private_key(ec.SECP256R1())
            self.algorithm, self.jwk = "ES256", jwt.algorithms.ECAlgorithm

    def jwks(self) -> dict[str, Any]:
        public = json.loads(self.jwk.to_jwk(self.key.public_key()))
        return {"keys": [{**public, "kid": self.kid, "use": "sig", "alg": self.algorithm}]}

    def documents(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The discovery document and the key set, as Kube.read_issuer returns them."""
        return {"issuer": self.url, "jwks_uri": f"{self.url}/openid/v1/jwks"}, self.jwks()

    def issuer(self) -> Issuer:
        return read_issuer(*self.documents())

    def token(self, namespace: str = "ml", pod: str | None = "train-0",
              uid: str | None = "uid-0", audience: str = REPORT_AUDIENCE, lifetime: int = 3600,
              issued: float | None = None, **claims: Any) -> str:
        """A token of the namespace's `default` account, bound to `pod` (None: to nothing)."""
        now = int(time.time() if issued is None else issued)
        cluster: dict[str, Any] = {"namespace": namespace,
                                   "serviceaccount": {"name": "default", "uid": "sa-uid"}}
        if pod is not None:
            cluster["pod"] = {"name": pod, "uid": uid}
        payload = {"iss": self.url, "sub": f"system:serviceaccount:{namespace}:default",
                   "aud": [audience], "iat": now, "nbf": now, "exp": now + lifetime,
                   "jti": f"jti-{now}", "kubernetes.io": cluster, **claims}
        return jwt.encode(payload, self.key, algorithm=self.algorithm,
                          headers={"kid": self.kid})
