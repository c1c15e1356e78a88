"""The container's own memory counters: how many processes the kernel's OOM killer ended in this
cgroup, and its memory limit. Read before and after a launch, they say whether a rank that died
of SIGKILL was killed for memory, without guessing from its exit code (SIGKILL is also what a
`kill -9` or torchrun's agent after its grace period sends).

cgroup v2 (the kubelet's default since 1.25): memory.events `oom_kill N`, memory.max (`max` when
unlimited). cgroup v1: memory/memory.oom_control `oom_kill N` (kernel 4.13+),
memory/memory.limit_in_bytes (a huge number when unlimited). None when neither is readable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ROOT = "/sys/fs/cgroup"
# cgroup v1 writes "unlimited" as the largest page-aligned signed 64-bit number; anything at or
# above 2**60 bytes is no limit a pod could have.
UNLIMITED_FLOOR = 2**60


def parse_counter(text: str, key: str) -> int | None:
    """The value of `key` in a flat-keyed cgroup file (memory.events, memory.oom_control)."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1])
    return None


def parse_limit(text: str) -> int | None:
    """memory.max / memory.limit_in_bytes in bytes; None when unlimited."""
    value = text.strip()
    if not value.isdigit() or int(value) >= UNLIMITED_FLOOR:
        return None
    return int(value)


@dataclass(frozen=True)
class MemoryState:
    oom_kills: int
    limit: int | None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as file:
            return file.read()
    except (OSError, UnicodeDecodeError):
        return None


def read(root: str = ROOT) -> MemoryState | None:
    """This container's OOM-kill count and memory limit, or None when the cgroup's memory
    files cannot be read (not Linux, or no memory controller)."""
    for events, key, limit in (
        (os.path.join(root, "memory.events"), "oom_kill", os.path.join(root, "memory.max")),
        (os.path.join(root, "memory", "memory.oom_control"), "oom_kill",
         os.path.join(root, "memory", "memory.limit_in_bytes")),
    ):
        text = _read(events)
        kills = parse_counter(text, key) if text is not None else None
        if kills is not None:
            limit_text = _read(limit)
            return MemoryState(kills, parse_limit(limit_text) if limit_text else None)
    return None


def kills_between(before: MemoryState | None, after: MemoryState | None) -> int:
    """OOM kills counted between two reads (0 when either is unknown)."""
    if before is None or after is None:
        return 0
    return max(after.oom_kills - before.oom_kills, 0)
