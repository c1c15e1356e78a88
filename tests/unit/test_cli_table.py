"""`accelerate-job get`'s table is the one `kubectl get ajob` prints: the CRD's printer columns
(accelerate_job/printer_columns.py, generated from crds/), each cell printed as kubectl prints
its column's type."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from accelerate_job import table

CRD = Path(__file__).resolve().parents[2] / "crds" / "accelerate-operator.io_acceleratejobs.yaml"
NOW = datetime(2026, 1, 2, 0, 0, 0, tzinfo=timezone.utc)


def crd_columns() -> list[dict]:
    crd = yaml.safe_load(CRD.read_text())
    return next(v for v in crd["spec"]["versions"] if v["storage"])["additionalPrinterColumns"]


def test_the_columns_are_the_crds_printer_columns_wide_adding_those_of_priority_above_0():
    every = crd_columns()
    assert table.header(wide=True) == ["NAME", *(c["name"].upper() for c in every)]
    assert table.header() == ["NAME", *(c["name"].upper() for c in every
                                        if not c.get("priority"))]
    assert table.header(namespaces=True)[:2] == ["NAMESPACE", "NAME"]


def test_each_cell_is_printed_as_kubectl_prints_its_type():
    job = {"metadata": {"name": "llm", "namespace": "ml",
                        "creationTimestamp": "2026-01-01T23:58:55Z"},
           "status": {"phase": "Running", "restarts": 2, "restartsCounted": 0,
                      "topology": {"summary": "2x2", "masterPort": 29500}}}
    row = dict(zip(table.header(wide=True), table.row(job, NOW, wide=True), strict=True))
    assert (row["NAME"], row["PHASE"], row["RESTARTS"], row["COUNTED"], row["PORT"]) == (
        "llm", "Running", "2", "0", "29500")
    assert row["AGE"] == "65s"
    assert row["QUEUE"] == row["PROGRESS"] == row["ACCELERATE"] == ""  # absent: blank


@pytest.mark.parametrize(("elapsed", "shown"), [
    (timedelta(seconds=0), "0s"), (timedelta(seconds=119), "119s"), (timedelta(minutes=2), "2m"),
    (timedelta(minutes=2, seconds=5), "2m5s"), (timedelta(minutes=10, seconds=5), "10m"),
    (timedelta(hours=3), "3h"), (timedelta(hours=3, minutes=30), "3h30m"),
    (timedelta(hours=8, minutes=30), "8h"), (timedelta(hours=47), "47h"),
    (timedelta(days=2), "2d"), (timedelta(days=2, hours=3), "2d3h"),
    (timedelta(days=8, hours=3), "8d"), (timedelta(days=730), "2y"),
    (timedelta(days=731), "2y1d"), (timedelta(days=365 * 9), "9y"),
    (timedelta(seconds=-1), "0s"), (timedelta(seconds=-5), "<invalid>"),
])
def test_the_age_is_kubectls_human_duration(elapsed, shown):
    assert table.human_duration(elapsed.total_seconds()) == shown
