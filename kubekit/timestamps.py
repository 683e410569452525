"""The API's two time formats: RFC 3339 in seconds (conditions, events) and in
microseconds (Lease renewTime, MicroTime); written now, and read."""

from __future__ import annotations

import datetime


def rfc3339(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_rfc3339() -> str:
    return rfc3339(datetime.datetime.now(datetime.UTC))


def now_micro() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> datetime.datetime:
    """Either format, as an aware datetime; ValueError for what is not such text, or has
    no zone (the API always writes one; a hand-edited record may not, and compared with
    an aware moment it would fail as a TypeError), or has no UTC form (the last day of
    year 9999 west of Greenwich: written back, it failed as an OverflowError)."""
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a time")
    moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    try:
        moment.astimezone(datetime.UTC)
    except OverflowError:
        raise ValueError(f"{text!r} is past the last moment there is") from None
    return moment
