"""fast_exit runs real programs in a fresh interpreter: it must end them as `python SCRIPT` would
(exit code, traceback, __main__, sys.argv, sys.path, threads, atexit, buffered files, C stdio,
multiprocessing) while skipping the interpreter's teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TRAINER = Path(__file__).resolve().parents[2] / "trainer"


def run(tmp_path: Path, source: str, *args: str, module: str | None = None,
        name: str = "script.py") -> subprocess.CompletedProcess:
    """`python -m accelerate_trainer.fast_exit tmp_path/name ARGS` (or `-m module`) in tmp_path."""
    (tmp_path / name).write_text(textwrap.dedent(source))
    target = ["-m", module] if module else [str(tmp_path / name)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TRAINER), os.environ.get(
        "PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "accelerate_trainer.fast_exit", *target, *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("ending", "code", "stderr"), [
    ("pass", 0, ""),
    ("sys.exit()", 0, ""),
    ("sys.exit(0)", 0, ""),
    ("sys.exit(3)", 3, ""),
    ("sys.exit(-1)", 255, ""),
    ("sys.exit('no data found')", 1, "no data found\n"),
])
def test_exit_code_is_the_one_python_gives(tmp_path, ending, code, stderr):
    result = run(tmp_path, f"import sys\n{ending}\n")
    plain = subprocess.run([sys.executable, str(tmp_path / "script.py")], capture_output=True,
                           text=True, timeout=60)
    assert (result.returncode, result.stderr) == (plain.returncode, plain.stderr) == (code, stderr)


def test_uncaught_exception_prints_the_scripts_own_traceback_and_exits_1(tmp_path):
    result = run(tmp_path, """
        def train():
            raise ValueError("loss is nan")
        train()
    """)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: loss is nan"
    assert "script.py" in lines[1]  # the script's frame comes first: no runpy, no fast_exit
    assert "runpy" not in result.stderr and "fast_exit" not in result.stderr


def test_the_script_runs_as_main_with_its_argv_and_its_folder_on_the_path(tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "helper.py").write_text("VALUE = 'sibling imported'\n")
    result = run(tmp_path, """
        import sys
        import helper
        if __name__ == "__main__":
            print(sys.argv, helper.VALUE, sys.path[0])
    """, "--lr", "0.1", name="code/train.py")
    assert result.returncode == 0, result.stderr
    train = tmp_path / "code" / "train.py"
    assert result.stdout == f"{[str(train), '--lr', '0.1']} sibling imported {train.parent}\n"


def test_a_module_runs_as_main_like_python_dash_m(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    result = run(tmp_path, """
        import sys
        if __name__ == "__main__":
            print(sys.argv[1:], sys.argv[0].endswith("train.py"))
            sys.exit(4)
    """, "--epochs", "1", module="pkg.train", name="pkg/train.py")
    assert (result.returncode, result.stdout) == (4, "['--epochs', '1'] True\n"), result.stderr


def test_threads_atexit_and_unflushed_files_finish_before_the_process_ends(tmp_path):
    result = run(tmp_path, """
        import atexit, ctypes, logging, threading, time
        # A module-level file never closed, with less than a buffer's worth written.
        LOG = open("metrics.txt", "w")
        LOG.write("step=40 loss=0.1\\n")
        RAW = open("weights.bin", "wb")
        RAW.write(b"\\x01" * 100)
        logging.basicConfig(filename="train.log", level=logging.INFO)
        logging.info("saved")

        def upload():
            time.sleep(0.3)
            with open("uploaded.txt", "w") as f:
                f.write("done")

        threading.Thread(target=upload).start()  # not a daemon: Python waits for it
        atexit.register(lambda: print("atexit ran", flush=True))
        ctypes.CDLL(None).printf(b"from C stdio\\n")  # an extension's printf
    """)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["atexit ran", "from C stdio"]
    assert (tmp_path / "metrics.txt").read_text() == "step=40 loss=0.1\n"
    assert (tmp_path / "weights.bin").read_bytes() == b"\x01" * 100
    assert (tmp_path / "train.log").read_text() == "INFO:root:saved\n"
    assert (tmp_path / "uploaded.txt").read_text() == "done"


def test_the_interpreters_teardown_is_skipped(tmp_path):
    # What makes it fast, and the one documented difference: objects still alive at exit (here
    # held by an imported module) are not finalized; CPython does not promise it either.
    source = """
        import sys
        class Model:
            def __del__(self):
                print("finalized at teardown", flush=True)
        sys.modules["model_holder"] = type(sys)("model_holder")
        sys.modules["model_holder"].model = Model()
    """
    result = run(tmp_path, source)
    assert (result.returncode, result.stdout) == (0, "")
    plain = subprocess.run([sys.executable, str(tmp_path / "script.py")], capture_output=True,
                           text=True, timeout=60)
    assert plain.stdout == "finalized at teardown\n"


def test_spawned_workers_find_functions_defined_in_the_script(tmp_path):
    # DataLoader workers under the spawn (or forkserver) start method re-import __main__.
    result = run(tmp_path, """
        import multiprocessing

        def square(x):
            return x * x

        if __name__ == "__main__":
            with multiprocessing.get_context("spawn").Pool(2) as pool:
                print(pool.map(square, [1, 2, 3]))
    """)
    assert (result.returncode, result.stdout) == (0, "[1, 4, 9]\n"), result.stderr


def test_keyboard_interrupt_ends_the_process_by_sigint_as_python_does(tmp_path):
    result = run(tmp_path, "raise KeyboardInterrupt\n")
    assert result.returncode == -signal.SIGINT
    assert result.stderr.rstrip().endswith("KeyboardInterrupt")


def test_no_program_is_a_usage_error(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(TRAINER)}
    result = subprocess.run([sys.executable, "-m", "accelerate_trainer.fast_exit"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: python -m accelerate_trainer.fast_exit")


# ---- no output lost at exit (issue 24): what libraries write at the end survives fast_exit ----

WRITERS = """
import logging, os, sys
import torch
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}

torch.save(tensors, os.path.join(out, "model.pt"))

from safetensors.torch import save_file
save_file(tensors, os.path.join(out, "model.safetensors"))

import torch.distributed.checkpoint as dcp
# The future is never waited for: only the end of the process waits for its writer thread.
dcp.async_save({"w": tensors["w"].clone()}, checkpoint_id=os.path.join(out, "dcp"))

handler = logging.FileHandler(os.path.join(out, "train.log"))  # never closed by the script
log = logging.getLogger("train")
log.addHandler(handler)
log.setLevel(logging.INFO)
log.info("last line of the run")

from torch.utils.tensorboard import SummaryWriter
writer = SummaryWriter(os.path.join(out, "tb"))  # neither flushed nor closed
writer.add_scalar("loss", 0.5, 1)

from accelerate.tracking import TensorBoardTracker
tracker = TensorBoardTracker("run", os.path.join(out, "tracker"))
tracker.start()  # what accelerator.init_trackers() does
tracker.log({"loss": 0.25}, step=1)
tracker.finish()  # what accelerator.end_training() calls for each tracker

unclosed = open(os.path.join(out, "notes.txt"), "w")  # a plain file left open
unclosed.write("written, never flushed\\n")
"""


def _outputs(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by path, with its bytes; event files by their records' count
    and content (their names hold the host, pid and time, which differ between runs)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        relative = str(path.relative_to(folder))
        if ".tfevents." in path.name:
            from tensorboard.backend.event_processing.event_file_loader import (
                EventFileLoader,
            )
            values = [(v.tag, round(float(v.simple_value or v.tensor.float_val[0]
                                          if v.tensor.float_val else v.simple_value), 6), e.step)
                      for e in EventFileLoader(str(path)).Load()
                      for v in e.summary.value]
            found[str(path.parent.relative_to(folder)) + "/events"] = repr(values).encode()
        elif path.suffix in (".pt", ".distcp") or path.name == ".metadata":
            found[relative] = b"present"  # pickles holding paths: loaded back by the test
        else:
            found[relative] = path.read_bytes()
    return found


def test_what_libraries_write_at_exit_survives_fast_exit_as_it_does_pythons_exit(tmp_path):
    fast_run = run(tmp_path, WRITERS, str(tmp_path / "fast"))
    assert fast_run.returncode == 0, fast_run.stderr
    script = tmp_path / "script.py"
    plain = subprocess.run([sys.executable, str(script), str(tmp_path / "plain")],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(TRAINER)})
    assert plain.returncode == 0, plain.stderr
    fast, python = _outputs(tmp_path / "fast"), _outputs(tmp_path / "plain")
    assert fast == python
    assert fast["train.log"] == b"last line of the run\n"
    assert fast["notes.txt"] == b"written, never flushed\n"
    assert fast["tb/events"] == repr([("loss", 0.5, 1)]).encode()
    assert fast["tracker/run/events"] == repr([("loss", 0.25, 1)]).encode()
    assert {"model.pt", "model.safetensors", "dcp/.metadata"} <= set(fast)
    import torch
    from safetensors.torch import load_file
    loaded = load_file(str(tmp_path / "fast" / "model.safetensors"))
    assert torch.equal(loaded["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(torch.load(tmp_path / "fast" / "model.pt")["w"], loaded["w"])
    import torch.distributed.checkpoint as dcp
    state = {"w": torch.zeros(3, 4)}
    dcp.load(state, checkpoint_id=str(tmp_path / "fast" / "dcp"), no_dist=True)
    assert torch.equal(state["w"], loaded["w"])
