"""Loaded by Python's site module at the start of every process whose PYTHONPATH starts with this
folder (error_files.launch_env): installs accelerate_trainer.error_files' hooks, then runs the
sitecustomize this one hides, if the image has one, so the image's own start-up work still runs."""

import importlib
import os
import sys


def _run_hidden_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    kept = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    finally:
        sys.path[:] = kept
        if ours is not None:
            sys.modules["sitecustomize"] = ours


try:
    from accelerate_trainer import error_files

    error_files.install()
except ImportError:  # a process whose Python lacks the package: nothing to explain with
    pass
_run_hidden_sitecustomize()
