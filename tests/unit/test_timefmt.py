"""The one RFC 3339 helper: every time the operator and the CLI read or write goes through it."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from accelerate_operator.timefmt import format_time, naive_utc, parse_time, utcnow

MOMENT = datetime(2026, 11, 27, 1, 2, 3)


@pytest.mark.parametrize("text, expected", [
    ("2026-11-27T01:02:03Z", MOMENT),  # the API server's
    ("2026-11-27T03:02:03+02:00", MOMENT),  # an offset is turned into UTC
    ("2026-11-27T01:02:03.250Z", MOMENT.replace(microsecond=250000)),  # the trainer's reports
    ("2026-11-27T01:02:03.123456789Z", MOMENT.replace(microsecond=123456)),  # kubelet log stamps
    ("2026-11-27T01:02:03.5", MOMENT.replace(microsecond=500000)),  # no zone: UTC, as kopf reads
])
def test_rfc3339_times_are_read_as_utc_without_tzinfo(text, expected):
    assert parse_time(text) == expected


@pytest.mark.parametrize("text", [None, "", "yesterday", "2026-11-27", "2026-13-27T01:02:03Z",
                                  "2026-11-27T01:02:03Zjunk", 17])
def test_what_is_not_a_time_is_none(text):
    assert parse_time(text) is None


def test_written_times_read_back_to_the_same_moment():
    precise = MOMENT.replace(microsecond=654321)
    assert format_time(precise) == "2026-11-27T01:02:03Z"
    assert parse_time(format_time(precise, precise=True)) == precise
    # An aware moment is written in UTC: 20:02:03 at -05:00 is 01:02:03Z the next day.
    aware = datetime(2026, 11, 26, 20, 2, 3, 654321, tzinfo=timezone(timedelta(hours=-5)))
    assert naive_utc(aware) == precise
    assert format_time(aware, precise=True) == "2026-11-27T01:02:03.654321Z"


def test_the_pass_clock_is_naive_utc_to_the_second():
    now = utcnow()
    assert now.tzinfo is None and now.microsecond == 0
    assert abs((datetime.now(timezone.utc).replace(tzinfo=None) - now).total_seconds()) < 5
