"""The processes under the supervisor (supervise.py): a launch's exit code as a shell gives it,
and what the supervisor does as the container's first process (PID 1) to stop a launch whole.

Why /proc and not process groups: torchrun starts each rank in a session of its own, so a
launcher's process group misses its ranks; /proc's parent links find them all. Why PID 1 has
more to do: a process whose parent ended is re-parented to PID 1, and in a container that is the
supervisor. The ranks a failed launcher left behind become its children, to be stopped (they may
hang in a collective on a dead rank: NCCL does) and reaped before an in-place restart's next
attempt (`stop_orphans`); and when the pod is stopped, the processes a launcher left behind get
the stop signal and are waited for, so they can save before the container ends with its first
process (`stop_leftovers`).
"""

from __future__ import annotations

import contextlib
import os
import signal


def exit_code(returncode: int) -> int:
    """The launcher's exit code as a shell would give it: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent_pid(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    return children


def stop_tree(pid: int, children: dict[int, list[int]] | None = None) -> None:
    """SIGKILL `pid` and every process under it. torchrun starts each rank in a session of its
    own, so a process group would miss them; /proc's parent links do not. No checkpoint is
    possible here anyway: a rank of the group has already ended, and saving takes every rank."""
    children = _children() if children is None else children
    doomed, todo = [], [pid]
    while todo:
        current = todo.pop()
        doomed.append(current)
        todo.extend(children.get(current, ()))
    for victim in doomed:
        try:
            os.kill(victim, signal.SIGKILL)
        except OSError:
            pass


def stop_orphans() -> None:
    """Ranks a failed launcher left behind are this process's children once it is PID 1 (the
    container's first process): stopped, and reaped, before the next attempt."""
    if os.getpid() != 1:
        return
    children = _children()
    for orphan in children.get(1, ()):
        stop_tree(orphan, children)
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def stop_leftovers(signal_number: int, code: int) -> int:
    """The pod is being stopped and its launcher has ended: the processes it left behind get the
    stop signal too, and are waited for; the last one's exit code is the pod's. accelerate's
    simple launcher (one process on one machine) passes no signal on and dies of SIGTERM at once,
    leaving the script, which would die with this process (PID 1) before it could save. The
    kubelet's SIGKILL at the end of the pod's grace period bounds the wait."""
    if os.getpid() != 1:
        return code
    leftovers = _children().get(1, [])
    for pid in leftovers:
        with contextlib.suppress(OSError):
            os.kill(pid, signal_number)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return code
        if pid in leftovers:
            code = exit_code(os.waitstatus_to_exitcode(status))


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return int(file.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
