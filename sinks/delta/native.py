"""The native data path for Delta (``twophase.participant.SparkWritten``): Spark's own
Parquet writer writes an attempt's rows into ``<batch folder>/_spark-<participant>-
<attempt>`` (a partitioned table's with ``partitionBy``: Hive-style ``col=value/``
folders), and :func:`adopt` renames each task's files to the branch file names the
Python path gives them (``<participant>-<partition>-<attempt>-<seq>.parquet``, flat in
the batch folder) and votes each add action's partition values (from the folder names),
size, row count and statistics, read from the file's Parquet footer
(:func:`stats_from_parquet`, which a recovery without the vote reads the same way; the
partition values then from the branch's values record, :func:`values_name`). The
batch's one commit (add actions, the app transaction, the commit info), ``status``,
``abort`` and the sweeps stay as they are; a write folder is PREPARED until adopted.

A file whose columns do not fit the table's schema is refused here, before any vote."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from twophase.errors import ParticipantError
from twophase.protocol import TxnKey
from twophase.sinks.batchfiles import (
    SPARK_PART,
    fsync_dir,
    hive_values,
    spark_parts,
    write_dir,
    write_record,
)
from twophase.sinks.delta.arrow import arrow_schema_of, delta_schema, pyarrow_module
from twophase.sinks.delta.writer import HANDLE_CHARS, STAT_CHARS, Stats

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyarrow import fs as pafs

    from twophase.participant import Handle
    from twophase.sinks.delta.participant import DeltaParticipant

__all__ = ["adopt", "misfits", "native_misfit", "stats_from_parquet", "values_name",
           "with_values"]



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


def _leaves(where: str, parts: list[str], describe: str
            ) -> list[tuple[str, dict[str, str | None]]]:
    """(folder, partition values) of each folder Spark's ``partitionBy`` filled, by name:
    ``col=value`` per partition column in the table's order, the value unescaped as
    Spark escapes it (``%XX``), ``__HIVE_DEFAULT_PARTITION__`` (a null or empty value)
    read as null. Without partition columns: the write folder itself."""
    if not parts:
        return [(where, {})]
    out = []
    for folder, _dirs, files in os.walk(where):
        segs = [] if folder == where else os.path.relpath(folder, where).split(os.sep)
        if not any(SPARK_PART.match(n) for n in files):
            continue
        found = hive_values(segs, parts)
        if found is None:
            raise ParticipantError(
                f"{describe}: Spark's write left data files in {folder}, not in the "
                f"table's partition folders {'/'.join(f'{c}=...' for c in parts)}; the "
                "table's partitioning changed during the batch? Fix: retry the batch, or "
                "pass native=False")
        out.append((folder, dict(zip(parts, found, strict=True))))
    return sorted(out)


def values_name(participant: str, partition: int, attempt: int) -> str:
    """The record of a branch's partition values beside its files (hidden: no reader or
    vacuum takes it), written only when the vote cannot list the files: a file Spark
    wrote keeps its partition values in its folder's name, which the rename drops."""
    return f".{participant}-{partition:05d}-{attempt}.values.json"


def with_values(fs: pafs.FileSystem, folder: str, participant: str, partition: int,
                attempt: int, files: list[tuple[Any, ...]], parts: list[str]
                ) -> list[tuple[Any, ...]]:
    """The branch's files as found by name, each with its partition values: a file Spark
    wrote has none in its footer; they are in the branch's values record. Refuses a
    partitioned table's file whose values are nowhere (it would land in no partition)."""
    if not parts or all(f[3] for f in files):
        return files
    try:
        with fs.open_input_stream(f"{folder}/{values_name(participant, partition, attempt)}"
                                  ) as f:
            saved: dict[str, dict[str, str | None]] = json.loads(f.read())
    except FileNotFoundError:
        saved = {}
    out = []
    for name, size, rows, values, stats in files:
        values = values or saved.get(name)
        if not values:
            raise ParticipantError(
                f"{folder}/{name}: a data file of a partitioned table without partition "
                "values (no vote lists it and no values record names it); the batch "
                "cannot commit it. Fix: twophase resolve aborts the attempt, and the "
                "batch is written again")
        out.append((name, size, rows, values, stats))
    return out


def native_misfit(part: DeltaParticipant) -> str:
    """Why Spark's Parquet writer cannot fill the participant's table ("" when it can)."""
    from deltalake import DeltaTable

    if part.remote:
        return "the table is on object storage, which the native path does not write"
    if not DeltaTable.is_deltatable(part.path):
        return ""
    generated = [f.name for f in part._table().schema().fields
                 if "delta.generationExpression" in (f.metadata or {})]
    if generated:
        return (f"the table has generated columns ({', '.join(generated)}), which Spark's "
                "Parquet writer does not compute")
    return ""


def adopt(part: DeltaParticipant, dt: Any, key: TxnKey, partitions: int) -> dict[int, Handle]:
    """Spark's ``part-NNNNN-*.parquet`` files of attempt ``key`` (one per task, NNNNN its
    partition, and per partition value in Hive-style folders for a partitioned table)
    become the branches' files, named as the Python path names them (its partition values
    in the vote): checked against the table's columns that are not partition columns,
    renamed, the batch folder fsynced, the write folder removed last."""
    import shutil

    import pyarrow.parquet as pq

    folder = part._join(part.path, part._rel(key.sink, key.lineage, key.batch_id))
    where = f"{folder}/{write_dir(part.name, key.attempt)}"
    if not os.path.isdir(where):
        raise ParticipantError(f"{part.describe()}: Spark's write left no folder {where}")
    parts = list(dt.metadata().partition_columns)
    committed = part._committed(dt, key.sink, key.lineage, key.batch_id)
    table = pyarrow_module().schema([f for f in arrow_schema_of(dt) if f.name not in parts])
    files: dict[int, list[list[Any]]] = {}
    handles: dict[int, Handle] = {}
    for leaf, values in _leaves(where, parts, part.describe()):
        names = [n for n in os.listdir(leaf) if os.path.isfile(f"{leaf}/{n}")]
        for partition, n in spark_parts(names, partitions, part.describe()):
            meta = pq.read_metadata(f"{leaf}/{n}")
            if not meta.num_rows:
                continue
            if committed:  # the marker: an earlier run committed the batch, keep nothing
                handles[partition] = {"files": "[]", "rows": "0", "committed": "yes"}
                continue
            problems = misfits(meta.schema.to_arrow_schema(), table)
            if problems:
                raise ParticipantError(
                    f"{part.describe()}: the Parquet file Spark wrote ({n}) does not fit "
                    f"the table: {'; '.join(problems)}. Fix: cast the stream's columns to "
                    "the table's types before the sink, or pass native=False (the Python "
                    "path converts them)")
            mine = files.setdefault(partition, [])
            name = f"{part.name}-{partition:05d}-{key.attempt}-{len(mine):05d}.parquet"
            os.replace(f"{leaf}/{n}", f"{folder}/{name}")
            mine.append([name, os.path.getsize(f"{folder}/{name}"), meta.num_rows, values,
                         stats_from_parquet(meta)])
    for partition, mine in files.items():
        listed = json.dumps(mine, separators=(",", ":"))
        rows = sum(f[2] for f in mine)
        if len(listed) > HANDLE_CHARS and parts:
            import pyarrow.fs as pafs

            write_record(pafs.LocalFileSystem(), folder,
                         values_name(part.name, partition, key.attempt),
                         {f[0]: f[3] for f in mine}, local=True)
        # too long to vote: the batch commit reads the footers (the same statistics)
        handles[partition] = {"files": listed if len(listed) <= HANDLE_CHARS else "*",
                              "rows": str(rows)}
    fsync_dir(folder)
    shutil.rmtree(where)
    return handles
