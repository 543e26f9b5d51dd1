"""The native data path for Iceberg (``twophase.participant.SparkWritten``): Spark's own
Parquet writer writes an attempt's rows into a folder of the batch's folder, and
:func:`adopt` makes each task's file a prepare run of its branch, as the Python path
leaves one (``<participant>-<partition>-<attempt>-<run>-00000.parquet`` and the run's
``.done`` record), so the commit (one snapshot carrying the marker), ``status``,
``abort`` and the sweeps stay as they are.

The write folder is ``<batch folder>/_spark-<participant>-<attempt>``: named by the
attempt, so a driver killed while Spark writes, or before the adopt, leaves something
``status`` reads as PREPARED and ``abort``/``in_doubt`` find by name. A file that does
not fit the table (Spark's Parquet types against the table's schema) is refused here,
before any vote: the commit would otherwise fail after the COMMIT decision.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING

from twophase.errors import ParticipantError
from twophase.protocol import TxnKey
from twophase.sinks.batchfiles import fsync_dir, spark_parts, write_dir, write_record

if TYPE_CHECKING:
    import pyarrow as pa
    from pyiceberg.table import Table

    from twophase.participant import Handle
    from twophase.sinks.iceberg.participant import IcebergParticipant

__all__ = ["adopt", "local_location"]


def local_location(location: str) -> bool:
    """True for a table or warehouse on the local (shared) file system: Spark's writer
    reaches it as pyiceberg does. Object stores need Spark's own S3 set-up (not done)."""
    return location.startswith(("file:/", "/"))


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


def adopt(part: IcebergParticipant, tbl: Table, key: TxnKey, partitions: int
          ) -> dict[int, Handle]:
    """Spark's ``part-NNNNN-*.parquet`` files of attempt ``key`` (one per task, NNNNN its
    partition) become prepare runs of their branches: checked against the table, renamed,
    the run's ``.done`` record written and fsynced, the write folder removed last."""
    import pyarrow.parquet as pq

    fs, folder, _ = part._batch_dir(tbl, key.sink, key.lineage, key.batch_id)
    where = f"{folder}/{write_dir(part.name, key.attempt)}"
    names = sorted(p.rsplit("/", 1)[-1] for p in part._list(fs, where))
    if not names and not fs.get_file_info(where).type:
        raise ParticipantError(f"{part.describe()}: Spark's write left no folder {where}")
    if not tbl.spec().is_unpartitioned():
        raise ParticipantError(f"{part.describe()}: the table is partitioned, which the "
                               "native path does not write; pass native=False")
    committed = part._markers(tbl, key.sink).committed(key.lineage, key.batch_id) is not None
    handles: dict[int, Handle] = {}
    for partition, n in spark_parts(names, partitions, part.describe()):
        with fs.open_input_file(f"{where}/{n}") as f:
            meta = pq.read_metadata(f)
        if not meta.num_rows:
            continue
        if committed:  # the marker: an earlier run committed the batch, keep nothing
            handles[partition] = {"files": "[]", "rows": "0", "bytes": "0", "committed": "yes"}
            continue
        _fits(part, tbl, n, meta.schema.to_arrow_schema())
        run = uuid.uuid4().hex[:12]
        stem = f"{part.name}-{partition:05d}-{key.attempt}-{run}"
        data = f"{stem}-00000.parquet"
        size = fs.get_file_info(f"{where}/{n}").size
        fs.move(f"{where}/{n}", f"{folder}/{data}")
        write_record(fs, folder, f"{stem}.done", {"files": [data], "rows": meta.num_rows},
                     local=True)
        handles[partition] = {"run": run, "files": json.dumps([data], separators=(",", ":")),
                              "rows": str(meta.num_rows), "bytes": str(size)}
    fsync_dir(folder)
    fs.delete_dir(where)
    return handles

