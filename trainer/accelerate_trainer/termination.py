"""The container's last word: Kubernetes copies the file the kubelet made at TERMINATION_LOG into
the container's terminated state (its first 4096 bytes), where `kubectl describe` and the
operator's status show it. Written by the trainer for a config it refuses, and by the
supervisor with a failed launch's root cause."""

from __future__ import annotations

import contextlib
from pathlib import Path

TERMINATION_LOG = Path("/dev/termination-log")
TERMINATION_CHARS = 4000


def write_termination_message(message: str, path: Path | str | None = None) -> None:
    """Only into the file the kubelet made: outside a pod there is none, and nothing is
    written; a file that cannot be written is no error (the log still says it)."""
    target = Path(path) if path is not None else TERMINATION_LOG
    if not target.is_file():
        return
    with contextlib.suppress(OSError):
        target.write_text(message[:TERMINATION_CHARS], encoding="utf-8")
