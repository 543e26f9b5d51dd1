"""The daemon's logs: one JSON object per line on stderr (defined in :mod:`twophase.logs`,
which the Spark driver uses too)."""

from __future__ import annotations

from twophase.logs import JsonFormatter, setup_logging

__all__ = ["JsonFormatter", "setup_logging"]
