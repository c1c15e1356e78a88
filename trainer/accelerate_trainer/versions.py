"""The versions of the libraries a training run uses, read from installed metadata.

`importlib.metadata` only: importing torch to ask its version costs seconds on every pod's start.
The trainer logs them at start (and after installing requirements, when those changed one), and
pod 0's supervisor puts them in its reports to the operator, which copies them into the job's
status.trainer, so a job that behaves unlike a laptop run can be explained from `kubectl
describe`."""

from __future__ import annotations

import platform
from collections.abc import Sequence
from importlib import metadata

# What decides how `accelerate launch` and a training script behave, in the order they are logged.
PACKAGES = ("accelerate", "torch", "transformers", "deepspeed", "datasets",
            "accelerate-operator")


def read_versions(paths: Sequence[str] | None = None) -> dict[str, str]:
    """{"python": ..., "accelerate": ..., ...} for the packages installed (others are left out).
    `paths` (default sys.path) is where to look: a requirements install adds its own folder."""
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        found = next(iter(metadata.distributions(name=name, **(
            {"path": list(paths)} if paths is not None else {}))), None)
        if found is not None and found.version:
            versions[name] = found.version
    return versions


def describe(versions: dict[str, str]) -> str:
    """`python 3.11.9, accelerate 1.15.0, torch 2.15.0, ...` for the log."""
    return ", ".join(f"{name} {version}" for name, version in versions.items())
