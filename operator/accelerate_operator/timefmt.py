"""RFC 3339 times in and out: the one helper for the API server's times, the pods' reports, kopf's
peering records and the CLI. The operator reasons in UTC without tzinfo (`utcnow`); a parsed time
is given so too. Pure, and importable by the CLI package (accelerate_job) as well."""

from __future__ import annotations

import re
from datetime import datetime, timezone

# date T time [.fraction] [Z | +hh:mm]: the fraction may hold nanoseconds (the kubelet's log
# stamps); a time without a zone is UTC, as kopf's peering reads one.
_RFC3339 = re.compile(r"(\d{4}-\d{2}-\d{2})[Tt ](\d{2}:\d{2}:\d{2})(?:\.(\d+))?"
                      r"([Zz]|[+-]\d{2}:\d{2})?")


def utcnow() -> datetime:
    """The pass's clock: UTC without tzinfo, to the second, as status times are written."""
    return datetime.now(timezone.utc).replace(tzinfo=None, microsecond=0)


def naive_utc(moment: datetime) -> datetime:
    """UTC without tzinfo, as parse_time and a pass's clock give it."""
    if moment.tzinfo is None:
        return moment
    return (moment - moment.utcoffset()).replace(tzinfo=None)


def parse_time(text: object) -> datetime | None:
    """An RFC 3339 time as UTC without tzinfo; None when absent or not such a time (a pod's
    report is the pod's own writing). A fraction finer than microseconds is cut."""
    match = _RFC3339.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        return None
    day, clock, fraction, zone = match.groups()
    micro = f".{fraction[:6].ljust(6, '0')}" if fraction else ""
    offset = "+00:00" if zone in (None, "Z", "z") else zone
    try:
        return naive_utc(datetime.fromisoformat(f"{day}T{clock}{micro}{offset}"))
    except ValueError:  # a month 13, an hour 25
        return None


def format_time(moment: datetime, *, precise: bool = False) -> str:
    """RFC 3339 in UTC with a Z, to the second (status and event times) or, `precise`, to the
    microsecond (the goodput ledger). A naive `moment` is UTC."""
    moment = naive_utc(moment)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if precise else "%Y-%m-%dT%H:%M:%SZ")
