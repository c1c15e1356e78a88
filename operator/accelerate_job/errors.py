"""What the client raises: every expected failure is an AccelerateJobError whose message says
what is wrong and what to do; the CLI prints exactly that message."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class AccelerateJobError(Exception):
    """An expected failure: the message says what is wrong and what to do."""


class InvalidConfig(AccelerateJobError):
    """The accelerate YAML given to submit cannot work for the job; nothing was created."""


class JobNotFound(AccelerateJobError):
    """No job of that name in the namespace, or it was deleted while being watched."""


class JobFailed(AccelerateJobError):
    """The job reached Failed while waiting for another condition; `.job` is the job then."""

    def __init__(self, message: str, job: Mapping[str, Any]):
        super().__init__(message)
        self.job = job


class WaitTimeout(AccelerateJobError, TimeoutError):
    """`wait` gave up; the message says where the job stood (phase, progress)."""
