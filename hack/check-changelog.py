#!/usr/bin/env python3
"""Check CHANGELOG.md against Keep a Changelog's form, and that a release has its section.

    python hack/check-changelog.py                     # the form (`make verify`)
    python hack/check-changelog.py --tag v0.2.0        # also: a dated section for 0.2.0 (release)
    python hack/check-changelog.py --tag v0.2.0 --notes  # print that section: the release notes

Every `## ` heading is `[Unreleased]` or `[X.Y.Z] - YYYY-MM-DD`, no version twice, newest first;
every `### ` heading one of Keep a Changelog's kinds, and the oldest section (the first release,
or `[Unreleased]` before there is one) only `### Added`: nothing came before it to change, fix or
remove. Exits 1 naming the line and the fix."""

from __future__ import annotations

import argparse
import re
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHANGELOG = ROOT / "CHANGELOG.md"
KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?)\] - (\d{4}-\d{2}-\d{2})$")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("-")[0].split("."))


def _heading_error(line: str, seen: list[str]) -> str | None:
    """What is wrong with one `##`/`###` heading, given the versions above it; None if fine."""
    if line.startswith("### "):
        kind = line[4:].strip()
        return None if kind in KINDS else f"`{line}`: a change kind is one of {', '.join(KINDS)}"
    if line == "## [Unreleased]":
        return None if not seen else "`## [Unreleased]` goes above every release"
    match = RELEASE.match(line)
    if not match:
        return (f"`{line}`: a section is `## [Unreleased]` or `## [X.Y.Z] - YYYY-MM-DD`")
    version, day = match.groups()
    try:
        date.fromisoformat(day)
    except ValueError:
        return f"`{line}`: {day} is no date (YYYY-MM-DD)"
    if version in seen:
        return f"`{line}`: {version} has a section already"
    if seen and _version_key(version) > _version_key(seen[-1]):
        return f"`{line}`: newest first, so {version} goes above {seen[-1]}"
    return None


def _first_section_errors(kinds: list[tuple[int, str]]) -> list[str]:
    """The oldest section's kinds (line, kind) other than Added: they would describe changes to
    a version that was never released."""
    return [f"CHANGELOG.md:{number}: `### {kind}` in the oldest section: no earlier version "
            "was released to change; say what this one has under `### Added`"
            for number, kind in kinds if kind != "Added"]


def check(text: str) -> tuple[list[str], dict[str, str]]:
    """(the errors, each `path:line: ...`; each release's version -> its section's text)."""
    errors, seen, sections = [], [], {}
    current: str | None = None
    kinds: list[tuple[int, str]] = []  # the (line, kind) headings of the section being read
    if not text.startswith("# Changelog"):
        errors.append("CHANGELOG.md:1: start with `# Changelog`")
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("### "):
            kinds.append((number, line[4:].strip()))
        if line.startswith("## "):
            current, kinds = None, []
            match = RELEASE.match(line)
            if match:
                current = match.group(1)
                sections[current] = ""
        if line.startswith(("## ", "### ")):
            error = _heading_error(line.rstrip(), seen)
            if error:
                errors.append(f"CHANGELOG.md:{number}: {error}")
            if line.startswith("## ") and current and current not in seen:
                seen.append(current)
        if current is not None and not line.startswith("## "):
            sections[current] += line + "\n"
    errors += _first_section_errors(kinds)
    return errors, {version: body.strip() + "\n" for version, body in sections.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", help="a release tag vX.Y.Z that must have a dated section")
    parser.add_argument("--notes", action="store_true", help="print the tag's section")
    args = parser.parse_args(argv)
    if not CHANGELOG.is_file():
        sys.stderr.write("check-changelog: no CHANGELOG.md at the repository's root\n")
        return 1
    errors, sections = check(CHANGELOG.read_text())
    version = (args.tag or "").removeprefix("v")
    if args.tag and version not in sections:
        errors.append(f"CHANGELOG.md: no section for {version} (tag {args.tag}): rename "
                      f"`## [Unreleased]` to `## [{version}] - {date.today().isoformat()}` "
                      "and open a new `## [Unreleased]` above it")
    if errors:
        sys.stderr.write("".join(f"check-changelog: {error}\n" for error in errors))
        return 1
    if args.notes and version:
        sys.stdout.write(sections[version])
    return 0


if __name__ == "__main__":
    sys.exit(main())
