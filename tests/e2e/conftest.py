"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.training import IMAGE_TRAIN_SCRIPT as SCRIPT
from tests.helpers.training import TRAIN_SCRIPT


@pytest.fixture
def example_script() -> Path:
    """The image's layout on the host: the local node runs the host's environment."""
    if not SCRIPT.exists():
        SCRIPT.parent.mkdir(parents=True, exist_ok=True)
        SCRIPT.symlink_to(TRAIN_SCRIPT)
    return SCRIPT
