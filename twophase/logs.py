"""Structured logs: one JSON object per line on stderr, for log shippers.

The daemon uses them always (``twophase serve``); a Spark driver opts in with
``TransactionalSink(..., json_logs=True)`` (or by calling :func:`setup_logging`): each
batch then logs one object whose ``twophase_batch`` field is the batch's report.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, Final

__all__ = ["JsonFormatter", "setup_logging"]


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any ``extra`` fields."""

    _STD: Final = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in self._STD:
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "info") -> None:
    """Send the ``twophase`` loggers (only) to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("twophase")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
