"""Keeps the report endpoint's TLS: the Secret in the operator's namespace (created if absent,
so every replica shares one; a replica that loses the race reads the winner's), renewed before
anything in it expires (report_tls.renew), the server's SSL context loaded from it, and its CA
bundle (`bundle`) for the jobs' ConfigMaps: each job's own pass writes it there
(decide.ca_patch), whence the kubelet copies it into the pods' report volume. A new bundle is
announced (`on_new_bundle`): the controller runs every job's pass."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import ssl
import tempfile
from collections.abc import Callable

from .kube import Kube
from .report_tls import Material, next_check, renew

log = logging.getLogger("accelerate_operator")

# The Secret is read again at least this often: another replica may have renewed it.
RELOAD_SECONDS = 3600.0
SECRET_LABELS = {"app.kubernetes.io/part-of": "accelerate-operator",
                 "app.kubernetes.io/component": "report-tls"}


def server_context(material: Material) -> ssl.SSLContext:
    """A server context holding the serving certificate and key (ssl loads them from files
    only: written to a private directory and removed at once)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    load_chain(context, material)
    return context


def load_chain(context: ssl.SSLContext, material: Material) -> None:
    """Into an existing context: connections made from now on use the new certificate."""
    with tempfile.TemporaryDirectory(prefix="report-tls-") as directory:
        cert, key = os.path.join(directory, "tls.crt"), os.path.join(directory, "tls.key")
        for path, text in ((cert, material.tls_cert), (key, material.tls_key)):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as file:
                file.write(text)
        context.load_cert_chain(cert, key)


class CertKeeper:
    def __init__(self, kube: Kube, namespace: str, secret: str, names: list[str],
                 on_new_bundle: Callable[[], None] = lambda: None,
                 now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.timezone.utc)):
        self.kube, self.namespace, self.secret, self.names = kube, namespace, secret, names
        self.on_new_bundle, self.now = on_new_bundle, now
        self.material: Material | None = None
        self.context: ssl.SSLContext | None = None

    @property
    def bundle(self) -> str | None:
        """The CA certificates the pods trust, for each job's ConfigMap."""
        return self.material.ca_certs if self.material else None

    async def ensure(self) -> Material:
        """The Secret's material, renewed and written back when due. A write another replica
        made first (409) is read again."""
        for _ in range(5):
            secret = await self.kube.read_secret(self.namespace, self.secret)
            current = Material.from_data(secret["data"]) if secret else None
            renewed = renew(current, self.names, self.now())
            if renewed is None:
                return current  # type: ignore[return-value]
            version = secret["metadata"]["resourceVersion"] if secret else None
            if await self.kube.write_secret(self.namespace, self.secret, renewed.to_data(),
                                            SECRET_LABELS, version):
                log.info("report endpoint TLS %s in Secret %s/%s", "renewed" if secret
                         else "created", self.namespace, self.secret)
                return renewed
        raise RuntimeError(f"Secret {self.namespace}/{self.secret} kept changing under us")

    async def start(self) -> ssl.SSLContext:
        """The first load: the server's context."""
        self.material = await self.ensure()
        self.context = server_context(self.material)
        return self.context

    async def _once(self) -> None:
        material = await self.ensure()
        if material != self.material:
            self.material = material
            if self.context is not None:
                load_chain(self.context, material)
            log.info("report endpoint TLS reloaded: every job's pass brings its ConfigMap the "
                     "new CA bundle")
            self.on_new_bundle()

    async def run(self) -> None:
        """Renew when due, and read the Secret again every RELOAD_SECONDS."""
        while True:
            wait = RELOAD_SECONDS
            if self.material is not None:
                wait = min(wait, max(1.0, next_check(self.material, self.now()).total_seconds()))
            await asyncio.sleep(wait)
            try:
                await self._once()
            except Exception as error:  # noqa: BLE001 - tried again at the next round
                log.warning("renewing the report endpoint's TLS failed: %r", error)
