"""A DeepSpeed checkpoint written by another number of ranks: every pod decides alike from the
files whether it loads as a universal checkpoint, pod 0 converts it in place keeping the
original, and an interrupted conversion is redone. The converter is DeepSpeed's own; here a
stand-in writes what it writes (a `zero/` folder), so the file handling is what is tested."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate_trainer.config import ConfigError
from accelerate_trainer.deepspeed_universal import (
    ZeroFiles,
    convert_to_universal,
    needs_universal,
    prepare_universal_resume,
    read_zero_files,
    universal_config,
)

DS_JSON = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "zero_optimization": {"stage": 2}}


def zero_checkpoint(root: Path, ranks: int) -> Path:
    """checkpoint_0 as accelerate's save_state writes it under ZeRO with `ranks` ranks."""
    model = root / "checkpoints" / "checkpoint_0" / "pytorch_model"
    model.mkdir(parents=True)
    (model / "mp_rank_00_model_states.pt").write_text("model")
    for rank in range(ranks):
        (model / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_text(f"rank {rank}")
    (model.parent / "random_states_0.pkl").write_text("rng")
    return model.parent


def fake_converter(calls: list[list[str]]):
    """What `python -m deepspeed.checkpoint.ds_to_universal` leaves: the output folder with the
    model states and a zero/ folder of per-parameter states."""
    def run(argv, check):
        assert check
        calls.append(argv)
        output = Path(argv[argv.index("--output_folder") + 1])
        (output / "zero" / "lm_head.weight").mkdir(parents=True)
        (output / "mp_rank_00_model_states.pt").write_text("model")
    return run


@pytest.mark.parametrize(("files", "dp_size", "expected"), [
    (ZeroFiles(universal=False, saved_dp_size=2), 2, False),   # as saved
    (ZeroFiles(universal=False, saved_dp_size=2), 1, True),    # shrunk
    (ZeroFiles(universal=False, saved_dp_size=1), 2, True),    # grown
    (ZeroFiles(universal=True, saved_dp_size=2), 2, True),     # converted already: load it so
    (ZeroFiles(universal=False, saved_dp_size=None), 4, False),  # no ZeRO shards (stage 0)
])
def test_the_universal_form_is_needed_at_another_size_or_once_converted(files, dp_size,
                                                                         expected):
    assert needs_universal(files, dp_size) is expected


def test_pod_0_converts_in_place_and_keeps_the_original(tmp_path):
    checkpoint = zero_checkpoint(tmp_path, ranks=2)
    calls: list[list[str]] = []
    convert_to_universal(checkpoint, run=fake_converter(calls))
    assert calls == [[sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                      "--input_folder", str(checkpoint / "pytorch_model"),
                      "--output_folder", str(checkpoint / "pytorch_model.universal-partial"),
                      "--inject_missing_state"]]
    assert (checkpoint / "pytorch_model" / "zero").is_dir()
    assert (checkpoint / "pytorch_model.zero" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
            ).is_file()
    assert not (checkpoint / "pytorch_model.universal-partial").exists()
    # The size that wrote it is still known, and a second conversion does nothing.
    assert read_zero_files(checkpoint) == ZeroFiles(universal=True, saved_dp_size=2)
    convert_to_universal(checkpoint, run=fake_converter(calls))
    assert len(calls) == 1


def test_an_interrupted_conversion_is_redone_from_the_kept_original(tmp_path):
    checkpoint = zero_checkpoint(tmp_path, ranks=2)
    # Killed between the two renames: the original moved aside, nothing in its place yet.
    (checkpoint / "pytorch_model").rename(checkpoint / "pytorch_model.zero")
    (checkpoint / "pytorch_model.universal-partial").mkdir()
    assert read_zero_files(checkpoint) == ZeroFiles(universal=False, saved_dp_size=2)
    calls: list[list[str]] = []
    convert_to_universal(checkpoint, run=fake_converter(calls))
    assert calls[0][calls[0].index("--input_folder") + 1] == str(checkpoint / "pytorch_model.zero")
    assert (checkpoint / "pytorch_model" / "zero").is_dir()


def test_a_failed_conversion_leaves_the_checkpoint_as_it_was(tmp_path):
    checkpoint = zero_checkpoint(tmp_path, ranks=2)

    def fails(argv, check):
        raise subprocess.CalledProcessError(1, argv)

    with pytest.raises(subprocess.CalledProcessError):
        convert_to_universal(checkpoint, run=fails)
    assert read_zero_files(checkpoint) == ZeroFiles(universal=False, saved_dp_size=2)


def test_every_pod_launches_with_a_json_that_loads_universal_and_only_pod_0_converts(tmp_path):
    checkpoint = zero_checkpoint(tmp_path, ranks=2)
    converted: list[Path] = []
    paths = [prepare_universal_resume(checkpoint, dp_size=1 * 8, node_rank=rank,
                                      ds_json=DS_JSON, workdir=tmp_path,
                                      convert=converted.append)
             for rank in (1, 0)]
    assert converted == [checkpoint]
    assert paths[0] == paths[1] == tmp_path / ".accelerate-trainer" / "deepspeed-universal.json"
    assert json.loads(paths[0].read_text()) == {**DS_JSON, "checkpoint": {"load_universal": True}}


def test_a_checkpoint_of_the_same_size_launches_as_configured(tmp_path):
    checkpoint = zero_checkpoint(tmp_path, ranks=2)
    assert prepare_universal_resume(checkpoint, dp_size=2, node_rank=0, ds_json=DS_JSON,
                                    workdir=tmp_path, convert=pytest.fail) is None


def test_the_yamls_own_deepspeed_block_cannot_load_a_universal_checkpoint(tmp_path):
    checkpoint = zero_checkpoint(tmp_path, ranks=2)
    with pytest.raises(ConfigError, match="written by 2 data-parallel ranks and this group has 1"):
        prepare_universal_resume(checkpoint, dp_size=1, node_rank=0, ds_json=None,
                                 workdir=tmp_path, convert=pytest.fail)


def test_the_users_checkpoint_settings_are_kept():
    assert universal_config({"checkpoint": {"tag_validation": "FAIL"}}) == {
        "checkpoint": {"tag_validation": "FAIL", "load_universal": True}}
