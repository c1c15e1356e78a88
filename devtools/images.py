"""The images the local cluster's nodes hold: built by hack/build-images.sh under the names the
chart and the examples use, and loaded into every node by hack/load-images.sh (never pulled).
On another cluster (kind, a real one) ACCELERATE_OPERATOR_TRAINER_IMAGE names the CPU trainer
image every test uses."""

from __future__ import annotations

import os
import re
from pathlib import Path

_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
VERSION = re.search(r'^version = "([^"]+)"', _PYPROJECT.read_text(), re.M).group(1)
REGISTRY = "ghcr.io/accelerate-operator"
OPERATOR_IMAGE = f"{REGISTRY}/operator:{VERSION}"
TRAINER_CPU_IMAGE = os.environ.get("ACCELERATE_OPERATOR_TRAINER_IMAGE") or \
    f"{REGISTRY}/trainer:{VERSION}-cpu"
# A small image with python3 and the kubernetes client, for pods that test the cluster itself.
PYTHON_IMAGE = OPERATOR_IMAGE
