"""Which optional extra brings which module: the light install (no extras) says what to
install in one line instead of a traceback.

The core install serves the coordinator on SQLite and runs the operator commands; the
targets' drivers, Spark and pyarrow come with the extras (pyproject.toml's
``[project.optional-dependencies]``).
"""

from __future__ import annotations

from typing import Final

__all__ = ["EXTRA_OF", "missing_extra"]

EXTRA_OF: Final = {
    "psycopg": "postgres", "psycopg_binary": "postgres",
    "pyspark": "spark", "pandas": "spark", "pyarrow": "spark", "numpy": "spark",
    "confluent_kafka": "kafka", "kafka": "kafka",
    "boto3": "s3", "botocore": "s3",
    "pyiceberg": "iceberg", "deltalake": "delta", "pymysql": "sql",
}
"""Top-level module -> the extra that installs it (pyarrow and numpy come with every
participant's extra; ``spark`` is the one a job needs anyway)."""


def missing_extra(exc: BaseException) -> str | None:
    """For an import of an optional module that failed: one line naming the module and
    the extra to install; None for anything else (a real bug keeps its traceback)."""
    if not isinstance(exc, ImportError) or not exc.name:
        return None
    top = exc.name.split(".", 1)[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return None
    return (f"this needs the Python module {top!r}, which the core install leaves out: "
            f"pip install 'twophase[{extra}]' (every extra at once: 'twophase[all]')")
