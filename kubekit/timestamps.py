"""The API's two time formats, for now: RFC 3339 in seconds (conditions, events) and in
microseconds (Lease renewTime, MicroTime)."""

from __future__ import annotations

import datetime


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
