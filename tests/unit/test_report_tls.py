"""The report endpoint's TLS material and its rotation, checked with Python's own TLS: a
client that trusts the bundle reaches the server by its Service name; one that trusts another
CA, or asks for another name, does not."""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import threading

import pytest
from accelerate_operator.report_keeper import server_context
from accelerate_operator.report_settings import read_report_settings
from accelerate_operator.report_tls import Material, next_check, renew, service_names
from cryptography import x509

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
NAMES = service_names("accelerate-operator.accelerate-system.svc")


def handshake(material: Material, trusted: str, name: str) -> None:
    """One TLS handshake against a server holding `material`, trusting `trusted` (PEM)."""
    server = server_context(material)
    client = ssl.create_default_context(cadata=trusted)
    left, right = socket.socketpair()
    errors = []

    def serve():
        try:
            with server.wrap_socket(right, server_side=True):
                pass
        except (ssl.SSLError, OSError) as error:
            errors.append(error)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client.wrap_socket(left, server_hostname=name):
            pass
    finally:
        thread.join(5)


def valid_now(material: Material) -> bool:
    cert = x509.load_pem_x509_certificate(material.tls_cert.encode())
    now = dt.datetime.now(dt.timezone.utc)
    return cert.not_valid_before_utc <= now <= cert.not_valid_after_utc


def test_a_new_secret_serves_every_name_of_the_service_to_clients_of_its_bundle():
    assert NAMES == ["accelerate-operator", "accelerate-operator.accelerate-system",
                     "accelerate-operator.accelerate-system.svc",
                     "accelerate-operator.accelerate-system.svc.cluster.local"]
    material = renew(None, NAMES, dt.datetime.now(dt.timezone.utc))
    for name in NAMES:
        handshake(material, material.ca_certs, name)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(material, material.ca_certs, "kubernetes.default.svc")
    other = renew(None, NAMES, dt.datetime.now(dt.timezone.utc))
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(material, other.ca_certs, NAMES[2])
    assert valid_now(material)


def test_nothing_is_renewed_while_everything_is_far_from_its_end():
    material = renew(None, NAMES, NOW)
    assert renew(material, NAMES, NOW + dt.timedelta(days=59)) is None
    assert next_check(material, NOW) == dt.timedelta(days=1, minutes=-5)  # the CA's overlap
    assert renew(material, NAMES[:2], NOW) is not None  # other names: a new certificate


def test_the_serving_certificate_is_renewed_a_month_before_it_ends_by_the_same_ca():
    material = renew(None, NAMES, NOW)
    renewed = renew(material, NAMES, NOW + dt.timedelta(days=61))
    assert renewed.ca_certs == material.ca_certs and renewed.tls_cert != material.tls_cert
    cert = x509.load_pem_x509_certificate(renewed.tls_cert.encode())
    assert cert.not_valid_after_utc == NOW + dt.timedelta(days=61 + 90)


def test_a_new_ca_joins_the_bundle_a_year_ahead_and_signs_only_after_the_overlap():
    material = renew(None, NAMES, NOW)
    late = NOW + dt.timedelta(days=3650 - 300)
    joined = renew(material, NAMES, late)
    cas = x509.load_pem_x509_certificates(joined.ca_certs.encode())
    assert len(cas) == 2 and joined.ca_certs.startswith(material.ca_certs)
    # the serving certificate still comes from the old CA: pods may not have the new one yet
    issuer = x509.load_pem_x509_certificate(joined.tls_cert.encode()).issuer
    assert issuer == cas[0].subject
    signed = renew(joined, NAMES, late + dt.timedelta(days=2))
    assert x509.load_pem_x509_certificate(signed.tls_cert.encode()).issuer == cas[1].subject
    assert signed.ca_certs == joined.ca_certs  # both trusted through the overlap
    gone = renew(signed, NAMES, NOW + dt.timedelta(days=3651))
    assert x509.load_pem_x509_certificates(gone.ca_certs.encode()) == [cas[1]]


def test_a_secret_missing_a_key_is_no_material():
    data = renew(None, NAMES, NOW).to_data()
    assert Material.from_data(data) is not None
    assert Material.from_data({**data, "tls.key": ""}) is None
    assert Material.from_data(None) is None


def test_settings_default_to_the_charts_shape_in_the_operators_namespace():
    settings = read_report_settings({}, "ops")
    assert settings.endpoint.base_url == "https://accelerate-operator.ops.svc:8443"
    assert (settings.port, settings.namespace) == (8443, "ops")
    assert settings.secret == "accelerate-operator-report-tls"
    assert settings.names[2] == "accelerate-operator.ops.svc"
    assert settings.progress_write_seconds == 12.0
    chart = read_report_settings({"ACCELERATE_OPERATOR_REPORT_URL": "https://rel.team.svc:9443",
                                  "ACCELERATE_OPERATOR_REPORT_PORT": "0",
                                  "ACCELERATE_OPERATOR_POD_NAMESPACE": "team",
                                  "ACCELERATE_OPERATOR_REPORT_SECRET": "rel-tls",
                                  "ACCELERATE_OPERATOR_PROGRESS_WRITE_SECONDS": "1.5"})
    assert (chart.port, chart.secret, chart.endpoint.base_url) == (0, "rel-tls",
                                                                  "https://rel.team.svc:9443")
    assert chart.progress_write_seconds == 1.5


@pytest.mark.parametrize("env, words", [
    ({"ACCELERATE_OPERATOR_REPORT_URL": "http://op.ns.svc:8443"}, "REPORT_URL"),
    ({"ACCELERATE_OPERATOR_REPORT_URL": "https://op.ns.svc:8443/x"}, "REPORT_URL"),
    ({"ACCELERATE_OPERATOR_REPORT_PORT": "eighty"}, "REPORT_PORT"),
    ({"ACCELERATE_OPERATOR_PROGRESS_WRITE_SECONDS": "0"}, "PROGRESS_WRITE_SECONDS='0': give"),
    ({"ACCELERATE_OPERATOR_PROGRESS_WRITE_SECONDS": "10s"}, "PROGRESS_WRITE_SECONDS='10s'"),
    ({"ACCELERATE_OPERATOR_PROGRESS_WRITE_SECONDS": "nan"}, "above 0"),
])
def test_bad_settings_name_the_variable(env, words):
    with pytest.raises(ValueError, match=words):
        read_report_settings(env)
