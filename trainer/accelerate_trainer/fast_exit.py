"""`python -m accelerate_trainer.fast_exit SCRIPT [ARGS...]` (or `-m MODULE [ARGS...]`): run a
Python program as `python SCRIPT` would, then end the process without the interpreter's teardown.

Why: once a training script returns, CPython spends 1-2 s unloading torch, gloo and CUDA (module
dicts, C++ static destructors) before the process is gone, and the `accelerate launch` process
that waits for it spends about as long again; a job is Succeeded only when both are gone. With
the opt-in, the trainer runs `accelerate launch` and every rank through this module
(command.py); docs/performance.md measures what that saves at the end of a job.

What Python's own exit does that a program can rely on is still done, in Python's order:
non-daemon threads are joined (threading's shutdown), atexit handlers run (logging, multiprocessing
children, trackers, weakref.finalize, torch's compile workers), every open Python file object is
flushed, then C stdio buffers; the exit code is the one `python SCRIPT` would end with, and an
uncaught exception's traceback is printed by sys.excepthook first. What is skipped is what CPython
does not promise either: __del__ of objects still alive at exit, module teardown and C++ static
destructors (the script's own globals may be finalized earlier: runpy's __main__ is a temporary
module, dropped when the script returns). A KeyboardInterrupt keeps Python's own path (it ends
the process by SIGINT). Opt-in: only ACCELERATE_TRAINER_FAST_EXIT=1 on the container runs a job
through this module; by default a script runs as `accelerate launch` runs it. A rank whose
script returned 0 after building an Accelerator other than the one the trainer launched
(deepspeed_cpu.check_finished_rank) exits 1 instead.
"""

from __future__ import annotations

import _io
import atexit
import gc
import os
import runpy
import sys
import threading
from collections.abc import Sequence

from .deepspeed_cpu import check_finished_rank

# Set to 1 (or true/yes/on) on the container to run the launcher and the ranks under this module.
ENV_FAST_EXIT = "ACCELERATE_TRAINER_FAST_EXIT"
USAGE = "usage: python -m accelerate_trainer.fast_exit SCRIPT [ARGS...] | -m MODULE [ARGS...]"


def run_program(argv: Sequence[str]) -> int:
    """Run SCRIPT (or `-m MODULE`) as __main__ with sys.argv and sys.path[0] set as `python`
    sets them; returns the exit code Python would give. KeyboardInterrupt propagates."""
    try:
        if argv[0] == "-m":
            sys.argv = list(argv[1:])
            # alter_sys: sys.argv[0] becomes the module's file and sys.modules["__main__"] the
            # module, as with `python -m` (sys.path[0] is already the working directory).
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            if os.path.isfile(argv[0]):
                # `python dir/train.py` imports the script's siblings: its real folder first.
                sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        return exit_code(exit_.code)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 (printed and turned into exit code 1, as Python does)
        # sys.excepthook prints the exception's own traceback, so trim that one.
        error.__traceback__ = user_frames(error.__traceback__)
        sys.excepthook(type(error), error, error.__traceback__)
        return 1
    return 0


def exit_code(code: object) -> int:
    """The process exit code of `SystemExit(code)`, as CPython computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def user_frames(traceback):
    """The traceback without this module's and runpy's frames, so it reads as `python SCRIPT`'s."""
    while traceback is not None and (traceback.tb_frame.f_globals is globals()
                                     or traceback.tb_frame.f_globals.get("__name__") == "runpy"):
        traceback = traceback.tb_next
    return traceback


def finish_like_python() -> None:
    """What Py_FinalizeEx does before its teardown: join threads, run atexit, flush files."""
    shutdown_threads = getattr(threading, "_shutdown", None)
    if shutdown_threads is not None:
        shutdown_threads()
    else:  # not in any CPython we know; join the non-daemon threads ourselves
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    flush_open_files()


def flush_open_files() -> None:
    """Flush every open Python file object (text wrappers first: they write into their binary
    buffers), then the C library's stdio buffers (extensions' printf, std::cout)."""
    # By type only: isinstance() against io's ABCs reads each object's __class__, which is ten
    # times slower over a torch process's ~400,000 objects and trips deprecated-module warnings.
    files = [obj for obj in gc.get_objects() if issubclass(type(obj), _io._IOBase)]
    files.sort(key=lambda obj: not issubclass(type(obj), _io._TextIOBase))
    for obj in files:
        try:
            if not obj.closed:
                obj.flush()
        except Exception:  # noqa: BLE001,S112 (a file that cannot flush would not at exit either)
            continue
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv == ["-m"] or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    code = run_program(argv)
    mismatch = check_finished_rank() if code == 0 else None
    if mismatch:  # a rank that trained something other than the job launched did not succeed
        print(f"error: {mismatch}", file=sys.stderr)
        code = 1
    finish_like_python()
    os._exit(code & 0xFF)


if __name__ == "__main__":
    main()
