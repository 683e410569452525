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
    """Either format, as an aware datetime."""
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
