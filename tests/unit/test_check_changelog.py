"""hack/check-changelog.py: the form Keep a Changelog asks for, and the release workflow's check
that a tagged version has its dated section (whose text becomes the release's notes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_changelog",
                                               ROOT / "hack" / "check-changelog.py")
check_changelog = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_changelog)

RELEASED = """# Changelog

## [Unreleased]

### Added

- next thing

## [0.2.0] - 2026-12-01

### Fixed

- a bug

## [0.1.0] - 2026-11-30

### Added

- the first
"""


@pytest.fixture
def changelog(tmp_path, monkeypatch):
    def write(text: str) -> Path:
        path = tmp_path / "CHANGELOG.md"
        path.write_text(text)
        monkeypatch.setattr(check_changelog, "CHANGELOG", path)
        return path
    return write


def test_the_repositorys_changelog_has_the_form():
    assert check_changelog.main([]) == 0


def test_a_tag_with_its_section_passes_and_prints_it_as_the_notes(changelog, capsys):
    changelog(RELEASED)
    assert check_changelog.main(["--tag", "v0.2.0", "--notes"]) == 0
    assert capsys.readouterr().out == "### Fixed\n\n- a bug\n"


def test_a_tag_without_a_section_fails_saying_how_to_add_it(changelog, capsys):
    changelog(RELEASED)
    assert check_changelog.main(["--tag", "v0.3.0"]) == 1
    err = capsys.readouterr().err
    assert "no section for 0.3.0 (tag v0.3.0): rename `## [Unreleased]` to `## [0.3.0] - " in err


@pytest.mark.parametrize(("broken", "says"), [
    (RELEASED.replace("## [0.1.0] - 2026-11-30", "## 0.1.0"),
     ":15: `## 0.1.0`: a section is `## [Unreleased]` or `## [X.Y.Z] - YYYY-MM-DD`"),
    (RELEASED.replace("### Fixed", "### Bugfixes"), ":11: `### Bugfixes`: a change kind is one of"),
    (RELEASED.replace("2026-11-30", "2026-13-40"), "2026-13-40 is no date"),
    (RELEASED.replace("[0.1.0]", "[0.3.0]"), "newest first, so 0.3.0 goes above 0.2.0"),
    (RELEASED.replace("[0.1.0]", "[0.2.0]"), "0.2.0 has a section already"),
    (RELEASED.replace("# Changelog", "# Changes"), ":1: start with `# Changelog`"),
    (RELEASED.replace("### Added\n\n- the first", "### Changed\n\n- the first"),
     ":17: `### Changed` in the oldest section: no earlier version was released to change"),
    ("# Changelog\n\n## [Unreleased]\n\n### Fixed\n\n- before any release\n",
     ":5: `### Fixed` in the oldest section"),
])
def test_a_changelog_out_of_form_fails_naming_the_line(changelog, capsys, broken, says):
    changelog(broken)
    assert check_changelog.main([]) == 1
    assert says in capsys.readouterr().err
