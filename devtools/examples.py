"""Read the files in examples/: the AccelerateJob and the accelerate config it would run with."""

from __future__ import annotations

from pathlib import Path

import yaml
from accelerate_trainer.config import parse_accelerate_yaml

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"


def load_example(path: Path) -> tuple[dict, dict[str, dict]]:
    """The AccelerateJob of an example file, and the ConfigMaps beside it by name."""
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    job = next(d for d in documents if d["kind"] == "AccelerateJob")
    configmaps = {d["metadata"]["name"]: d for d in documents if d["kind"] == "ConfigMap"}
    job["metadata"].setdefault("namespace", "default")
    job["metadata"].setdefault("uid", "uid")
    return job, configmaps


def user_config(job_body: dict, configmaps: dict[str, dict]) -> dict:
    """The accelerate config the user wrote: inline, or from the ConfigMap it names."""
    spec = job_body["spec"]
    if "accelerateConfig" in spec:
        return spec["accelerateConfig"]
    ref = spec["accelerateConfigFrom"]["configMapKeyRef"]
    return parse_accelerate_yaml(configmaps[ref["name"]]["data"][ref["key"]])
