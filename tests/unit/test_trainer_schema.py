"""The trainer's snapshot of what accelerate accepts (schema.py): written at image build, read
at every pod's start instead of importing accelerate and torch; ignored when it was taken from
another accelerate version."""

from __future__ import annotations

import dataclasses
import json

from accelerate_trainer import schema


def test_the_snapshot_round_trips_what_accelerate_itself_says(tmp_path):
    path = tmp_path / "accelerate-schema.json"
    assert schema.main(["--write", str(path)]) == 0
    live = schema.from_accelerate()
    assert schema.AccelerateSchema.from_json(path.read_text()) == live
    assert schema.load(str(path)) == live
    assert {"distributed_type", "mixed_precision", "num_machines"} <= live.config_keys
    assert "MULTI_CPU" in live.distributed_types and "bf16" in live.precisions


def test_a_snapshot_of_another_accelerate_version_is_not_trusted(tmp_path):
    stale = dataclasses.replace(schema.from_accelerate(), version="0.0.1",
                                config_keys=frozenset({"only_this"}))
    path = tmp_path / "accelerate-schema.json"
    path.write_text(stale.to_json())
    assert schema.load(str(path)) == schema.from_accelerate()


def test_a_missing_or_broken_snapshot_falls_back_to_accelerate(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"version": "x"}))
    assert schema.load(str(tmp_path / "absent.json")) == schema.from_accelerate()
    assert schema.load(str(broken)) == schema.from_accelerate()
