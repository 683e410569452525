"""How every component logs: one line per event, as key=value fields (logfmt) for people
and grep, or as JSON objects (`--log-format json`) for log collectors. Fields given with
``extra={...}`` on a call become fields of their own; a traceback stays on its line."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")
# What every LogRecord has: anything else on a record came from ``extra``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def add_arguments(parser: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """--log-level and --log-format; without ``defaults`` they are None when not given (a
    configuration file may set them)."""
    parser.add_argument(
        "--log-level", choices=LEVELS, default="INFO" if defaults else None, help="default INFO"
    )
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text" if defaults else None,
        help="text: key=value fields (default); json: one JSON object per line",
    )


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
            timespec="milliseconds"
        ),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    for key, value in vars(record).items():
        if key not in _STANDARD and not key.startswith("_"):
            fields[key] = value
    if record.exc_info:
        fields["error"] = logging.Formatter().formatException(record.exc_info)
    return fields


def _logfmt_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text and not any(c in text for c in ' ="\n\t\\'):
        return text
    return json.dumps(text)


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in record_fields(record).items())


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(record_fields(record), default=str)


_FORMATTERS: dict[str, Callable[[], logging.Formatter]] = {
    "text": KeyValueFormatter,
    "json": JSONFormatter,
}


def configure(level: str = "INFO", log_format: str = "text") -> None:
    """Every logger of the process writes to stderr in ``log_format`` from ``level`` on."""
    if log_format not in _FORMATTERS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_FORMATTERS[log_format]())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
