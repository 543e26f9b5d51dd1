"""Delta branch files: Parquet files rolled at a target size, with the add action's
statistics gathered as they are written and kept in the footer too."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from twophase.sinks.batchfiles import fsync_dir, part_path, seal_part
from twophase.sinks.delta.arrow import pyarrow_module

if TYPE_CHECKING:
    import pyarrow as pa
    from pyarrow import fs as pafs

__all__ = ["FOOTER_KEY", "BranchWriter", "Stats", "from_footer"]

FOOTER_KEY: Final = "twophase.add"  # a data file's partition values and stats, as voted
STAT_CHARS: Final = 32  # a longer string leaves its file with only a row count
HANDLE_CHARS: Final = 4000  # a handle value holds at most 4096 characters


class Stats:
    """A data file's Delta statistics, gathered while it is written: row count, exact null
    counts, and min/max of every column, or only the row count.

    All or nothing, because delta-rs's reader skips a file for a filter on a column whose
    min/max are missing while the file has stats for others (tested). A column gets a
    range when its type has one and it is exact or a true bound: integers, booleans,
    dates, finite floats, strings of at most 32 characters, timestamps as milliseconds
    (min rounded down, max up: Delta keeps milliseconds). NaN, infinities, a longer
    string or another type (binary, decimal, nested) leave the file with its row count."""

    def __init__(self, schema: pa.Schema) -> None:
        pa = pyarrow_module()
        self.rows = 0
        self.nulls = {f.name: 0 for f in schema}
        self.types = {f.name: f.type for f in schema}
        self.whole = all(
            pa.types.is_integer(f.type) or pa.types.is_floating(f.type)
            or pa.types.is_string(f.type) or pa.types.is_date32(f.type)
            or pa.types.is_boolean(f.type) or pa.types.is_timestamp(f.type)
            for f in schema)
        self.lo: dict[str, Any] = {}
        self.hi: dict[str, Any] = {}

    def add(self, batch: pa.RecordBatch) -> None:
        import pyarrow.compute as pc

        pa = pyarrow_module()
        self.rows += batch.num_rows
        for name in self.nulls:
            self.nulls[name] += batch.column(name).null_count
        if not self.whole:
            return
        for name in self.nulls:
            col = batch.column(name)
            if pa.types.is_floating(col.type) and (
                    pc.any(pc.is_nan(col)).as_py() or pc.any(pc.is_inf(col)).as_py()):
                self.whole = False
                return
            if pa.types.is_timestamp(col.type):
                col = col.cast(pa.int64())  # in the type's unit; milliseconds in json()
            mm = pc.min_max(col)
            lo, hi = mm["min"].as_py(), mm["max"].as_py()
            if lo is None:
                continue  # all null here
            if isinstance(lo, str) and (len(lo) > STAT_CHARS or len(hi) > STAT_CHARS):
                self.whole = False
                return
            self.lo[name] = lo if name not in self.lo else min(self.lo[name], lo)
            self.hi[name] = hi if name not in self.hi else max(self.hi[name], hi)

    def json(self) -> str:
        ranged = all(n in self.lo or self.nulls[n] == self.rows for n in self.nulls)
        if not (self.whole and ranged):
            return json.dumps({"numRecords": self.rows}, separators=(",", ":"))
        return json.dumps({
            "numRecords": self.rows,
            "minValues": {k: self._out(k, v, False) for k, v in self.lo.items()},
            "maxValues": {k: self._out(k, v, True) for k, v in self.hi.items()},
            "nullCount": self.nulls,
        }, separators=(",", ":"))

    def _out(self, name: str, v: Any, up: bool) -> Any:
        import datetime as dt

        t = self.types[name]
        if pyarrow_module().types.is_timestamp(t):
            if t.unit == "s":
                ms = v * 1000
            else:
                per_ms = {"ms": 1, "us": 1000, "ns": 1_000_000}[t.unit]
                ms = -(-v // per_ms) if up else v // per_ms
            at = dt.datetime(1970, 1, 1) + dt.timedelta(milliseconds=int(ms))
            return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}" + \
                ("Z" if t.tz else "")
        return v.isoformat() if hasattr(v, "isoformat") else v


def from_footer(fs: pafs.FileSystem, folder: str, name: str) -> tuple[Any, ...]:
    """A branch file's (name, size, rows, partition values, stats) from its footer: what
    its vote said, for a commit that has only the branch."""
    import pyarrow.parquet as pq

    path = f"{folder}/{name}"
    size = fs.get_file_info(path).size
    with fs.open_input_file(path) as f:
        meta = pq.read_metadata(f)
    saved = (meta.metadata or {}).get(FOOTER_KEY.encode())
    if saved is None:  # a file Spark wrote (the native path): what its vote said
        from twophase.sinks.delta.native import stats_from_parquet

        return name, size, meta.num_rows, {}, stats_from_parquet(meta)
    add = json.loads(saved)
    return name, size, meta.num_rows, add["partitionValues"], add["stats"]



class BranchWriter:
    """Streams one branch's rows into Parquet files rolled at ``target`` bytes. A local
    file is written under a ``.tmp`` name, fsynced and renamed when whole (a kill leaves
    litter, never a torn data file); an object store shows an object only once its
    upload completed."""

    def __init__(self, fs: pafs.FileSystem, folder: str, stem: str, target: int,
                 local: bool, seq: Iterator[int], values: dict[str, str | None]) -> None:
        self.fs, self.folder, self.stem, self.target, self.local = fs, folder, stem, target, local
        self.seq, self.values = seq, values
        self.open: tuple[Any, Any, str, int] | None = None
        self.stats: Stats | None = None
        # (name, bytes, rows, partition values, stats JSON)
        self.files: list[tuple[str, int, int, dict[str, str | None], str]] = []
        if local:
            fs.create_dir(folder, recursive=True)

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        if self.open is None:
            self._start(batch.schema)
        assert self.open is not None
        stream, writer, name, rows = self.open
        writer.write_batch(batch)
        assert self.stats is not None
        self.stats.add(batch)
        self.open = (stream, writer, name, rows + batch.num_rows)
        if stream.tell() >= self.target:
            self._finish()

    def _start(self, schema: pa.Schema) -> None:
        import pyarrow.parquet as pq

        name = f"{self.stem}-{next(self.seq):05d}.parquet"
        self.stats = Stats(schema)
        stream = self.fs.open_output_stream(part_path(self.folder, name, self.local))
        self.open = (stream, pq.ParquetWriter(stream, schema), name, 0)

    def _finish(self) -> None:
        assert self.open is not None
        stream, writer, name, rows = self.open
        self.open = None
        assert self.stats is not None
        stats = self.stats.json()
        writer.add_key_value_metadata({FOOTER_KEY: json.dumps(
            {"partitionValues": self.values, "stats": stats}, separators=(",", ":"))})
        writer.close()
        stream.close()
        seal_part(self.fs, self.folder, name, self.local)
        size = self.fs.get_file_info(f"{self.folder}/{name}").size
        self.files.append((name, int(size), rows, self.values, stats))

    def close(self) -> list[tuple[str, int, int, dict[str, str | None], str]]:
        if self.open is not None:
            self._finish()
        if self.local and self.files:
            fsync_dir(self.folder)
        return self.files

    def discard(self) -> None:
        if self.open is not None:
            stream, writer, name, _ = self.open
            for closer in (writer.close, stream.close):
                with contextlib.suppress(Exception):  # failing already; the files go next
                    closer()
            with contextlib.suppress(FileNotFoundError):
                self.fs.delete_file(f"{self.folder}/.{name}.tmp" if self.local
                                    else f"{self.folder}/{name}")
            self.open = None
        for name, *_ in self.files:
            with contextlib.suppress(FileNotFoundError):
                self.fs.delete_file(f"{self.folder}/{name}")
        self.files.clear()

