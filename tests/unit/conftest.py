"""Fixtures for the tests that run the trainer's main() in-process (a pod without GPUs whose
exec and termination log are recorded instead of used), and for the CLI's commands run against
a fake client."""

from __future__ import annotations

import accelerate_trainer.__main__ as trainer_main
import pytest
from accelerate_job import session


@pytest.fixture
def termination_log(tmp_path, monkeypatch):
    path = tmp_path / "termination-log"
    monkeypatch.setattr(trainer_main, "TERMINATION_LOG", path)
    return path


@pytest.fixture
def no_exec(monkeypatch):
    """Record what main() would exec instead of replacing the test process."""
    calls = []
    monkeypatch.setattr(trainer_main.os, "execvpe", lambda *args: calls.append(args))
    # no exec, so no launcher for the progress relay to end with: test_kubeflow_relay.py starts it
    monkeypatch.setattr(trainer_main, "start_relay", lambda environ, node_rank: {})
    monkeypatch.setattr(trainer_main, "count_visible_gpus", lambda: 0)
    return calls


@pytest.fixture
def fake(monkeypatch):
    """`fake(client)`: every CLI command of the test talks to `client` instead of a cluster."""
    def install(client):
        monkeypatch.setattr(session, "client", lambda args: client)
        return client
    return install
