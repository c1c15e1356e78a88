"""Checkpoints count only once marked COMPLETE; resuming moves accelerate's counter past them."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate_trainer.checkpoints import (
    COMPLETE_MARKER,
    Superseded,
    checkpoint_iteration,
    find_resume_checkpoint,
    newest_attempt,
    next_checkpoint_iteration,
    resume_from_checkpoint,
    save_checkpoint,
)


def make_checkpoint(project_dir: Path, iteration: int, *, complete: bool) -> Path:
    path = project_dir / "checkpoints" / f"checkpoint_{iteration}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"weights")
    if complete:
        (path / COMPLETE_MARKER).write_text("ok\n")
    return path


# ---- find_resume_checkpoint ---------------------------------------------------------------------


def test_no_checkpoint_folder_means_a_fresh_start(tmp_path):
    assert find_resume_checkpoint(tmp_path) is None
    assert find_resume_checkpoint(tmp_path / "does-not-exist") is None


def test_empty_checkpoint_folder_means_a_fresh_start(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    assert find_resume_checkpoint(tmp_path) is None


def test_newest_complete_checkpoint_is_picked(tmp_path):
    make_checkpoint(tmp_path, 0, complete=True)
    newest = make_checkpoint(tmp_path, 1, complete=True)
    assert find_resume_checkpoint(tmp_path) == newest


def test_half_written_checkpoint_without_complete_is_never_picked(tmp_path):
    complete = make_checkpoint(tmp_path, 1, complete=True)
    make_checkpoint(tmp_path, 2, complete=False)
    assert find_resume_checkpoint(tmp_path) == complete


def test_only_half_written_checkpoints_mean_a_fresh_start(tmp_path):
    make_checkpoint(tmp_path, 0, complete=False)
    assert find_resume_checkpoint(tmp_path) is None


def test_checkpoints_are_ordered_by_number_not_by_name(tmp_path):
    make_checkpoint(tmp_path, 9, complete=True)
    ten = make_checkpoint(tmp_path, 10, complete=True)
    assert find_resume_checkpoint(str(tmp_path)) == ten


def test_folders_not_named_checkpoint_n_are_ignored(tmp_path):
    kept = make_checkpoint(tmp_path, 3, complete=True)
    for name in ("checkpoint_7.tmp", "checkpoint_", "best", "checkpoint_-1"):
        other = tmp_path / "checkpoints" / name
        other.mkdir()
        (other / COMPLETE_MARKER).write_text("ok\n")
    assert find_resume_checkpoint(tmp_path) == kept


def test_a_complete_marker_must_be_a_file(tmp_path):
    kept = make_checkpoint(tmp_path, 1, complete=True)
    odd = make_checkpoint(tmp_path, 2, complete=False)
    (odd / COMPLETE_MARKER).mkdir()
    assert find_resume_checkpoint(tmp_path) == kept


# ---- iteration numbers --------------------------------------------------------------------------


def test_iteration_is_read_from_the_folder_name():
    assert checkpoint_iteration("/ckpt/checkpoints/checkpoint_12") == 12
    assert checkpoint_iteration(Path("checkpoint_0")) == 0


@pytest.mark.parametrize("name", ["/ckpt/checkpoints/latest", "checkpoint_1/model", "ckpt_3"])
def test_iteration_of_a_foreign_folder_is_an_error(name):
    with pytest.raises(ValueError, match="is not named checkpoint_<N>"):
        checkpoint_iteration(name)


def test_next_iteration_skips_every_existing_folder_complete_or_not(tmp_path):
    assert next_checkpoint_iteration(tmp_path) == 0
    make_checkpoint(tmp_path, 0, complete=True)
    assert next_checkpoint_iteration(tmp_path) == 1
    make_checkpoint(tmp_path, 4, complete=False)
    assert next_checkpoint_iteration(tmp_path) == 5


# ---- save and resume with a recording accelerator --------------------------------------------


class FakeAccelerator:
    """Records the calls save_checkpoint and resume_from_checkpoint make; save_state writes a
    folder and bumps the iteration as accelerate's automatic naming does."""

    def __init__(self, project_dir: Path, *, is_main_process: bool = True, iteration: int = 0):
        self.project_configuration = SimpleNamespace(project_dir=str(project_dir),
                                                     iteration=iteration)
        self.is_main_process = is_main_process
        self.calls: list[str] = []

    def save_state(self):
        config = self.project_configuration
        path = Path(config.project_dir) / "checkpoints" / f"checkpoint_{config.iteration}"
        path.mkdir(parents=True, exist_ok=True)
        self.calls.append(f"save_state {path.name}")
        config.iteration += 1

    def wait_for_everyone(self):
        self.calls.append("wait_for_everyone")

    def load_state(self, path):
        assert isinstance(path, str)
        self.calls.append(f"load_state {Path(path).name}")


def test_save_marks_the_checkpoint_complete_after_every_rank_wrote_it(tmp_path):
    accelerator = FakeAccelerator(tmp_path, iteration=2)
    path = save_checkpoint(accelerator)
    assert path == tmp_path / "checkpoints" / "checkpoint_2"
    assert (path / COMPLETE_MARKER).is_file()
    assert accelerator.calls == [
        "save_state checkpoint_2", "wait_for_everyone", "wait_for_everyone"
    ]
    assert find_resume_checkpoint(tmp_path) == path


def test_the_marker_names_the_attempt_that_wrote_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_JOB_ATTEMPT", "2")
    path = save_checkpoint(FakeAccelerator(tmp_path, iteration=0))
    assert (path / COMPLETE_MARKER).read_text() == "attempt 2\n"
    assert newest_attempt(tmp_path) == 2


def test_a_marker_deleted_while_the_markers_are_read_counts_as_none(tmp_path, monkeypatch):
    """Rank 0's save_state() deletes the checkpoints past total_limit while another rank reads
    the markers for the fence: the marker listed, then gone before it is read (the likely
    cause of a resumed 2-node job failing near its last save)."""
    for iteration, attempt in ((0, 1), (1, 2), (2, 1)):
        make_checkpoint(tmp_path, iteration, complete=False)
        (tmp_path / "checkpoints" / f"checkpoint_{iteration}" / COMPLETE_MARKER).write_text(
            f"attempt {attempt}\n")
    read_text = Path.read_text

    def rotated_away_first(path: Path, *args, **kwargs):
        if path.parent.name == "checkpoint_1":
            shutil.rmtree(path.parent)  # rank 0 rotating it out, between listing and read
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", rotated_away_first)
    assert newest_attempt(tmp_path) == 1


def test_a_group_replaced_by_a_newer_attempt_refuses_to_save(tmp_path, monkeypatch):
    """The fence for a group left running on a node cut off from the API server: once a newer
    attempt has completed a checkpoint, the old group writes nothing more."""
    make_checkpoint(tmp_path, 0, complete=True)  # a marker from before markers named attempts
    newer = make_checkpoint(tmp_path, 5, complete=False)
    (newer / COMPLETE_MARKER).write_text("attempt 3\n")
    monkeypatch.setenv("ACCELERATE_JOB_ATTEMPT", "2")
    accelerator = FakeAccelerator(tmp_path, iteration=6)
    with pytest.raises(Superseded, match="attempt 3 of this job has completed a checkpoint"):
        save_checkpoint(accelerator)
    assert accelerator.calls == []  # nothing written
    monkeypatch.setenv("ACCELERATE_JOB_ATTEMPT", "3")  # the newer group itself saves on
    assert save_checkpoint(accelerator).name == "checkpoint_6"


def test_only_the_main_process_writes_the_marker(tmp_path):
    (tmp_path / "checkpoints" / "checkpoint_0").mkdir(parents=True)
    accelerator = FakeAccelerator(tmp_path, is_main_process=False)
    path = save_checkpoint(accelerator)
    assert not (path / COMPLETE_MARKER).exists()


def test_nothing_to_resume_from_still_moves_the_counter_past_old_folders(tmp_path):
    make_checkpoint(tmp_path, 0, complete=False)  # a first save that died half way
    accelerator = FakeAccelerator(tmp_path)
    assert resume_from_checkpoint(accelerator, None) is False
    assert accelerator.calls == []
    assert accelerator.project_configuration.iteration == 1


def test_resume_loads_the_checkpoint_and_moves_the_counter_past_it(tmp_path):
    path = make_checkpoint(tmp_path, 3, complete=True)
    accelerator = FakeAccelerator(tmp_path)
    assert resume_from_checkpoint(accelerator, path) is True
    assert accelerator.calls == ["load_state checkpoint_3"]
    assert accelerator.project_configuration.iteration == 4


def test_resume_moves_the_counter_past_a_newer_half_written_folder(tmp_path):
    """accelerate's save_state refuses to write into an existing folder: resuming from 3 with a
    half-written 4 on disk must save next into 5."""
    path = make_checkpoint(tmp_path, 3, complete=True)
    make_checkpoint(tmp_path, 4, complete=False)
    accelerator = FakeAccelerator(tmp_path)
    resume_from_checkpoint(accelerator, find_resume_checkpoint(tmp_path))
    assert accelerator.calls == [f"load_state {path.name}"]
    assert save_checkpoint(accelerator) == tmp_path / "checkpoints" / "checkpoint_5"


def test_resume_without_a_project_dir_only_loads(tmp_path):
    path = make_checkpoint(tmp_path, 2, complete=True)
    accelerator = FakeAccelerator(tmp_path)
    accelerator.project_configuration.project_dir = None
    assert resume_from_checkpoint(accelerator, str(path)) is True
    assert accelerator.project_configuration.iteration == 3


# ---- the same with a real (single process, CPU) Accelerator ----------------------------------


@pytest.fixture
def real_accelerator_factory(monkeypatch):
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    for name in ("ACCELERATE_USE_CPU", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)

    def make(project_dir: Path):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(
            cpu=True,
            project_config=ProjectConfiguration(
                project_dir=str(project_dir), automatic_checkpoint_naming=True, total_limit=3
            ),
        )
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        return accelerator, model, optimizer

    yield make
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_real_accelerator_resumes_past_a_half_written_checkpoint(
    tmp_path, real_accelerator_factory
):
    import torch

    accelerator, model, _ = real_accelerator_factory(tmp_path)
    save_checkpoint(accelerator)
    with torch.no_grad():
        model.weight.add_(1.0)
    saved_weight = model.weight.detach().clone()
    latest = save_checkpoint(accelerator)
    assert latest.name == "checkpoint_1"
    # A crash while saving checkpoint_2: some files, no COMPLETE.
    make_checkpoint(tmp_path, 2, complete=False)

    accelerator, model, _ = real_accelerator_factory(tmp_path)
    assert find_resume_checkpoint(tmp_path) == latest
    assert resume_from_checkpoint(accelerator, find_resume_checkpoint(tmp_path))
    assert torch.equal(model.weight.detach(), saved_weight)
    # Without moving the counter this would raise "checkpoint_2 already exists".
    assert save_checkpoint(accelerator).name == "checkpoint_3"


def test_real_accelerator_load_state_alone_would_pick_the_half_written_folder(
    tmp_path, real_accelerator_factory
):
    """Why COMPLETE markers: accelerate's own resume takes the highest-numbered folder."""
    accelerator, _, _ = real_accelerator_factory(tmp_path)
    save_checkpoint(accelerator)
    make_checkpoint(tmp_path, 1, complete=False)
    accelerator, _, _ = real_accelerator_factory(tmp_path)
    from safetensors import SafetensorError

    with pytest.raises(SafetensorError, match="header too small"):  # checkpoint_1's stub weights
        accelerator.load_state()


# ---- a stop request (SIGTERM) saves one complete checkpoint on every rank together ------------

STOP_SCRIPT = '''
import os, signal, sys
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from accelerate_trainer.checkpoints import checkpoint_on_stop, stop_on_signal

accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
    project_dir=sys.argv[1], automatic_checkpoint_naming=True))
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
stop_on_signal()
for step in range(1, 100):
    loss = model(torch.ones(2, 4)).sum()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    print(f"rank={accelerator.process_index} step={step}", flush=True)
    if step == 3 and accelerator.process_index == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # only this rank's pod is being drained
    checkpoint_on_stop(accelerator)
print(f"rank={accelerator.process_index} never stopped", flush=True)
'''


def test_sigterm_on_one_rank_makes_every_rank_save_the_same_complete_checkpoint(tmp_path):
    import os
    import re
    import socket
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(STOP_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    import accelerate_trainer

    trainer_dir = str(Path(accelerate_trainer.__file__).parent.parent)  # this checkout's
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([trainer_dir, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={port}", str(script), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=180)
    out = done.stdout + done.stderr
    assert "never stopped" not in out, out[-3000:]
    # Both ranks ran exactly the steps up to the signal, no further, and left with code 83.
    assert sorted(re.findall(r"rank=(\d) step=(\d+)", done.stdout)) == [
        (r, str(s)) for r in "01" for s in (1, 2, 3)], out[-3000:]
    assert "STOPPED checkpoint=" in done.stdout
    assert re.search(r"exitcode\s*:\s*83", out), out[-3000:]
    checkpoint = tmp_path / "checkpoints" / "checkpoint_0"
    assert (checkpoint / COMPLETE_MARKER).is_file()
    assert find_resume_checkpoint(tmp_path) == checkpoint
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_0"]


def test_no_stop_request_means_no_checkpoint(tmp_path):
    from accelerate_trainer.checkpoints import checkpoint_on_stop, stop_requested

    accelerator = FakeAccelerator(tmp_path)
    accelerator.num_processes = 1
    assert stop_requested(accelerator) is False
    assert checkpoint_on_stop(accelerator) is None
    assert accelerator.calls == []
