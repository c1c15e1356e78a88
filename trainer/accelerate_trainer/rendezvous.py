"""Wait until the master's name resolves: the first complaint of Kubeflow users is workers that
crash because the master's DNS name does not resolve yet.

Only the name: a worker does not wait for the master's port to listen. torch's store client
retries a refused connection until its rendezvous timeout, so `accelerate launch` can start on
every node at once. Waiting for the port here made each worker import torch only after the
master had imported it and opened the port, seconds added to every start (docs/performance.md,
"The trainer's start")."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping

from .command import DEFAULT_RENDEZVOUS_TIMEOUT, ENV_RENDEZVOUS_TIMEOUT
from .errors import ConfigError
from .topology import Topology

log = logging.getLogger("accelerate_trainer")


def rendezvous_timeout(environ: Mapping[str, str]) -> int:
    """Seconds the master's name and then the group may take (ENV_RENDEZVOUS_TIMEOUT)."""
    text = environ.get(ENV_RENDEZVOUS_TIMEOUT, "").strip()
    if not text:
        return DEFAULT_RENDEZVOUS_TIMEOUT
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(
            f"{ENV_RENDEZVOUS_TIMEOUT}={text!r} must be a whole number of seconds, at least 1 "
            f"(default {DEFAULT_RENDEZVOUS_TIMEOUT}); fix it in the trainer container's env"
        )
    return int(text)


class MasterUnreachable(RuntimeError):
    """The master's name did not resolve within the timeout."""


def wait_for_master(topology: Topology, *, timeout: float, interval: float = 0.2) -> None:
    """Every node waits for MASTER_ADDR to resolve (the headless Service publishes a pod's
    address as soon as it has one, before it is ready)."""
    deadline = time.monotonic() + timeout
    _wait(
        lambda: socket.getaddrinfo(topology.master_addr, topology.master_port),
        f"{topology.master_addr} to resolve",
        deadline,
        interval,
    )


def _wait(attempt, what: str, deadline: float, interval: float) -> None:
    started = time.monotonic()
    next_log = started
    while True:
        try:
            attempt()
        except OSError as error:
            now = time.monotonic()
            if now >= deadline:
                raise MasterUnreachable(
                    f"gave up after {now - started:.0f}s waiting for {what}: {error}"
                ) from None
            if now >= next_log:
                log.info("waiting for %s (%s)", what, error)
                next_log = now + 10
            time.sleep(interval)
        else:
            if time.monotonic() - started > 1:
                log.info("%s: ok after %.1fs", what, time.monotonic() - started)
            return
