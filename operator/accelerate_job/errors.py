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
    pass


class JobFailed(AccelerateJobError):
    """The job reached Failed while waiting for another condition."""

    def __init__(self, message: str, job: Mapping[str, Any]):
        super().__init__(message)
        self.job = job


class WaitTimeout(AccelerateJobError, TimeoutError):
    pass
