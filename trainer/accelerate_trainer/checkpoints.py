"""Checkpoints that survive a whole-group restart, and finding the one to resume from.

accelerate's `load_state()` picks the highest-numbered folder even when it is half written, and
does not restore the iteration counter, so the next `save_state()` crashes (accelerate issues
1601, 3306). A checkpoint here counts only once every rank has written it and rank 0 has dropped
a COMPLETE marker into it; resuming sets the iteration past it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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


def save_checkpoint(accelerator: Any) -> Path:
    """`accelerator.save_state()` into the next numbered folder, then mark it complete once every
    rank has finished writing. Needs ProjectConfiguration(automatic_checkpoint_naming=True)."""
    accelerator.save_state()
    accelerator.wait_for_everyone()
    config = accelerator.project_configuration
    path = Path(config.project_dir) / "checkpoints" / f"checkpoint_{config.iteration - 1}"
    if accelerator.is_main_process:
        (path / COMPLETE_MARKER).write_text("ok\n")
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
    config.iteration = max(config.iteration, checkpoint_iteration(path) + 1)
    return True
