"""The daemon's JSON log lines: one object per line, tracebacks and extra fields inside it."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from psserver.logformat import configure_logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_hold_message_level_traceback_and_extras(restore_root: None) -> None:
    stream = io.StringIO()
    configure_logging("INFO", "json", stream)
    log = logging.getLogger("psserver.test")
    log.debug("hidden")
    log.info("shard %s up", "ps0", extra={"port": 7000})
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        log.exception("failed")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2  # the multi-line traceback stays inside one line
    first, second = (json.loads(line) for line in lines)
    assert first["message"] == "shard ps0 up" and first["level"] == "INFO"
    assert first["logger"] == "psserver.test" and first["port"] == 7000
    assert first["time"].endswith("+00:00")
    assert second["level"] == "ERROR" and "ValueError: bad\nthing" in second["exception"]


def test_text_format_and_bad_format(restore_root: None) -> None:
    stream = io.StringIO()
    configure_logging("WARNING", "text", stream)
    logging.getLogger("x").warning("careful")
    assert stream.getvalue().rstrip().endswith("WARNING x: careful")
    with pytest.raises(ValueError, match="xml"):
        configure_logging("INFO", "xml")
