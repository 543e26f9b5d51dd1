"""The native data path for Delta (``twophase.participant.SparkWritten``): Spark's own
Parquet writer writes an attempt's rows into ``<batch folder>/_spark-<participant>-
<attempt>``, and :func:`adopt` renames each task's file to the branch file name the
Python path gives it (``<participant>-<partition>-<attempt>-00000.parquet``) and votes
the add action's size, row count and statistics, read from the file's Parquet footer
(:func:`stats_from_parquet`, which a recovery without the vote reads the same way). The
batch's one commit (add actions, the app transaction, the commit info), ``status``,
``abort`` and the sweeps stay as they are; a write folder is PREPARED until adopted.

A file whose columns do not fit the table's schema is refused here, before any vote."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from twophase.errors import ParticipantError
from twophase.protocol import TxnKey
from twophase.sinks.batchfiles import spark_parts, write_dir
from twophase.sinks.delta.arrow import arrow_schema_of, delta_schema, pyarrow_module
from twophase.sinks.delta.writer import HANDLE_CHARS, STAT_CHARS, Stats

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from twophase.participant import Handle
    from twophase.sinks.delta.participant import DeltaParticipant

__all__ = ["adopt", "misfits", "stats_from_parquet"]


def _same(file: pa.DataType, table: pa.DataType) -> bool:
    """The file's column type reads as the table's: equal, nested types compared by
    their fields' names and types (not a list item's name, nor nullability)."""
    pa = pyarrow_module()
    if pa.types.is_list(file) and pa.types.is_list(table):
        return _same(file.value_type, table.value_type)
    if pa.types.is_map(file) and pa.types.is_map(table):
        return _same(file.key_type, table.key_type) and _same(file.item_type, table.item_type)
    if pa.types.is_struct(file) and pa.types.is_struct(table):
        return [f.name for f in file] == [f.name for f in table] and all(
            _same(a.type, b.type) for a, b in zip(file, table, strict=True))
    return bool(file.equals(table))


def misfits(file: pa.Schema, table: pa.Schema) -> list[str]:
    """Why a data file Spark wrote does not fit the table (empty: it fits). A nullable
    table column the file lacks reads as null, as for a column added later."""
    file = delta_schema(file)
    problems = [f"{f.name} (file {f.type}, table {table.field(f.name).type})" for f in file
                if f.name in table.names and not _same(f.type, table.field(f.name).type)]
    extra = [f.name for f in file if f.name not in table.names]
    lacking = [f.name for f in table if f.name not in file.names and not f.nullable]
    return ([f"column types differ: {', '.join(problems)}"] if problems else []) + \
        ([f"columns not in the table: {', '.join(extra)}"] if extra else []) + \
        ([f"non-nullable columns missing: {', '.join(lacking)}"] if lacking else [])


def stats_from_parquet(meta: pq.FileMetaData) -> str:
    """A data file's Delta statistics from its Parquet footer, by the rule of the Python
    path's :class:`~twophase.sinks.delta.writer.Stats` (whole or only the row count): a
    floating column drops the file to its row count, because a footer's min/max leave
    NaN out without a trace; so do a missing statistic and a string over 32 characters."""
    pa = pyarrow_module()
    schema = meta.schema.to_arrow_schema()
    st = Stats(schema)
    st.rows = meta.num_rows
    if any(pa.types.is_floating(f.type) for f in schema):
        st.whole = False
    index = {meta.schema.column(j).path: j for j in range(meta.num_columns)}
    for rg in range(meta.num_row_groups if st.whole else 0):
        group = meta.row_group(rg)
        for name in st.nulls:
            s = group.column(index[name]).statistics if name in index else None
            if s is None or not s.has_null_count:
                st.whole = False
                return st.json()
            st.nulls[name] += s.null_count
            if s.null_count == group.num_rows:
                continue  # all null here
            if not s.has_min_max:
                st.whole = False
                return st.json()
            ts = pa.types.is_timestamp(st.types[name])  # in the type's unit, as Stats keeps it
            lo, hi = (s.min_raw, s.max_raw) if ts else (s.min, s.max)
            if isinstance(lo, bytes) or (isinstance(lo, str) and (
                    len(lo) > STAT_CHARS or len(hi) > STAT_CHARS)):
                st.whole = False
                return st.json()
            st.lo[name] = lo if name not in st.lo else min(st.lo[name], lo)
            st.hi[name] = hi if name not in st.hi else max(st.hi[name], hi)
    return st.json()


def adopt(part: DeltaParticipant, dt: Any, key: TxnKey, partitions: int) -> dict[int, Handle]:
    """Spark's ``part-NNNNN-*.parquet`` files of attempt ``key`` (one per task, NNNNN its
    partition) become the branches' files: checked against the table, renamed, the batch
    folder fsynced, the write folder removed last."""
    import shutil

    import pyarrow.parquet as pq

    folder = part._join(part.path, part._rel(key.sink, key.lineage, key.batch_id))
    where = f"{folder}/{write_dir(part.name, key.attempt)}"
    try:
        names = sorted(os.listdir(where))
    except OSError as exc:
        raise ParticipantError(f"{part.describe()}: Spark's write left no folder "
                               f"{where}: {exc}") from exc
    if dt.metadata().partition_columns:
        raise ParticipantError(f"{part.describe()}: the table is partitioned, which the "
                               "native path does not write; pass native=False")
    committed = part._committed(dt, key.sink, key.lineage, key.batch_id)
    table = arrow_schema_of(dt)
    handles: dict[int, Handle] = {}
    for partition, n in spark_parts(names, partitions, part.describe()):
        meta = pq.read_metadata(f"{where}/{n}")
        if not meta.num_rows:
            continue
        if committed:  # the marker: an earlier run committed the batch, keep nothing
            handles[partition] = {"files": "[]", "rows": "0", "committed": "yes"}
            continue
        problems = misfits(meta.schema.to_arrow_schema(), table)
        if problems:
            raise ParticipantError(
                f"{part.describe()}: the Parquet file Spark wrote ({n}) does not fit the "
                f"table: {'; '.join(problems)}. Fix: cast the stream's columns to the "
                "table's types before the sink, or pass native=False (the Python path "
                "converts them)")
        name = f"{part.name}-{partition:05d}-{key.attempt}-00000.parquet"
        os.replace(f"{where}/{n}", f"{folder}/{name}")
        size = os.path.getsize(f"{folder}/{name}")
        listed = json.dumps([[name, size, meta.num_rows, {}, stats_from_parquet(meta)]],
                            separators=(",", ":"))
        # too long to vote: the batch commit reads the footer (the same statistics)
        handles[partition] = {"files": listed if len(listed) <= HANDLE_CHARS else "*",
                              "rows": str(meta.num_rows)}
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(where)
    return handles
