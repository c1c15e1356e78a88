"""An elastic job's shrink, for real: `accelerate-trainer` launches examples/train.py with
`accelerate launch` on CPU (gloo), once at world size 2 with gradient accumulation 2, then from
that run's checkpoint at world size 1 with the accumulation the operator gives a group of half
the size (4, in ACCELERATE_GRADIENT_ACCUMULATION_STEPS). Every optimizer step after the resume
sees the same samples, so its loss and the final weights equal those of the run that stayed at
full size.

This is what breaks without the script's world-size-free position in the epoch
(examples/train.py) and without resetting accelerate's micro-batch counter on resume
(accelerate_trainer.checkpoints); both were broken once on purpose and this test failed."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.helpers.training import (
    free_port,
    machine_env,
    parse_training_log,
    run_machines,
    write_cpu_accelerate_config,
)

# A checkpoint after step 3: accelerate's restored micro-batch counter (3 x 2 = 6) is then not a
# multiple of the new accumulation (4).
ARGS = ["--max-steps", "5", "--checkpoint-every", "3", "--log-every", "1",
        "--num-samples", "256", "--gradient-accumulation-steps", "2"]


def train(tmp_path: Path, name: str, processes: int, accumulation: int):
    """One machine of `processes` processes, told `accumulation`, checkpointing under
    tmp_path/name; returns its parsed log."""
    port = free_port()
    config = write_cpu_accelerate_config(tmp_path / f"{name}.yaml", num_machines=1,
                                         num_processes=processes, main_process_port=port)
    env = machine_env(node_rank=0, num_nodes=1, nproc_per_node=processes, master_port=port,
                      config_file=config,
                      extra={"ACCELERATE_CHECKPOINT_DIR": str(tmp_path / name),
                             "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": str(accumulation)})
    (run,) = run_machines([env], ARGS, log_dir=tmp_path / f"{name}-logs", timeout=240)
    assert run.returncode == 0, run.tail()
    return run.output, parse_training_log(run.output)


def test_a_run_shrunk_to_half_the_processes_with_twice_the_accumulation_trains_the_same(
        tmp_path):
    _, full = train(tmp_path, "full", processes=2, accumulation=2)
    assert {info.world_size for info in full.rank_infos} == {2}
    # The group is lost after the checkpoint of step 3; the smaller group resumes from it.
    shutil.copytree(tmp_path / "full" / "checkpoints" / "checkpoint_0",
                    tmp_path / "shrunk" / "checkpoints" / "checkpoint_0")
    output, shrunk = train(tmp_path, "shrunk", processes=1, accumulation=4)
    assert {info.world_size for info in shrunk.rank_infos} == {1}
    assert [resumed.step for resumed in shrunk.resumed] == [3]
    assert "NOTE gradient_accumulation_steps=4" in output

    expected = {step.step: step.loss for step in full.steps}
    assert [step.step for step in shrunk.steps] == [4, 5]
    for step in shrunk.steps:
        assert abs(step.loss - expected[step.step]) <= 2e-6, (step, expected[step.step])
    # The weights too: every optimizer step after the resume made the same update.
    (full_final,) = [final for final in full.finals if final.rank == 0]
    (shrunk_final,) = shrunk.finals
    assert abs(float(full_final.param_checksum) - float(shrunk_final.param_checksum)) <= 1e-5
