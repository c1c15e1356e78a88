"""Fixtures for the tests that run the trainer's main() in-process (a pod without GPUs whose
exec and termination log are recorded instead of used), and for the CLI's commands run against
a fake client."""

from __future__ import annotations

import accelerate_trainer.__main__ as trainer_main
import pytest
from accelerate_job import session
from accelerate_trainer import termination


@pytest.fixture
def termination_log(tmp_path, monkeypatch):
    """The file the kubelet makes for a container's last word, where the trainer writes it."""
    path = tmp_path / "termination-log"
    path.write_text("")
    monkeypatch.setattr(termination, "TERMINATION_LOG", path)
    return path


@pytest.fixture
def no_exec(monkeypatch):
    """Record what main() would exec instead of replacing the test process."""
    calls = []
    monkeypatch.setattr(trainer_main.os, "execvpe", lambda *args: calls.append(args))
    monkeypatch.setattr(trainer_main, "count_visible_gpus", lambda *_: 0)
    return calls


@pytest.fixture
def fake(monkeypatch):
    """`fake(client)`: every CLI command of the test talks to `client` instead of a cluster."""
    def install(client):
        monkeypatch.setattr(session, "client", lambda args: client)
        return client
    return install


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """Test CAs and server certificates for the report endpoint's stand-in: `cert` for
    localhost signed by `ca`; `cert_other_ca` signed by another CA; `cert_other_host` for
    another host name, signed by `ca`."""
    from types import SimpleNamespace

    from tests.helpers.report_endpoint import make_ca, make_cert

    directory = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(directory, "ca"), make_ca(directory, "other-ca")
    return SimpleNamespace(ca=ca[0], other_ca=other[0],
                           cert=make_cert(directory, ca, "localhost"),
                           cert_other_ca=make_cert(directory, other, "localhost"),
                           cert_other_host=make_cert(directory, ca, "other.example"))
