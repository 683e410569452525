import json
import logging
import sys

import pytest

from kubekit import logs
from virtual_node.main import VirtualNodeConfig, parse_args


def record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord("virtual_node", logging.WARNING, __file__, 1, message, args, None)
    made.__dict__.update(extra)
    made.created = 1_764_039_600.25  # 2025-11-25T03:00:00.250Z
    return made


def test_text_is_one_line_of_key_value_fields_quoted_where_needed() -> None:
    line = logs.KeyValueFormatter().format(
        record("lease %s: held by %s", "kubestrata-system/x", "b", pod="web-1", tries=3)
    )
    assert line == (
        "ts=2025-11-25T03:00:00.250+00:00 level=warning logger=virtual_node "
        'msg="lease kubestrata-system/x: held by b" pod=web-1 tries=3'
    )


def test_json_is_one_object_per_line_with_the_same_fields() -> None:
    line = logs.JSONFormatter().format(record("node %s registered", "vk-1", cluster="lower-1"))
    assert "\n" not in line
    assert json.loads(line) == {
        "ts": "2025-11-25T03:00:00.250+00:00",
        "level": "warning",
        "logger": "virtual_node",
        "msg": "node vk-1 registered",
        "cluster": "lower-1",
    }


def test_a_traceback_stays_on_the_line_of_its_event() -> None:
    try:
        raise RuntimeError("lower apiserver gone")
    except RuntimeError:
        failed = logging.LogRecord(
            "x", logging.ERROR, __file__, 1, "sync failed", None, sys.exc_info()
        )
    text = logs.KeyValueFormatter().format(failed)
    assert "\n" not in text
    assert 'error="Traceback' in text and "RuntimeError: lower apiserver gone" in text
    assert json.loads(logs.JSONFormatter().format(failed))["error"].endswith(
        "RuntimeError: lower apiserver gone"
    )


def test_configure_sets_every_logger_and_refuses_unknown_formats(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.configure("INFO", "json")
        logging.getLogger("webhook").info("ready", extra={"port": 8443})
        logging.getLogger("webhook").debug("not shown")
        (line,) = capsys.readouterr().err.splitlines()
        assert json.loads(line)["port"] == 8443
        with pytest.raises(ValueError, match="log format 'xml' is not one of text, json"):
            logs.configure("INFO", "xml")
    finally:
        root.handlers, root.level = saved[0], saved[1]


def test_the_virtual_node_takes_its_log_format_from_flags_or_its_file() -> None:
    base = ["--lower-kubeconfig=l", "--cluster-id=c", "--client-ca-file=ca"]
    assert parse_args(base).log_format == "text"
    assert parse_args([*base, "--log-format=json"]).log_format == "json"
    with pytest.raises(SystemExit):
        parse_args([*base, "--log-format=xml"])
    with pytest.raises(ValueError, match="format 'xml' unknown"):
        VirtualNodeConfig("l", "c", client_ca_file="ca", log_format="xml")
