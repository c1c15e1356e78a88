"""DeepSpeed ZeRO checkpoints at another data-parallel size (an elastic job that shrank or grew).

DeepSpeed 0.19 loads a ZeRO checkpoint (stage 1, 2 or 3) only at the data-parallel size that
wrote it ("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is
not currently supported"); its universal checkpoint loads at any size. So before a group resumes
at another size, pod 0 converts the checkpoint's ZeRO folder in place with DeepSpeed's own
converter (`deepspeed.checkpoint.ds_to_universal`), and every pod launches with a copy of the
DeepSpeed JSON that says `checkpoint.load_universal`. Checked on CPU with ZeRO 1, 2 and 3, from
2 processes to 1 and from 1 to 2: the losses after the resume equal the run that kept its size
(docs/elastic.md).

Every pod decides the same from the files alone (`needs_universal`), whether or not pod 0 has
converted yet: the original ZeRO files say the size that wrote them. Pod 0 converts before it
launches, and no rank loads before the group has met, which needs pod 0's launch. The original
files are kept beside the converted ones (`ORIGINAL`), so an interrupted conversion is redone
from them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

# accelerate's MODEL_NAME: the tag `load_state()` passes to DeepSpeed's load_checkpoint, the folder
# of the ZeRO files inside a checkpoint written by `save_state()`.
MODEL_TAG = "pytorch_model"
ORIGINAL = f"{MODEL_TAG}.zero"
PARTIAL = f"{MODEL_TAG}.universal-partial"
UNIVERSAL_MARK = "zero"  # the folder of per-parameter states a universal checkpoint has
_OPTIMIZER_SHARD = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
CONVERTER = "deepspeed.checkpoint.ds_to_universal"


@dataclass(frozen=True)
class ZeroFiles:
    """What a checkpoint folder holds of DeepSpeed's: whether its model folder is universal, and
    how many data-parallel ranks wrote the original ZeRO files (None: no ZeRO shards)."""

    universal: bool
    saved_dp_size: int | None


def read_zero_files(checkpoint: str | Path) -> ZeroFiles:
    folder = Path(checkpoint)
    original = folder / ORIGINAL if (folder / ORIGINAL).is_dir() else folder / MODEL_TAG
    ranks = {int(m.group(1)) for m in map(_OPTIMIZER_SHARD.match, _names(original)) if m}
    return ZeroFiles(universal=(folder / MODEL_TAG / UNIVERSAL_MARK).is_dir(),
                     saved_dp_size=len(ranks) or None)


def _names(folder: Path) -> list[str]:
    return [child.name for child in folder.iterdir()] if folder.is_dir() else []


def needs_universal(files: ZeroFiles, dp_size: int) -> bool:
    """Whether the ranks must load the universal form: it is there already, or the ZeRO shards
    were written by another number of ranks."""
    return files.universal or files.saved_dp_size not in (None, dp_size)


def convert_to_universal(checkpoint: str | Path,
                         run: Callable[..., Any] = subprocess.run) -> None:
    """Pod 0, before it launches: convert `<checkpoint>/pytorch_model` into the universal form in
    place, keeping the original as `pytorch_model.zero`. Nothing to do when it already is one.
    Raises subprocess.CalledProcessError when DeepSpeed's converter fails."""
    folder = Path(checkpoint)
    if (folder / MODEL_TAG / UNIVERSAL_MARK).is_dir():
        return
    source = folder / ORIGINAL if (folder / ORIGINAL).is_dir() else folder / MODEL_TAG
    shutil.rmtree(folder / PARTIAL, ignore_errors=True)
    # accelerate's checkpoints lack the universal_checkpoint_info Megatron-DeepSpeed writes.
    run([sys.executable, "-m", CONVERTER, "--input_folder", str(source),
         "--output_folder", str(folder / PARTIAL), "--inject_missing_state"], check=True)
    if source.name == MODEL_TAG:
        source.rename(folder / ORIGINAL)
    else:
        shutil.rmtree(folder / MODEL_TAG, ignore_errors=True)
    (folder / PARTIAL).rename(folder / MODEL_TAG)


def universal_config(ds_json: Mapping[str, Any]) -> dict[str, Any]:
    """The DeepSpeed JSON with `checkpoint.load_universal`, the rest as the user wrote it."""
    checkpoint = dict(ds_json.get("checkpoint") or {})
    checkpoint["load_universal"] = True
    return {**ds_json, "checkpoint": checkpoint}


def write_universal_config(ds_json: Mapping[str, Any], directory: str | Path) -> Path:
    """Write `universal_config(ds_json)` into `directory` (the checkpoint volume: writable on
    every pod of an elastic job), atomically; returns its path."""
    path = Path(directory) / ".accelerate-trainer" / "deepspeed-universal.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(universal_config(ds_json), indent=2))
    partial.replace(path)
    return path


def prepare_universal_resume(checkpoint: str | Path, *, dp_size: int, node_rank: int,
                             ds_json: Mapping[str, Any] | None, workdir: str | Path,
                             convert: Callable[[str | Path], None] = convert_to_universal,
                             ) -> Path | None:
    """Before a DeepSpeed launch that resumes from `checkpoint` with `dp_size` ranks: None when
    the checkpoint loads as saved; otherwise pod 0 (`node_rank` 0) converts it, and every pod
    gets the path of the JSON to launch with (written under `workdir`). Raises ConfigError when
    the DeepSpeed config is the YAML's own block (there is no JSON to add load_universal to)."""
    files = read_zero_files(checkpoint)
    if not needs_universal(files, dp_size):
        return None
    if ds_json is None:
        raise ConfigError(
            f"{checkpoint} was written by {files.saved_dp_size} data-parallel ranks and this group "
            f"has {dp_size}: DeepSpeed loads it only as a universal checkpoint, which needs "
            "checkpoint.load_universal in a DeepSpeed JSON; configure DeepSpeed with "
            "deepspeed_config.deepspeed_config_file instead of the YAML's own keys")
    if node_rank == 0:
        convert(checkpoint)
    return write_universal_config(ds_json, workdir)
