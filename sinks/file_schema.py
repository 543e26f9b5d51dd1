"""What a folder of committed files already holds, and whether a new batch fits it.

A folder read as one dataset (``spark.read.parquet(path)``) must not pile up files of
incompatible schemas: a reader would fail, or silently drop or null columns. So before
the first write of a schema, :class:`~twophase.sinks.files.StagedFileParticipant` reads
the schemas of the committed files (Parquet footers; for JSON lines, the field names of
each file's first line, JSON carrying no types) and compares:

- a column whose type changed: refused under every policy;
- a column the files have and the batch lacks: refused under every policy (add it back,
  e.g. as a typed null, or write to a new folder);
- a column the batch adds: refused under ``on_schema_change="fail"``, allowed under
  ``"add_columns"`` (readers merge: ``spark.read.option("mergeSchema", "true")``; older
  files read as null).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Final

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["POLICIES", "folder_misfits", "held_schema"]

POLICIES: Final = ("fail", "add_columns")


def held_schema(files: Iterable[Path], fmt: str) -> dict[str, pa.DataType | None]:
    """Column name -> type over every committed file (type None for JSON lines).

    A column with two types across files keeps the first seen; the comparison then
    reports the batch against it."""
    held: dict[str, pa.DataType | None] = {}
    for f in files:
        if fmt == "parquet":
            for field in pq.read_schema(f):
                held.setdefault(field.name, field.type)
        else:
            with open(f, "rb") as fh:
                first = fh.readline().strip()
            if first:
                for name in json.loads(first):
                    held.setdefault(name, None)
    return held


def _same_type(was: pa.DataType, now: pa.DataType) -> bool:
    """Equal types; a timestamp with a zone is an instant whatever zone labels it (Spark's
    own Parquet writer, the native data path, records none and reads back as UTC)."""
    if pa.types.is_timestamp(was) and pa.types.is_timestamp(now):
        return bool(was.unit == now.unit and (was.tz is None) == (now.tz is None))
    return bool(was.equals(now))


def folder_misfits(
    held: dict[str, pa.DataType | None], schema: pa.Schema, policy: str
) -> list[str]:
    """Every reason the batch's schema does not fit the folder (empty: it fits)."""
    if not held:
        return []
    problems: list[str] = []
    names = set(schema.names)
    for field in schema:
        if field.name in held:
            was = held[field.name]
            if was is not None and not _same_type(was, field.type):
                problems.append(
                    f"column {field.name!r} is {was} in the folder's files but {field.type} "
                    "in the batch (a type change is never allowed: write to a new folder)"
                )
    gone = [n for n in held if n not in names]
    if gone:
        problems.append(
            "column(s) " + ", ".join(repr(n) for n in gone) + " are in the folder's files "
            "but not in the batch (add them back, e.g. as typed nulls, or write to a new "
            "folder)"
        )
    new = [n for n in schema.names if n not in held]
    if new and policy != "add_columns":
        problems.append(
            "new column(s) " + ", ".join(repr(n) for n in new) + " are not in the folder's "
            "files; pass on_schema_change='add_columns' to allow added columns (read the "
            "folder with mergeSchema: older files read as null)"
        )
    return problems
