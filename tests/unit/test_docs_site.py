"""`make docs` is the site's strict build (`make lint` runs it on the tree as committed, once per
run): it fails on a link to an anchor that does not exist. Run with the Makefile's own recipe, on
a copy of the docs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def make_docs(tree: Path) -> subprocess.CompletedProcess:
    """`make docs` in a copy of what the site is built from, with this interpreter as the venv's."""
    python = Path(sys.executable)
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(tree), "docs",
         f"VENV={python.parent.parent}", f"PY={python}"],
        capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture
def docs_copy(tmp_path: Path) -> Path:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "mkdocs.yml"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


def test_a_link_to_a_missing_anchor_fails_the_build(docs_copy):
    faults = docs_copy / "docs" / "faults.md"
    faults.write_text(faults.read_text() + "\nSee [the metrics](operating.md#no-such-heading).\n")

    result = make_docs(docs_copy)

    assert result.returncode != 0
    assert "no-such-heading" in result.stdout + result.stderr, result.stdout + result.stderr
