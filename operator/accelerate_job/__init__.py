"""The user side of the AccelerateJob operator: `AccelerateJobClient` (Python) and the
`accelerate-job` CLI (also `kubectl accelerate`), both on one request layer (request.py).

Imports only the operator's pure modules (names, constants, builders' helpers): never the
operator's kube/, its informers or its reconciler (.importlinter)."""

from .client import AccelerateJobClient
from .code import CodeArchive, CodeError, CodeTooLarge, pack_code
from .errors import AccelerateJobError, InvalidConfig, JobFailed, JobNotFound, WaitTimeout

__all__ = ["AccelerateJobClient", "AccelerateJobError", "CodeArchive", "CodeError",
           "CodeTooLarge", "InvalidConfig", "JobFailed", "JobNotFound", "WaitTimeout",
           "pack_code"]
