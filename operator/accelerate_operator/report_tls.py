"""The report endpoint's TLS, pure: a CA and a serving certificate made with `cryptography`,
and when to make new ones. The material lives in one Secret in the operator's namespace
(report_keeper.py reads and writes it); the CA certificates reach the pods in each job's
ConfigMap (contract.REPORT_CA_KEY), so nobody copies a certificate by hand.

Rotation, with no moment where a pod trusts a CA that did not sign the serving certificate:
- the serving certificate lives SERVING_DAYS and is renewed when SERVING_RENEW_DAYS are left;
- a CA lives CA_DAYS; when CA_RENEW_DAYS are left a new CA joins the bundle beside the old one;
- a serving certificate is signed by the newest CA that has been in the bundle for at least
  CA_OVERLAP (the kubelet has refreshed every pod's ConfigMap volume by then), else by the one
  before it;
- a CA that has expired leaves the bundle."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CA_DAYS = 3650
CA_RENEW_DAYS = 365
CA_OVERLAP = dt.timedelta(days=1)
SERVING_DAYS = 90
SERVING_RENEW_DAYS = 30
CA_NAME = "accelerate-operator report CA"
# The Secret's keys.
CA_CERTS_KEY, CA_KEYS_KEY = "ca.crt", "ca.key"
TLS_CERT_KEY, TLS_KEY_KEY = "tls.crt", "tls.key"


@dataclass(frozen=True)
class Material:
    """The Secret's content, PEM: every trusted CA (newest last) with its key in the same
    order, and the serving certificate and its key."""

    ca_certs: str
    ca_keys: str
    tls_cert: str
    tls_key: str

    def to_data(self) -> dict[str, str]:
        return {CA_CERTS_KEY: self.ca_certs, CA_KEYS_KEY: self.ca_keys,
                TLS_CERT_KEY: self.tls_cert, TLS_KEY_KEY: self.tls_key}

    @classmethod
    def from_data(cls, data: dict[str, str] | None) -> Material | None:
        data = data or {}
        keys = (CA_CERTS_KEY, CA_KEYS_KEY, TLS_CERT_KEY, TLS_KEY_KEY)
        return cls(*(data[k] for k in keys)) if all(data.get(k) for k in keys) else None


def service_names(host: str) -> list[str]:
    """The DNS names a Service `<name>.<namespace>.svc` answers to, from one of them; any other
    host alone."""
    parts = host.split(".")
    if len(parts) >= 3 and parts[2] == "svc":
        name, namespace = parts[0], parts[1]
        return [name, f"{name}.{namespace}", f"{name}.{namespace}.svc",
                f"{name}.{namespace}.svc.cluster.local"]
    return [host]


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _pem_cert(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def new_ca(now: dt.datetime) -> tuple[str, str]:
    """(certificate, key) of a new CA, PEM."""
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME),
                      x509.NameAttribute(NameOID.SERIAL_NUMBER, str(int(now.timestamp())))])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                         False), critical=True)
            .sign(key, hashes.SHA256()))
    return _pem_cert(cert), _pem_key(key)


def new_serving(ca_cert: str, ca_key: str, names: Iterable[str], now: dt.datetime
                ) -> tuple[str, str]:
    """(certificate, key) for the endpoint, signed by the CA, for `names` (DNS SANs)."""
    issuer = x509.load_pem_x509_certificate(ca_cert.encode())
    signer = serialization.load_pem_private_key(ca_key.encode(), password=None)
    key, names = _key(), list(names)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(issuer.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=SERVING_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.OID_SERVER_AUTH]), critical=False)
            .sign(signer, hashes.SHA256()))
    return _pem_cert(cert), _pem_key(key)


def _split_keys(text: str) -> list[str]:
    marker = "-----END PRIVATE KEY-----"
    return [part.strip() + "\n" + marker + "\n" for part in text.split(marker) if part.strip()]


def _cas(material: Material) -> list[tuple[x509.Certificate, str, str]]:
    certs = x509.load_pem_x509_certificates(material.ca_certs.encode())
    return [(c, _pem_cert(c), k) for c, k in zip(certs, _split_keys(material.ca_keys),
                                                 strict=True)]


def _needs_serving(material: Material, signer: x509.Certificate, names: list[str],
                   now: dt.datetime) -> bool:
    cert = x509.load_pem_x509_certificate(material.tls_cert.encode())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    left = cert.not_valid_after_utc - now
    return (left < dt.timedelta(days=SERVING_RENEW_DAYS) or cert.issuer != signer.subject
            or sorted(sans.get_values_for_type(x509.DNSName)) != sorted(names))


def renew(material: Material | None, names: Iterable[str], now: dt.datetime
          ) -> Material | None:
    """The material to store instead of `material` (None: none yet), or None when it is good
    as it is. `now` is aware (UTC)."""
    names = list(names)
    if material is None:
        ca_cert, ca_key = new_ca(now)
        return Material(ca_cert, ca_key, *new_serving(ca_cert, ca_key, names, now))
    cas = [(c, p, k) for c, p, k in _cas(material) if c.not_valid_after_utc > now]
    changed = len(cas) != len(_cas(material))
    if not cas or cas[-1][0].not_valid_after_utc - now < dt.timedelta(days=CA_RENEW_DAYS):
        ca_cert, ca_key = new_ca(now)
        cas.append((x509.load_pem_x509_certificate(ca_cert.encode()), ca_cert, ca_key))
        changed = True
    fresh = [ca for ca in cas if now - ca[0].not_valid_before_utc >= CA_OVERLAP]
    signer = fresh[-1] if fresh else cas[-1]
    tls_cert, tls_key = material.tls_cert, material.tls_key
    if _needs_serving(material, signer[0], names, now):
        tls_cert, tls_key = new_serving(signer[1], signer[2], names, now)
        changed = True
    if not changed:
        return None
    return Material("".join(p for _, p, _ in cas), "".join(k for _, _, k in cas), tls_cert,
                    tls_key)


def next_check(material: Material, now: dt.datetime) -> dt.timedelta:
    """How long until renew() may have something to do: the earliest of the serving
    certificate's renewal, a CA's renewal or expiry, and a new CA's overlap ending."""
    moments = [x509.load_pem_x509_certificate(material.tls_cert.encode()).not_valid_after_utc
               - dt.timedelta(days=SERVING_RENEW_DAYS)]
    for cert, _, _ in _cas(material):
        moments += [cert.not_valid_after_utc, cert.not_valid_after_utc
                    - dt.timedelta(days=CA_RENEW_DAYS), cert.not_valid_before_utc + CA_OVERLAP]
    future = [m - now for m in moments if m > now]
    return min(future) if future else dt.timedelta(0)
