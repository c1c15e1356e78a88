"""Checkpoints that survive a whole-group restart, and finding the one to resume from.

accelerate's `load_state()` picks the highest-numbered folder even when it is half written, and
does not restore the iteration counter, so the next `save_state()` crashes (accelerate issues
1601, 3306). A checkpoint here counts only once every rank has written it and rank 0 has dropped
a COMPLETE marker into it; resuming sets the iteration past it.

A run told to stop (SIGTERM: a node drained, a pod preempted, the operator stopping the group for
a restart) can save one complete checkpoint first, all ranks together: `stop_on_signal()` once,
then `checkpoint_on_stop(accelerator)` after every optimizer step. Only the ranks of the pod
being stopped receive the signal at first; the ranks agree at each step boundary (a max over
every rank's flag), so they all save the same step, and the group resumes from it having lost
at most the step that was in flight. The pod's terminationGracePeriodSeconds (120 s by default
for an AccelerateJob) must cover a step and a save.

The COMPLETE marker names the job's attempt (ACCELERATE_JOB_ATTEMPT) that wrote it: a fencing
token. A group the operator has replaced (its node was cut off, and a newer attempt already
completed a checkpoint in the same folder) refuses to save (`Superseded`) instead of writing over
its successor's progress.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .contract import ENV_JOB_ATTEMPT, STOPPED_EXIT_CODE

COMPLETE_MARKER = "COMPLETE"
_CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)$")


def find_resume_checkpoint(project_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under `<project_dir>/checkpoints`, or None."""
    root = Path(project_dir) / "checkpoints"
    if not root.is_dir():
        return None
    complete = []
    for child in root.iterdir():
        match = _CHECKPOINT_NAME.match(child.name)
        if match and (child / COMPLETE_MARKER).is_file():
            complete.append((int(match.group(1)), child))
    return max(complete)[1] if complete else None


def checkpoint_iteration(path: str | Path) -> int:
    match = _CHECKPOINT_NAME.match(Path(path).name)
    if not match:
        raise ValueError(f"{path} is not named checkpoint_<N>")
    return int(match.group(1))


class Superseded(RuntimeError):
    """A newer attempt of the job has completed a checkpoint: this group was replaced."""


def newest_attempt(project_dir: str | Path) -> int | None:
    """The highest attempt named by a COMPLETE marker under `<project_dir>/checkpoints` (a
    marker from before markers named one counts as none). Every rank reads the markers as it
    saves, while rank 0's `save_state()` deletes the checkpoints past `total_limit`: a marker
    gone between the listing and the read counts as none, its checkpoint being gone too."""
    root = Path(project_dir) / "checkpoints"
    attempts = []
    for marker in root.glob(f"checkpoint_*/{COMPLETE_MARKER}") if root.is_dir() else ():
        try:
            text = marker.read_text(errors="replace").split()
        except FileNotFoundError:
            continue
        if len(text) == 2 and text[0] == "attempt" and text[1].isdigit():
            attempts.append(int(text[1]))
    return max(attempts, default=None)


def _attempt() -> int | None:
    value = os.environ.get(ENV_JOB_ATTEMPT, "")
    return int(value) if value.isdigit() else None


def save_checkpoint(accelerator: Any) -> Path:
    """`accelerator.save_state()` into the next numbered folder, then mark it complete once every
    rank has finished writing. Needs ProjectConfiguration(automatic_checkpoint_naming=True).
    Raises Superseded, on every rank that sees it, when a newer attempt completed one."""
    config = accelerator.project_configuration
    attempt, newest = _attempt(), newest_attempt(config.project_dir)
    if attempt is not None and newest is not None and newest > attempt:
        raise Superseded(f"attempt {newest} of this job has completed a checkpoint in "
                         f"{config.project_dir}; attempt {attempt} (this group) was replaced "
                         "and stops without saving")
    accelerator.save_state()
    accelerator.wait_for_everyone()
    path = Path(config.project_dir) / "checkpoints" / f"checkpoint_{config.iteration - 1}"
    if accelerator.is_main_process:
        (path / COMPLETE_MARKER).write_text(f"attempt {attempt or 0}\n")
    accelerator.wait_for_everyone()
    return path


def next_checkpoint_iteration(project_dir: str | Path) -> int:
    """One past the highest `checkpoint_<N>` folder, complete or not: `save_state()` refuses to
    write into an existing folder, and a crash during a save leaves a half-written one behind."""
    root = Path(project_dir) / "checkpoints"
    if not root.is_dir():
        return 0
    matches = (_CHECKPOINT_NAME.match(child.name) for child in root.iterdir())
    numbers = [int(match.group(1)) for match in matches if match]
    return max(numbers, default=-1) + 1


def resume_from_checkpoint(accelerator: Any, path: str | Path | None) -> bool:
    """Load a checkpoint written by `save_checkpoint` (when `path` is given) and move the iteration
    counter past every existing checkpoint folder, so the next save does not collide with one.
    Returns whether it loaded one."""
    config = accelerator.project_configuration
    if config.project_dir is not None:
        config.iteration = max(config.iteration, next_checkpoint_iteration(config.project_dir))
    if not path:
        return False
    accelerator.load_state(str(path))
    # load_state also restores accelerate's micro-batch counter (`step`), whose count per
    # optimizer step is the gradient accumulation: resumed at another accumulation (an elastic
    # job at another size), the first step would sync early. A checkpoint is saved at an
    # optimizer-step boundary, where the counter starts over.
    accelerator.step = 0
    config.iteration = max(config.iteration, checkpoint_iteration(path) + 1)
    return True


class _StopRequest:
    """Set by the signal handler; read at step boundaries. A flag only: the handler runs between
    two bytecodes of whatever the rank was doing, where saving is not safe."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def handler(self, signum: int, _frame: Any) -> None:
        self.signal = signum


_STOP = _StopRequest()


def stop_on_signal(signals: Iterable[int] = (signal.SIGTERM,)) -> None:
    """Turn SIGTERM (by default) into a stop request instead of the process's end. Call it once,
    from the main thread, before training. The launcher (torchrun, under `accelerate launch`)
    passes the pod's SIGTERM on to every rank of the pod."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("stop_on_signal() must be called from the main thread (Python only "
                           "delivers signals there)")
    for signum in signals:
        signal.signal(signum, _STOP.handler)


def stop_requested(accelerator: Any = None) -> bool:
    """Whether this rank was asked to stop; with `accelerator`, whether ANY rank was: a
    collective (a gather of one number), so every rank must call it at the same step."""
    local = _STOP.signal is not None
    if accelerator is None or getattr(accelerator, "num_processes", 1) <= 1:
        return local
    import torch

    flag = torch.tensor([1 if local else 0], device=accelerator.device)
    return bool(accelerator.gather(flag).max().item())


def checkpoint_on_stop(accelerator: Any, *,
                       exit_code: int | None = STOPPED_EXIT_CODE) -> Path | None:
    """At a step boundary, on every rank: when any rank was asked to stop, save a complete
    checkpoint together (`save_checkpoint`) and exit with STOPPED_EXIT_CODE (83), or, with
    exit_code None, return the checkpoint's path. Returns None while no stop was requested.
    Needs ProjectConfiguration(automatic_checkpoint_naming=True), as save_checkpoint does."""
    if not stop_requested(accelerator):
        return None
    path = save_checkpoint(accelerator)
    if accelerator.is_main_process:
        sys.stdout.write(f"STOPPED checkpoint={path}\n")
        sys.stdout.flush()
    if exit_code is None:
        return path
    accelerator.end_training()
    raise SystemExit(exit_code)
