"""twophase: two-phase-commit transactional sinks for PySpark Structured Streaming.

``from twophase import TransactionalSink`` is resolved lazily so that importing the core
(the protocol, the participant interface) never imports pyspark.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.3.0"  # the one version: pyproject.toml reads it ([tool.setuptools.dynamic])
__all__ = ["TransactionalSink", "__version__", "register"]

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from twophase.doors.foreachbatch import TransactionalSink


def register(spark: SparkSession, sink: TransactionalSink | None = None) -> None:
    """Register ``df.writeStream.format("twophase")`` with ``spark``, and ``sink`` for
    ``.option("sink", sink.name)`` (:func:`twophase.doors.datasource.register`)."""
    from twophase.doors.datasource import register as _register

    _register(spark, sink)


def __getattr__(name: str) -> Any:
    if name == "TransactionalSink":
        from twophase.doors.foreachbatch import TransactionalSink

        return TransactionalSink
    raise AttributeError(f"module 'twophase' has no attribute {name!r}")
