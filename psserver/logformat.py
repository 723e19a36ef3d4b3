"""Daemon log output: readable text lines, or one JSON object per line for log collectors."""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is kept.
_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON: time (UTC, ISO 8601), level, logger, message.

    A traceback goes into ``exception`` (so a multi-line traceback stays one line), and fields
    passed with ``extra=`` are kept, so collectors (Loki, Fluent Bit, Cloud Logging) can index
    them without parsing the message.
    """

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in entry:
                entry[key] = value
        # default=str: an extra field that JSON cannot hold must not lose the whole line.
        return json.dumps(entry, default=str)


def configure_logging(level: str, fmt: str = "text", stream: TextIO | None = None) -> None:
    """Sends the root logger's records at ``level`` and above to ``stream`` (stderr) as
    ``fmt`` (``text`` or ``json``), replacing any handlers it had.

    Raises:
        ValueError: an unknown ``fmt``.
    """
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
