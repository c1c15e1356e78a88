"""Write down why a launch failed, in torch's own error-file format, from inside the processes.

torchrun gives every rank the env TORCHELASTIC_ERROR_FILE and, when that rank fails, reads the
file into its ProcessFailure (torch.distributed.elastic.multiprocessing.errors). Only a rank whose
entrypoint is decorated with torch's `@record` writes it, which no training script is, so the
summary says "error_file: <N/A>". The launch hook (launch_hook/sitecustomize.py, on each
process's PYTHONPATH) calls `install`, which:

- in a rank (TORCHELASTIC_ERROR_FILE set): chains sys.excepthook to write the exception and its
  traceback into that file, as torch's ErrorHandler.record_exception would, plus the time to the
  microsecond (torch's is whole seconds: ranks failing in the same second would tie). A script
  Python cannot open is recorded too, with the OSError the same open() gives, in Python's words.
  Only the rank itself records: every Python process the rank starts inherits the variable and
  this hook, and a helper that fails and is handled (a probe such as `python -c "import
  flash_attn"`) must not become the rank's root cause when the rank then dies of a signal or
  exits non-zero. The first process to see the file claims it (ENV_ERROR_FILE_OWNER, its PID
  and the file), and its descendants, which inherit the claim, leave the file alone. The claim
  is added beside torch's variable rather than removing that one, so the script's os.environ
  still has it (torch's own `@record` reads it there).
- in the launcher (ENV_LAUNCH_REPORT set, set by the supervisor): chains sys.excepthook to write
  what ended the launch into that file: the ChildFailedError's failures as torch read them (rank,
  exit code, signal, error file), or any other exception (a rendezvous that timed out) with the
  names of its classes. root_cause.py reads it.

Imports nothing beyond the standard library at start: it runs in every process before its
program, and a torch import here would cost every rank seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Mapping, MutableMapping
from typing import Any

ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # torch's: set by torchrun for each rank
ENV_LAUNCH_REPORT = "ACCELERATE_TRAINER_LAUNCH_REPORT"
ENV_ERROR_FILE_OWNER = "ACCELERATE_TRAINER_ERROR_FILE_OWNER"  # "<pid> <error file>": the rank's
HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_hook")
TRACEBACK_CHARS = 8000
CHILD_FAILED = "ChildFailedError"


def error_record(error: BaseException, now: float | None = None) -> dict[str, Any]:
    """torch's error-file JSON for `error` (ErrorHandler.record_exception's shape), with `time`
    (float seconds) beside torch's whole-second `timestamp`."""
    now = time.time() if now is None else now
    callstack = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return {"message": {"message": f"{type(error).__name__}: {error}",
                        "extraInfo": {"py_callstack": callstack[-TRACEBACK_CHARS:],
                                      "timestamp": str(int(now)), "time": now}}}


def unopenable_script(argv: list[str], executable: str) -> dict[str, Any] | None:
    """The error record of a script Python will not be able to open (the file is opened here as
    Python opens it), worded as Python's own line; None when it opens, or argv is no script."""
    if not argv or not argv[0] or argv[0] in ("-c", "-m", "-"):
        return None
    try:
        with open(argv[0], "rb"):
            return None
    except OSError as error:
        line = (f"{executable}: can't open file {argv[0]!r}: [Errno {error.errno}] "
                f"{error.strerror}")
        now = time.time()
        return {"message": {"message": line,
                            "extraInfo": {"py_callstack": line, "timestamp": str(int(now)),
                                          "time": now}}}


def write_json(path: str, data: Mapping[str, Any]) -> None:
    """Never raises: a failure to explain a failure must not change the exit. Written whole or
    not at all (a file beside it, renamed over it): torchrun reads the error file of a rank it
    has just stopped, and a rank stopped while writing (its peer gone, it raised, then got
    torchrun's SIGTERM) left a part that torch's JSON read failed on, ending the launcher
    without the failures it had."""
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as file:
            json.dump(data, file)
        os.replace(partial, path)
    except (OSError, TypeError, ValueError):
        with contextlib.suppress(OSError):
            os.remove(partial)


def launch_record(error: BaseException) -> dict[str, Any]:
    """What ended the launcher: its exception's class names and message, and for torch's
    ChildFailedError each failed rank as torch read it."""
    record: dict[str, Any] = {
        "exception": [cls.__name__ for cls in type(error).__mro__],
        "message": str(error)[-TRACEBACK_CHARS:],
    }
    failures = getattr(error, "failures", None) if type(error).__name__ == CHILD_FAILED else None
    if isinstance(failures, Mapping):
        record["failures"] = [_failure(rank, failure) for rank, failure in failures.items()]
    return record


def _failure(rank: Any, failure: Any) -> dict[str, Any]:
    exitcode = getattr(failure, "exitcode", None)
    signal = failure.signal_name() if isinstance(exitcode, int) and exitcode < 0 else None
    # torch fills error_file_data with a placeholder when the rank wrote no file.
    written = os.path.isfile(str(getattr(failure, "error_file", "")))
    data = getattr(failure, "error_file_data", None) if written else None
    return {"rank": rank, "localRank": getattr(failure, "local_rank", None),
            "exitCode": exitcode, "signal": signal,
            "timestamp": getattr(failure, "timestamp", None),
            "error": data if isinstance(data, Mapping) and data else None}


def _chain(write) -> None:
    previous = sys.excepthook

    def hook(kind, error, tb):
        try:
            previous(kind, error, tb)
        finally:
            write(error)

    sys.excepthook = hook


def owns_error_file(error_file: str, owner: str | None, pid: int) -> bool:
    """Whether the process `pid` is the rank torchrun gave `error_file`: no process claimed the
    file yet (`owner`, ENV_ERROR_FILE_OWNER as inherited), or this one did (it exec'd). A claim
    on another file is a rank of an outer torchrun: this process is a rank of its own."""
    claimed_pid, _, claimed_file = (owner or "").partition(" ")
    return claimed_file != error_file or claimed_pid == str(pid)


def install(environ: MutableMapping[str, str] | None = None) -> None:
    """Set this process up to explain its failure (the module's docstring)."""
    environ = os.environ if environ is None else environ
    error_file = environ.get(ENV_ERROR_FILE)
    if error_file and not owns_error_file(error_file, environ.get(ENV_ERROR_FILE_OWNER),
                                          os.getpid()):
        return  # a process the rank started: its failure is not the rank's (the docstring)
    if error_file:
        environ[ENV_ERROR_FILE_OWNER] = f"{os.getpid()} {error_file}"
        unopenable = unopenable_script(list(sys.argv), sys.executable)
        if unopenable is not None:
            write_json(error_file, unopenable)
        _chain(lambda error: write_json(error_file, error_record(error)))
        return
    report = environ.get(ENV_LAUNCH_REPORT)
    if report:
        _chain(lambda error: write_json(report, launch_record(error)))


def launch_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The env that loads the launch hook in the launcher and in every rank it starts: last on
    PYTHONPATH, so the user's own folders still come first (and a sitecustomize of theirs wins),
    yet before site-packages, whose sitecustomize the hook runs after its own."""
    path = environ.get("PYTHONPATH")
    return {"PYTHONPATH": (path + os.pathsep if path else "") + HOOK_DIR}


def read_json(path: str) -> dict[str, Any] | None:
    """A record the hook wrote, or None when there is none (the launch did not fail in Python,
    or was killed before its hook ran)."""
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
