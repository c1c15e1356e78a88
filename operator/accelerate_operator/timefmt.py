"""RFC 3339 times in and out, the one helper for them: the API server's and the operator's own
times end in Z; the operator reasons in UTC without tzinfo."""

from __future__ import annotations

from datetime import datetime


def format_time(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    """An RFC 3339 time (the API server's and ours end in Z), as UTC without tzinfo."""
    if not text:
        return None
    return naive_utc(datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text))

def naive_utc(moment: datetime) -> datetime:
    """UTC without tzinfo, as parse_time and the planner's clock give it."""
    if moment.tzinfo is None:
        return moment
    return (moment - moment.utcoffset()).replace(tzinfo=None)

