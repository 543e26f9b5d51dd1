"""The native data path for Iceberg (``twophase.participant.SparkWritten``): Spark's own
Parquet writer writes an attempt's rows into a folder of the batch's folder, and
:func:`adopt` makes each task's files a prepare run of its branch, as the Python path
leaves one (``<participant>-<partition>-<attempt>-<run>-<seq>.parquet`` and the run's
``.done`` record), so the commit (one snapshot carrying the marker), ``status``,
``abort`` and the sweeps stay as they are.

The write folder is ``<batch folder>/_spark-<participant>-<attempt>``: named by the
attempt, so a driver killed while Spark writes, or before the adopt, leaves something
``status`` reads as PREPARED and ``abort``/``in_doubt`` find by name. A file that does
not fit the table (Spark's Parquet types against the table's schema) is refused here,
before any vote: the commit would otherwise fail after the COMMIT decision.

A partitioned table: Iceberg's data files keep the partition's source columns, which
Spark's ``partitionBy`` would drop, so Spark partitions by hidden derived columns
(:func:`spark_columns`, ``__twophase_p<i>``: the field's transform computed in Spark SQL
as Iceberg defines it) and only those leave the files. Each file then holds one
partition's rows; :func:`adopt` derives its partition record from the footer as the
commit will (pyiceberg, the Python path's way) and checks it against the folder's value
before the vote. Transforms Spark cannot compute as Iceberg does (bucket's murmur3 over
Iceberg's byte encodings, and truncate/void, which the Python path does not write
either) keep the table off the native path (:func:`native_misfit`).
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, Final

from twophase.errors import ParticipantError
from twophase.protocol import TxnKey
from twophase.sinks.batchfiles import (
    SPARK_PART,
    fsync_dir,
    hive_values,
    write_dir,
    write_record,
)
from twophase.sinks.iceberg.marker import HANDLE_CHARS

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyiceberg.partitioning import PartitionField
    from pyiceberg.table import Table

    from twophase.participant import Handle
    from twophase.sinks.iceberg.participant import IcebergParticipant

__all__ = ["NATIVE_TRANSFORMS", "PREFIX", "adopt", "local_location", "native_misfit",
           "spark_columns"]

PREFIX: Final = "__twophase_p"  # the hidden derived columns Spark partitions by
NATIVE_TRANSFORMS: Final = ("identity", "year", "month", "day", "hour")
_DAY_US: Final = 86_400_000_000
_HOUR_US: Final = 3_600_000_000


def local_location(location: str) -> bool:
    """True for a table or warehouse on the local (shared) file system: Spark's writer
    reaches it as pyiceberg does. Object stores need Spark's own S3 set-up (not done)."""
    return location.startswith(("file:/", "/"))


def _expr(transform: str, column: str, source: Any) -> str | None:
    """The Spark SQL expression of Iceberg's ``transform`` of ``column`` (or a value
    with the same grouping: an identity string's MD5, so '' and null, which Spark's
    folders both name ``__HIVE_DEFAULT_PARTITION__``, stay apart and a long value makes
    no long folder name), None when Spark cannot compute it as Iceberg does. The time
    transforms are Iceberg's ordinals (years, months, days, hours since 1970-01-01),
    floored, taken from a UTC instant (``unix_micros``, not the session's time zone)."""
    from pyiceberg import types as t

    q = "`" + column.replace("`", "``") + "`"
    if transform == "identity":
        if isinstance(source, (t.StringType, t.BinaryType, t.FixedType)):
            return f"md5(CAST({q} AS BINARY))"
        if isinstance(source, t.TimestamptzType):
            return f"unix_micros({q})"
        simple = (t.BooleanType, t.IntegerType, t.LongType, t.FloatType, t.DoubleType,
                  t.DecimalType, t.DateType, t.TimestampType)
        return q if isinstance(source, simple) else None
    if isinstance(source, t.TimestamptzType):
        us = f"unix_micros({q})"
        day = f"(({us} - pmod({us}, {_DAY_US})) div {_DAY_US})"
        hour: str | None = f"(({us} - pmod({us}, {_HOUR_US})) div {_HOUR_US})"
        date = f"date_from_unix_date(CAST({day} AS INT))"
    elif isinstance(source, t.TimestampType):  # Spark's TIMESTAMP_NTZ: no time zone
        date = f"CAST({q} AS DATE)"
        day = f"unix_date({date})"
        hour = f"(CAST({day} AS BIGINT) * 24 + hour({q}))"
    elif isinstance(source, t.DateType):
        date, day, hour = q, f"unix_date({q})", None
    else:
        return None
    return {"day": day, "hour": hour, "year": f"(year({date}) - 1970)",
            "month": f"((year({date}) - 1970) * 12 + month({date}) - 1)"}.get(transform)


def _plan(tbl: Table) -> tuple[list[tuple[PartitionField, str, str]], str]:
    """(field, source column, Spark expression) of each partition field, and why the
    native path cannot write the table ("" when it can)."""
    ice = tbl.schema()
    top = {f.field_id for f in ice.fields}
    out: list[tuple[PartitionField, str, str]] = []
    for f in tbl.spec().fields:
        column = ice.find_column_name(f.source_id) or ""
        transform = str(f.transform)
        expr = _expr(transform, column, ice.find_field(f.source_id).field_type) \
            if transform in NATIVE_TRANSFORMS and f.source_id in top else None
        if expr is None:
            return [], (f"partition field {f.name} ({transform} of {column}) is not one "
                        "Spark computes as Iceberg does (the native path writes identity, "
                        "year, month, day and hour of a top-level column)")
        out.append((f, column, expr))
    return out, ""


def spark_columns(part: IcebergParticipant, tbl: Table) -> dict[str, str]:
    """The hidden columns the native write partitions by (name -> Spark SQL), one per
    partition field in the spec's order; none for an unpartitioned table."""
    fields, why = _plan(tbl)
    if why:  # the spec changed since the path was chosen
        raise ParticipantError(f"{part.describe()}: {why}. Fix: pass native=False")
    return {f"{PREFIX}{i}": expr for i, (_, _, expr) in enumerate(fields)}


def native_misfit(part: IcebergParticipant) -> str:
    """Why Spark's Parquet writer cannot fill the participant's table ("" when it can):
    a table on object storage, or a partition transform Spark does not compute as
    Iceberg does (bucket: the Python path is used, which refuses it at prepare)."""
    from pyiceberg.exceptions import NoSuchTableError

    try:
        tbl = part._cat().load_table(part.identifier)
    except (NoSuchTableError, ParticipantError):  # created by check, in the warehouse,
        where = part.catalog_props.get("warehouse", "")  # by partition_by's transforms
    else:
        _, why = _plan(tbl)
        if why:
            return why
        where = tbl.location()
    if not local_location(where):
        return f"the table's location {where!r} is not on the local file system"
    return ""


def _fits(part: IcebergParticipant, tbl: Table, path: str, schema: pa.Schema) -> None:
    """Refuse a file whose columns do not fit the table (pyiceberg's own check, the one
    the commit would run), naming cause and fix."""
    from pyiceberg.io.pyarrow import _check_pyarrow_schema_compatible

    try:
        _check_pyarrow_schema_compatible(tbl.schema(), schema,
                                         format_version=tbl.metadata.format_version)
    except ValueError as exc:
        raise ParticipantError(
            f"{part.describe()}: the Parquet file Spark wrote ({path.rsplit('/', 1)[-1]}) "
            f"does not fit the table's schema:\n{exc}\nFix: cast the stream's columns to "
            "the table's types before the sink, or pass native=False (the Python path "
            "converts them)") from None


def _spark_files(part: IcebergParticipant, fs: Any, where: str, width: int,
                 partitions: int) -> list[tuple[int, str, list[str | None]]]:
    """(partition, path, folder values) of each ``part-NNNNN-*.parquet`` file Spark's
    writer left (NNNNN its task, the branch partition), under ``__twophase_p<i>=value``
    folders for a partitioned table (the value unescaped as Spark escapes it, ``%XX``;
    ``__HIVE_DEFAULT_PARTITION__``: null). One file per task and folder: a second one,
    or a task past the plan's ``partitions``, would be a twophase bug."""
    want = [f"{PREFIX}{i}" for i in range(width)]
    out: list[tuple[int, str, list[str | None]]] = []
    seen: set[tuple[int, tuple[str | None, ...]]] = set()
    for path in part._list(fs, where, recursive=True):
        segs = path[len(where) + 1:].split("/")
        m = SPARK_PART.match(segs[-1])
        if not m:
            continue  # Spark's other files (checksums)
        values = hive_values(segs[:-1], want)
        if values is None:
            raise ParticipantError(
                f"{part.describe()}: Spark's write left {path}, not in the folders "
                f"{'/'.join(f'{c}=...' for c in want) or '(none)'} of the table's partition "
                "spec; the spec changed during the batch? Fix: retry the batch, or pass "
                "native=False")
        key = (int(m["partition"]), tuple(values))
        if key[0] >= partitions or key in seen:
            raise ParticipantError(
                f"{part.describe()}: Spark wrote {path} for partition {key[0]} of "
                f"{partitions} (one file per task and partition value expected: "
                "maxRecordsPerFile is not used by the native path; a twophase bug)")
        seen.add(key)
        out.append((key[0], path, values))
    return sorted(out, key=lambda x: (x[0], x[1]))


def _check_partition(part: IcebergParticipant, tbl: Table, name: str, meta: pq.FileMetaData,
                     fields: list[tuple[PartitionField, str, str]],
                     values: list[str | None]) -> None:
    """Refuse a file whose partition value, derived from its footer as the commit derives
    it (pyiceberg's statistics, the Python path's way), is not one value, or is not the
    value of the folder Spark filed it under (Spark's expression against Iceberg's
    transform: an ordinal for the time transforms, null or not for identity)."""
    from pyiceberg.io.pyarrow import (
        compute_statistics_plan,
        data_file_statistics_from_parquet_metadata,
        parquet_path_to_id_mapping,
    )

    schema = tbl.schema()
    try:
        record = data_file_statistics_from_parquet_metadata(
            parquet_metadata=meta,
            stats_columns=compute_statistics_plan(schema, tbl.metadata.properties),
            parquet_column_mapping=parquet_path_to_id_mapping(schema),
        ).partition(tbl.spec(), schema)
    except ValueError as exc:
        raise ParticipantError(
            f"{part.describe()}: the Parquet file Spark wrote ({name}) has no one partition "
            f"value by its statistics, which the commit needs ({exc}). Fix: for a string "
            "partition column longer than the statistics' 16 characters set the table "
            "property write.metadata.metrics.column.<column>=full, or pass native=False"
        ) from None
    for i, ((f, column, _), folder) in enumerate(zip(fields, values, strict=True)):
        got = record[i]
        if str(f.transform) == "identity":
            same = (folder is None) == (got is None)
        else:
            same = (None if folder is None else int(folder)) == got
        if not same:
            raise ParticipantError(
                f"{part.describe()}: the Parquet file Spark wrote ({name}) holds partition "
                f"value {got!r} of {f.name} ({f.transform} of {column}) by its statistics, "
                f"but Spark filed it under {folder!r} (a float NaN, or Spark's expression "
                "differs from Iceberg's transform). Fix: pass native=False")


def adopt(part: IcebergParticipant, tbl: Table, key: TxnKey, partitions: int
          ) -> dict[int, Handle]:
    """Spark's ``part-NNNNN-*.parquet`` files of attempt ``key`` (one per task, NNNNN its
    partition, and per partition value in ``__twophase_p<i>=`` folders for a partitioned
    table) become one prepare run of their branch each: checked against the table (its
    columns, each file's one partition value), renamed flat as the Python path names
    them, the run's ``.done`` record written and fsynced, the write folder removed last."""
    import pyarrow.parquet as pq

    fs, folder, _ = part._batch_dir(tbl, key.sink, key.lineage, key.batch_id)
    where = f"{folder}/{write_dir(part.name, key.attempt)}"
    if not fs.get_file_info(where).type:
        raise ParticipantError(f"{part.describe()}: Spark's write left no folder {where}")
    fields, why = _plan(tbl)
    if why:
        raise ParticipantError(f"{part.describe()}: {why}; the table's partition spec "
                               "changed? Fix: pass native=False")
    committed = part._markers(tbl, key.sink).committed(key.lineage, key.batch_id) is not None
    handles: dict[int, Handle] = {}
    runs: dict[int, tuple[str, list[str], list[int]]] = {}  # stem, files, [rows, bytes]
    for partition, path, values in _spark_files(part, fs, where, len(fields), partitions):
        name = path.rsplit("/", 1)[-1]
        with fs.open_input_file(path) as f:
            meta = pq.read_metadata(f)
        if not meta.num_rows:
            continue
        if committed:  # the marker: an earlier run committed the batch, keep nothing
            handles[partition] = {"files": "[]", "rows": "0", "bytes": "0", "committed": "yes"}
            continue
        _fits(part, tbl, name, meta.schema.to_arrow_schema())
        if fields:
            _check_partition(part, tbl, name, meta, fields, values)
        stem, files, counts = runs.setdefault(partition, (
            f"{part.name}-{partition:05d}-{key.attempt}-{uuid.uuid4().hex[:12]}", [], [0, 0]))
        data = f"{stem}-{len(files):05d}.parquet"
        counts[0] += meta.num_rows
        counts[1] += fs.get_file_info(path).size or 0
        fs.move(path, f"{folder}/{data}")
        files.append(data)
    for partition, (stem, files, (rows, size)) in runs.items():
        write_record(fs, folder, f"{stem}.done", {"files": files, "rows": rows}, local=True)
        listed = json.dumps(files, separators=(",", ":"))
        handles[partition] = {"run": stem.rsplit("-", 1)[-1],
                              "files": listed if len(listed) <= HANDLE_CHARS else "*",
                              "rows": str(rows), "bytes": str(size)}
    fsync_dir(folder)
    fs.delete_dir(where)
    return handles
