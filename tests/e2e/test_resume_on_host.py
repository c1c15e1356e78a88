"""Real training on this host, no cluster: `accelerate-trainer` runs the real `accelerate launch`
of examples/train.py over gloo (one machine x two processes, MASTER_ADDR=127.0.0.1). A crashed
run, restarted with the same command as a restarted pod would be, resumes from its newest
COMPLETE checkpoint past a half-written one, and ends with the weights of an uninterrupted run.

(That the trainer's argv and env give one job of world size nodes x processes, with one shared
model, is checked on the cluster's two real nodes: test_getting_started.py.)
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.training import (  # noqa: E402
    free_port,
    machine_env,
    parse_training_log,
    run_machines,
    write_cpu_accelerate_config,
)

pytestmark = [pytest.mark.training, pytest.mark.timeout(600)]

MAX_STEPS_RESUME = 20
CHECKPOINT_EVERY = 4
FAIL_AT_STEP = 10  # after the complete checkpoints of steps 4 and 8, mid-epoch
RUN_TIMEOUT = 300


def _job(tmp_path: Path, *, num_nodes: int, nproc_per_node: int, extra=None):
    port = free_port()
    config = write_cpu_accelerate_config(
        tmp_path / "accelerate.yaml",
        num_machines=num_nodes,
        num_processes=num_nodes * nproc_per_node,
        main_process_port=port,
    )
    return [
        machine_env(
            node_rank=node_rank,
            num_nodes=num_nodes,
            nproc_per_node=nproc_per_node,
            master_port=port,
            config_file=config,
            extra=extra,
        )
        for node_rank in range(num_nodes)
    ]


def _assert_succeeded(runs) -> None:
    for run in runs:
        assert run.returncode == 0, run.tail()


# ---- crash and resume (one machine x two processes) -----------------------------------------

RESUME_ARGS = [
    "--max-steps", str(MAX_STEPS_RESUME),
    "--checkpoint-every", str(CHECKPOINT_EVERY),
    "--log-every", "5",
]


@pytest.fixture(scope="module")
def crashed_then_resumed(tmp_path_factory):
    """Run 1 crashes (rank 1 exits 1 at step 10); a half-written checkpoint is left behind as a
    crash during a save would; run 2, the same command (a restarted pod), must resume."""
    tmp_path = tmp_path_factory.mktemp("resume")
    checkpoint_dir = tmp_path / "job"
    marker = tmp_path / "failed-once"
    envs = _job(
        tmp_path,
        num_nodes=1,
        nproc_per_node=2,
        extra={
            "ACCELERATE_CHECKPOINT_DIR": str(checkpoint_dir),
            "ACCELERATE_FAIL_ONCE_MARKER": str(marker),
        },
    )
    args = [*RESUME_ARGS, "--fail-at-step", str(FAIL_AT_STEP), "--fail-rank", "1"]
    (crashed,) = run_machines(envs, args, log_dir=tmp_path / "run1", timeout=RUN_TIMEOUT)
    checkpoints = checkpoint_dir / "checkpoints"
    after_crash = sorted(p.name for p in checkpoints.iterdir())
    # A save that died half way: files of a newer step, but no COMPLETE marker.
    half_written = checkpoints / "checkpoint_2"
    shutil.copytree(checkpoints / "checkpoint_1", half_written)
    (half_written / "COMPLETE").unlink()
    (half_written / "model.safetensors").write_bytes(b"truncated")
    (resumed,) = run_machines(envs, args, log_dir=tmp_path / "run2", timeout=RUN_TIMEOUT)
    return {
        "crashed": crashed,
        "resumed": resumed,
        "marker": marker,
        "after_crash": after_crash,
        "checkpoints": checkpoints,
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    envs = _job(
        tmp_path, num_nodes=1, nproc_per_node=2,
        extra={"ACCELERATE_CHECKPOINT_DIR": str(tmp_path / "job")},
    )
    (run,) = run_machines(envs, RESUME_ARGS, log_dir=tmp_path / "logs", timeout=RUN_TIMEOUT)
    _assert_succeeded([run])
    return run


def test_injected_failure_crashes_the_run_once(crashed_then_resumed):
    crashed = crashed_then_resumed["crashed"]
    assert crashed.returncode not in (0, None), crashed.tail()
    assert "FAILING on purpose rank=1 step=10" in crashed.output
    assert crashed_then_resumed["marker"].is_file()
    assert parse_training_log(crashed.output).done == ()
    # Steps 4 and 8 were saved and marked complete before the crash at step 10.
    assert crashed_then_resumed["after_crash"] == ["checkpoint_0", "checkpoint_1"]


def test_restarted_run_resumes_from_latest_complete_checkpoint(crashed_then_resumed):
    resumed = crashed_then_resumed["resumed"]
    _assert_succeeded([resumed])
    log = parse_training_log(resumed.output)
    (resume,) = log.resumed
    assert Path(resume.path).name == "checkpoint_1"  # not the half-written checkpoint_2
    assert resume.step == 8
    assert [s.step for s in log.steps] == [10, 15, 20]


def test_restarted_run_finishes_exactly_max_steps(crashed_then_resumed):
    resumed = crashed_then_resumed["resumed"]
    _assert_succeeded([resumed])
    log = parse_training_log(resumed.output)
    assert [f.steps for f in log.finals] == [MAX_STEPS_RESUME] * 2
    (done,) = log.done
    assert done.steps == MAX_STEPS_RESUME
    assert len({f.param_checksum for f in log.finals}) == 1


def test_restarted_run_saves_past_the_half_written_checkpoint(crashed_then_resumed):
    _assert_succeeded([crashed_then_resumed["resumed"]])
    names = sorted(p.name for p in crashed_then_resumed["checkpoints"].iterdir())
    # Saves at steps 12, 16, 20 went to 3, 4, 5 (total_limit=3 rotated the older ones out).
    assert names == ["checkpoint_3", "checkpoint_4", "checkpoint_5"]
    for name in names:
        assert (crashed_then_resumed["checkpoints"] / name / "COMPLETE").is_file()


def test_resumed_run_ends_with_the_weights_of_an_uninterrupted_run(
    crashed_then_resumed, uninterrupted
):
    """Model, optimizer, scheduler, RNG and data position all come back: resuming mid-epoch with
    skip_first_batches replays exactly the batches the crashed run had not trained on."""
    _assert_succeeded([crashed_then_resumed["resumed"]])
    resumed = parse_training_log(crashed_then_resumed["resumed"].output)
    baseline = parse_training_log(uninterrupted.output)
    assert {f.param_checksum for f in resumed.finals} == {f.param_checksum for f in baseline.finals}
    assert resumed.steps == tuple(s for s in baseline.steps if s.step >= FAIL_AT_STEP)
