"""Wait until the master is reachable: the first complaint of Kubeflow users is workers that
crash because the master's DNS name does not resolve yet, or resolves before it listens."""

from __future__ import annotations

import logging
import socket
import time

from .topology import Topology

log = logging.getLogger("accelerate_trainer")


class MasterUnreachable(RuntimeError):
    """The master did not resolve or listen within the timeout."""


def wait_for_master(topology: Topology, *, timeout: float, interval: float = 1.0) -> None:
    """Every node waits for MASTER_ADDR to resolve; nodes other than 0 also wait for the master
    port to accept connections (node 0 is the one that will open it)."""
    deadline = time.monotonic() + timeout
    _wait(
        lambda: socket.getaddrinfo(topology.master_addr, topology.master_port),
        f"{topology.master_addr} to resolve",
        deadline,
        interval,
    )
    if topology.is_master:
        return

    def connect() -> None:
        with socket.create_connection((topology.master_addr, topology.master_port), timeout=2):
            pass

    _wait(connect, f"{topology.master_addr}:{topology.master_port} to accept connections",
          deadline, interval)


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
