"""The durations list of a `make test` run: every test of the JUnit files in a folder, slowest
first, after each layer's total, so two runs' lists can be compared line by line.

    python hack/test_durations.py test-reports > test-reports/durations.txt
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def read_cases(folder: Path) -> list[tuple[float, str, str]]:
    """(seconds, layer, test id) for every test case of every <layer>.xml in `folder`."""
    cases = []
    for path in sorted(folder.glob("*.xml")):
        for case in ET.parse(path).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            cases.append((float(case.get("time") or 0.0), path.stem, name))
    return cases


def render(cases: list[tuple[float, str, str]]) -> str:
    totals: dict[str, float] = {}
    for seconds, layer, _ in cases:
        totals[layer] = totals.get(layer, 0.0) + seconds
    lines = [f"{seconds:9.1f}s  {layer:<12} total ({sum(1 for c in cases if c[1] == layer)} "
             "tests)" for layer, seconds in totals.items()]
    lines.append(f"{sum(totals.values()):9.1f}s  {'all':<12} total ({len(cases)} tests)")
    lines += [f"{seconds:9.1f}s  {layer:<12} {name}"
              for seconds, layer, name in sorted(cases, reverse=True)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render(read_cases(Path(sys.argv[1]))))
