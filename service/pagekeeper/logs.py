"""The service's log records on stderr: readable lines, or one JSON object per line.

``server.log_format = "json"`` is for log collectors (Loki, Elasticsearch, Cloud Logging):
every record is one line holding ``ts`` (UTC, ISO 8601 with milliseconds), ``level``,
``logger``, ``message`` and, for a record with an exception, ``exc`` (its traceback).
uvicorn's records go through the same handler.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str, stream: TextIO | None = None) -> None:
    """Send every record at ``level`` or above to ``stream`` (stderr) in ``log_format``
    (``text`` or ``json``), replacing the root logger's handlers."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


__all__ = ["JsonFormatter", "configure_logging"]
