"""The Python path's branch files for Iceberg: rows split by partition value and
streamed into Parquet files under the batch's folder, and a prepare run's record."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twophase.sinks.batchfiles import fsync_dir, part_path, seal_part, write_record

if TYPE_CHECKING:
    import pyarrow as pa
    from pyarrow import fs as pafs
    from pyiceberg.table import Table


@dataclass
class Run:
    """One prepare run's files; ``done`` names its record once the run completed."""

    files: list[str] = field(default_factory=list)
    done: str | None = None


@dataclass
class Found:
    fs: pafs.FileSystem
    folder: str
    runs: dict[str, Run] = field(default_factory=dict)
    temps: list[str] = field(default_factory=list)

    def complete(self, run: str | None) -> list[str] | None:
        """The data files of ``run`` (or of the first complete run when the vote is
        unknown: every complete run holds the branch's same rows), from its record."""
        ids = [run] if run else sorted(self.runs)
        for rid in ids:
            r = self.runs.get(rid)
            if r is not None and r.done is not None:
                with self.fs.open_input_stream(f"{self.folder}/{r.done}") as f:
                    names: list[str] = json.loads(f.read())["files"]
                return names
        return None


def writer_options(tbl: Table) -> dict[str, Any]:
    """The table's Parquet settings (codec, level, page sizes), as pyiceberg's own
    writer reads them from the table properties (default zstd)."""
    from pyiceberg.io.pyarrow import _get_parquet_writer_kwargs

    return _get_parquet_writer_kwargs(tbl.properties)


def delete_file(fs: pafs.FileSystem, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.delete_file(path)


class Grouper:
    """Splits a record batch by the table's partition values (identity and time
    transforms): Iceberg wants each data file within one partition."""

    def __init__(self, fields: tuple[tuple[str, str], ...]) -> None:
        self.fields = fields

    def split(self, batch: pa.RecordBatch) -> Iterator[tuple[tuple[Any, ...], pa.RecordBatch]]:
        import pyarrow as pa

        cols = {}
        for i, (transform, column) in enumerate(self.fields):
            cols[f"k{i}"] = transform_values(transform, batch.column(column))
        cols["row"] = pa.array(range(batch.num_rows), type=pa.int64())
        keys = [f"k{i}" for i in range(len(self.fields))]
        groups = pa.table(cols).group_by(keys, use_threads=False).aggregate([("row", "list")])
        for g in groups.to_pylist():
            yield tuple(g[k] for k in keys), batch.take(pa.array(g["row_list"], pa.int64()))


def transform_values(transform: str, arr: pa.Array) -> pa.Array:
    """Iceberg's partition transforms, enough to group rows (the data file's partition
    value itself is derived by pyiceberg from the file's statistics)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if transform == "identity":
        return arr
    if transform == "hour":
        us = pc.cast(pc.cast(arr, pa.timestamp("us", tz="UTC")), pa.int64())
        return pc.divide(us, 3_600_000_000)
    day = arr if pa.types.is_date(arr.type) else pc.cast(
        pc.cast(arr, pa.timestamp("us", tz="UTC")), pa.date32())
    if transform == "day":
        return day
    return pc.year(day) if transform == "year" else pc.add(pc.multiply(pc.year(day), 12),
                                                            pc.month(day))


class BranchWriter:
    """Streams one branch's rows into Parquet files, one open file per partition value,
    rolled at ``target`` bytes. A local file is written under a ``.tmp`` name and renamed
    when whole (a kill leaves litter, never a torn data file); an object store shows an
    object only once its upload completed."""

    def __init__(self, fs: pafs.FileSystem, folder: str, stem: str, target: int,
                 grouper: Grouper | None, options: dict[str, Any]) -> None:
        self.fs, self.folder, self.stem, self.target = fs, folder, stem, target
        self.options = options
        self.grouper = grouper
        self.local = fs.type_name == "local"
        self.open: dict[tuple[Any, ...], tuple[Any, Any, str]] = {}
        self.names: list[str] = []
        self.rows = self.bytes = 0
        self.seq = 0
        if self.local:
            fs.create_dir(folder, recursive=True)

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        self.rows += batch.num_rows
        parts = self.grouper.split(batch) if self.grouper else [((), batch)]
        for key, part in parts:
            if key not in self.open:
                self._start(key, part.schema)
            stream, writer, _ = self.open[key]
            writer.write_batch(part)
            if stream.tell() >= self.target:
                self._finish(key)

    def _start(self, key: tuple[Any, ...], schema: pa.Schema) -> None:
        import pyarrow.parquet as pq

        name = f"{self.stem}-{self.seq:05d}.parquet"
        self.seq += 1
        stream = self.fs.open_output_stream(part_path(self.folder, name, self.local))
        self.open[key] = (stream, pq.ParquetWriter(stream, schema, **self.options), name)

    def _finish(self, key: tuple[Any, ...]) -> None:
        stream, writer, name = self.open.pop(key)
        writer.close()
        self.bytes += stream.tell()
        stream.close()
        seal_part(self.fs, self.folder, name, self.local)
        self.names.append(name)

    def close(self) -> tuple[list[str], int, int]:
        for key in list(self.open):
            self._finish(key)
        write_record(self.fs, self.folder, f"{self.stem}.done",
                     {"files": self.names, "rows": self.rows}, self.local)
        if self.local:
            fsync_dir(self.folder)
        return self.names, self.rows, self.bytes

    def discard(self) -> None:
        for stream, writer, name in self.open.values():
            for closer in (writer.close, stream.close):
                with contextlib.suppress(Exception):  # failing already; the files go next
                    closer()
            delete_file(self.fs, f"{self.folder}/.{name}.tmp" if self.local
                    else f"{self.folder}/{name}")
        self.open.clear()
        for name in self.names:
            delete_file(self.fs, f"{self.folder}/{name}")
        self.names.clear()


