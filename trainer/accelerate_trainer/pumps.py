"""Copying the launcher's output to the container's own streams, byte for byte as it arrives,
and feeding it to Reports (report_push.py): the supervisor holds the launcher's stdout and
stderr on pipes so that it sees rank 0's progress lines and a failed launch's last lines
without reading any log. The waits here are how the supervisor knows those last lines are in
before it reports an exit or writes the pod's termination message."""

from __future__ import annotations

import array
import fcntl
import os
import select
import termios
import threading
import time
from collections.abc import Sequence

from .report_push import Reports

DRAIN_QUIET_SECONDS = 0.25  # after the launcher ended: its last bytes are copied when quiet
DRAIN_MAX_SECONDS = 2.0


class Pump(threading.Thread):
    """Copies one pipe to one of the container's streams as bytes arrive, feeding Reports."""

    def __init__(self, source: int, target: int, reports: Reports):
        super().__init__(name=f"pump-{target}", daemon=True)
        self.source, self.target, self.reports = source, target, reports
        self.last_read = time.monotonic()
        self.lock = threading.Lock()  # held from a read until its bytes are fed (catch_up)

    def run(self) -> None:
        readable = select.poll()
        readable.register(self.source, select.POLLIN)
        while True:
            try:
                readable.poll()
                with self.lock:
                    chunk = os.read(self.source, 65536)
                    if chunk:
                        self.last_read = time.monotonic()
                        _write_all(self.target, chunk)
                        self.reports.feed(self.target, chunk, time.time())
            except InterruptedError:
                continue
            except (OSError, ValueError):
                return
            if not chunk:
                return


def catch_up(pumps: Sequence[Pump], timeout: float = DRAIN_MAX_SECONDS) -> None:
    """Wait until the pumps have fed every byte already in their pipes, so a launch's exit is
    reported with the last lines it wrote (its traceback): the launcher's exit can be seen
    before its last bytes are read. A pump reads only under its lock, so a pipe found empty
    while holding it has nothing unfed. Bounded: ranks left behind may go on writing."""
    deadline = time.monotonic() + timeout
    for pump in pumps:
        while pump.is_alive() and time.monotonic() < deadline:
            if pump.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                try:
                    if _unread(pump.source) == 0:
                        break
                finally:
                    pump.lock.release()
            time.sleep(0.01)


def _unread(fd: int) -> int:
    """Bytes waiting in a pipe that no one has read yet (FIONREAD)."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, count)
    except OSError:
        return 0
    return count[0]


def _write_all(fd: int, data: bytes) -> None:
    """Never raises: the container's stream going away must not block or kill the training."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except InterruptedError:
            continue
        except OSError:
            return


def drain(pumps: Sequence[Pump]) -> None:
    """After the last launch ended: wait until what it wrote is fed (catch_up: the pod's
    termination message ends with it), then for quiet. A pipe may stay open in a process the
    launcher left behind, so quiet, not the end of the pipes, ends the wait."""
    deadline = time.monotonic() + DRAIN_MAX_SECONDS
    catch_up(pumps)
    while time.monotonic() < deadline and any(p.is_alive() for p in pumps):
        newest = max(p.last_read for p in pumps)
        if time.monotonic() - newest >= DRAIN_QUIET_SECONDS:
            return
        time.sleep(DRAIN_QUIET_SECONDS / 5)
