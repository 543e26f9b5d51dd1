"""The native data path for tables under real Spark (local[2]), in this process: an
Iceberg-only and a Delta-only sink have Spark's own Parquet writer write the data files
(the participant's ``prepare`` is never called), one snapshot or version per batch with
the marker, and read back (pyiceberg, delta-rs, DuckDB) the same rows as the Python
path's table (a misfit, the crash windows: tests/sinks/test_native_adopt.py)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.sinks.iceberg.iceberg_support import local_catalog
from twophase import TransactionalSink
from twophase.participant import BatchParticipant, BranchRef, Handle
from twophase.sinks.delta import DeltaParticipant
from twophase.sinks.iceberg import IcebergParticipant

pytestmark = pytest.mark.spark

QUERY = ("SELECT id, CAST(id AS STRING) AS name, timestamp_seconds(id) AS ts, "
         "CAST(id AS DECIMAL(10, 2)) AS amount, CAST(id AS DOUBLE) / 4 AS x, "
         "array(id, id) AS pair, CAST(id AS INT) AS small FROM range(0, {n}, 1, 3)")


class NativeIceberg(IcebergParticipant):
    def prepare(self, branch: BranchRef, schema: pa.Schema,
                batches: Iterable[pa.RecordBatch]) -> Handle:
        raise AssertionError("the native path handed rows to Python")


class NativeDelta(DeltaParticipant):
    def prepare(self, branch: BranchRef, schema: pa.Schema,
                batches: Iterable[pa.RecordBatch]) -> Handle:
        raise AssertionError("the native path handed rows to Python")


def _write(spark: Any, tmp: Path, part: BatchParticipant, tag: str) -> list[Any]:
    sink = TransactionalSink("nat", [part], f"sqlite:///{tmp / f'{tag}.db'}",
                             lineage="lin-1", preflight=False)
    try:
        sink(spark.sql(QUERY.format(n=300)), 0)
        sink(spark.sql(QUERY.format(n=300)).where("id < 0"), 1)  # no rows at all
        sink(spark.sql(QUERY.format(n=20)).repartition(3, "id"), 2)  # a shuffled batch
        return [(r.outcome, r.rows, r.partitions) for r in sink.history]
    finally:
        sink.close()


WANT = [("committed", 300, 3), ("committed", 0, 3), ("committed", 20, 3)]


def _ice(tmp: Path, cls: type[IcebergParticipant], native: bool) -> IcebergParticipant:
    return cls("ns.t", local_catalog(tmp), name="ice", native=native)


def test_iceberg_native_reads_back_as_the_python_path(spark: Any, tmp_path: Path) -> None:
    assert IcebergParticipant.native_format(NativeIceberg("ns.t", local_catalog(
        tmp_path / "a"))) is None  # a subclass with its own prepare asks for it
    native = _ice(tmp_path / "n", NativeIceberg, True)
    python = _ice(tmp_path / "p", IcebergParticipant, False)
    assert _write(spark, tmp_path, native, "n") == WANT
    assert _write(spark, tmp_path, python, "p") == WANT
    n_tbl, p_tbl = native._load(), python._load()
    n_rows = n_tbl.scan().to_arrow().sort_by("id")
    assert n_rows.equals(p_tbl.scan().to_arrow().sort_by("id"))
    assert n_rows.num_rows == 320
    marks = [[s.summary["twophase.batch"] for s in t.metadata.snapshots]  # type: ignore[index]
             for t in (n_tbl, p_tbl)]
    assert marks == [["0", "2"]] * 2  # one snapshot per batch with rows, with the marker
    files = [t.file.file_path.removeprefix("file://") for t in n_tbl.scan().plan_files()]
    assert len(files) == 6  # one per partition with rows
    assert sorted(r[0] for r in duckdb.connect().execute(
        "SELECT id FROM read_parquet(?)", [files]).fetchall()) == \
        n_rows.column("id").to_pylist()
    assert native.in_doubt("nat") == []
    assert native.read_back("id").prepared == 0


def test_delta_native_reads_back_as_the_python_path(spark: Any, tmp_path: Path) -> None:
    from deltalake import DeltaTable

    native = NativeDelta(str(tmp_path / "n"), name="dl", native=True)
    python = DeltaParticipant(str(tmp_path / "p"), name="dl", native=False)
    assert _write(spark, tmp_path, native, "n") == WANT
    assert _write(spark, tmp_path, python, "p") == WANT
    n_dt, p_dt = DeltaTable(native.path), DeltaTable(python.path)
    n_rows = n_dt.to_pyarrow_table().sort_by("id")
    assert n_rows.equals(p_dt.to_pyarrow_table().sort_by("id"))
    assert n_rows.num_rows == 320
    batches = [[h.get("twophase.batch") for h in reversed(d.history()) if "twophase.batch" in h]
               for d in (n_dt, p_dt)]
    assert batches == [["0", "2"]] * 2  # one version per batch with rows, with the marker
    assert n_dt.version() == p_dt.version()
    assert n_dt.transaction_version("twophase-nat-lin-1") == 2
    adds = pa.table(n_dt.get_add_actions(flatten=True)).to_pylist()
    assert len(adds) == 6
    assert sorted(r[0] for r in duckdb.connect().execute(
        "SELECT id FROM read_parquet(?)", [n_dt.file_uris()]).fetchall()) == \
        n_rows.column("id").to_pylist()
    assert native.in_doubt("nat") == []
    assert native.read_back("id").prepared == 0


PARTED = ("SELECT id, element_at(array('a b', 'x/y=z', NULL, '', 'p%q'), "
          "CAST(id % 5 + 1 AS INT)) AS s, date_add(date'2026-01-01', CAST(id % 2 AS INT)) AS d, "
          "CAST(id % 3 AS INT) AS k, CAST(id AS STRING) AS name FROM range(0, {n}, 1, 3)")


def _adds(path: str) -> list[tuple[str, str, list[str]]]:
    """(partition values, statistics, the file's columns) of every add action in the log."""
    out = []
    for f in sorted((Path(path) / "_delta_log").glob("*.json")):
        for line in f.read_text().splitlines():
            if line.startswith('{"add"'):
                a = json.loads(line)["add"]
                names = pq.read_schema(f"{path}/{a['path']}").names
                out.append((json.dumps(a["partitionValues"], sort_keys=True), a["stats"], names))
    return sorted(out)


def test_delta_partitioned_native_as_the_python_path(spark: Any, tmp_path: Path) -> None:
    """Spark's ``partitionBy`` folders become the add actions' partition values: a value
    with a space, '/', '=', '%', an empty string and a null (both null, as in Spark),
    dates and ints; the same rows, values, statistics and files' columns as the Python
    path's table."""
    from deltalake import DeltaTable

    tables = {}
    for tag, cls, native in (("p", DeltaParticipant, False), ("n", NativeDelta, True)):
        part = cls(str(tmp_path / tag), name="dl", partition_by=["s", "d", "k"], native=native)
        sink = TransactionalSink("nat", [part], f"sqlite:///{tmp_path / f'{tag}.db'}",
                                 lineage="lin-1", preflight=False)
        try:
            sink(spark.sql(PARTED.format(n=60)), 0)
            sink(spark.sql(PARTED.format(n=60)).where("id >= 40"), 1)
        finally:
            sink.close()
        assert [(r.outcome, r.rows) for r in sink.history] == [("committed", 60),
                                                               ("committed", 20)]
        tables[tag] = part
    n_dt, p_dt = (DeltaTable(tables[t].path) for t in "np")
    n_rows = n_dt.to_pyarrow_table().sort_by("id")
    assert n_rows.equals(p_dt.to_pyarrow_table().sort_by("id"))
    assert n_rows.num_rows == 80
    assert set(n_rows.column("s").to_pylist()) == {"a b", "x/y=z", None, "p%q"}
    n_adds = _adds(tables["n"].path)
    assert n_adds == _adds(tables["p"].path)
    assert {tuple(a[2]) for a in n_adds} == {("id", "name")}  # no partition column
    assert {json.loads(a[0])["s"] for a in n_adds} == {"a b", "x/y=z", None, "p%q"}
    assert n_dt.transaction_version("twophase-nat-lin-1") == 1
    assert [h.get("twophase.batch") for h in reversed(n_dt.history())
            if "twophase.batch" in h] == ["0", "1"]  # one version per batch
    assert sorted(r[0] for r in duckdb.connect().execute(
        "SELECT id FROM read_parquet(?)", [n_dt.file_uris()]).fetchall()) == \
        n_rows.column("id").to_pylist()
    # a partition filter reads only its files (delta-rs prunes on the partition values)
    assert n_dt.to_pyarrow_table(filters=[("s", "=", "x/y=z")]).num_rows == 16
    assert tables["n"].in_doubt("nat") == []
    assert not list(Path(tables["n"].path).rglob("_spark-*"))


ICE_PARTED = ("SELECT id, element_at(array('a b', 'x/y=z', NULL, '', 'p%q'), "
              "CAST(id % 5 + 1 AS INT)) AS s, IF(id % 7 = 3, NULL, "
              "timestamp_seconds(id * 30000 - 200000)) AS ts, "
              "date_add(date'1969-12-30', CAST(id * 20 AS INT)) AS d, "
              "add_months(date'1969-11-30', CAST(id AS INT)) AS m, CAST(id % 2 AS INT) AS k, "
              "CAST(id AS STRING) AS name FROM range(0, {n}, 1, 3)")
ICE_BY = ["s", "day(ts)", "year(d)", "month(m)", "k"]


def _ice_files(part: IcebergParticipant) -> list[tuple[tuple[Any, ...], int]]:
    """(partition record, rows) of every data file of the table's current snapshot."""
    return sorted(((tuple(t.file.partition), t.file.record_count)  # type: ignore[arg-type]
                   for t in part._load().scan().plan_files()), key=repr)


def test_iceberg_partitioned_native_as_the_python_path(spark: Any, tmp_path: Path) -> None:
    """Spark partitions by the derived columns (an identity string's MD5, the ordinals of
    day, month and year) and keeps the source columns: the same rows and the same
    partition value and row count per data file as the Python path's table, values with
    a space, '/', '=', '%', an empty string (not null) and nulls, timestamps and dates
    before 1970."""
    tables = {}
    for tag, cls, native in (("p", IcebergParticipant, False), ("n", NativeIceberg, True)):
        part = cls("ns.t", local_catalog(tmp_path / tag), name="ice", partition_by=ICE_BY,
                   native=native)
        sink = TransactionalSink("nat", [part], f"sqlite:///{tmp_path / f'{tag}.db'}",
                                 lineage="lin-1", preflight=False)
        try:
            sink(spark.sql(ICE_PARTED.format(n=40)), 0)
            sink(spark.sql(ICE_PARTED.format(n=40)).where("id >= 30"), 1)
        finally:
            sink.close()
        assert [(r.outcome, r.rows) for r in sink.history] == [("committed", 40),
                                                               ("committed", 10)]
        tables[tag] = part
    n_tbl, p_tbl = (tables[t]._load() for t in "np")
    n_rows = n_tbl.scan().to_arrow().sort_by("id")
    assert n_rows.equals(p_tbl.scan().to_arrow().sort_by("id"))
    assert n_rows.num_rows == 50
    files = _ice_files(tables["n"])
    assert files == _ice_files(tables["p"])
    assert len(files) > 40  # a file per task and partition value
    assert {f[0][0] for f in files} == {"a b", "x/y=z", None, "", "p%q"}
    assert min(f[0][1] for f in files if f[0][1] is not None) < 0  # a day before 1970
    assert None in {f[0][1] for f in files}
    paths = [t.file.file_path.removeprefix("file://") for t in n_tbl.scan().plan_files()]
    assert {tuple(pq.read_schema(p).names) for p in paths} == {
        ("id", "s", "ts", "d", "m", "k", "name")}  # the source columns kept, no derived one
    assert sorted(r[0] for r in duckdb.connect().execute(
        "SELECT id FROM read_parquet(?)", [paths]).fetchall()) == \
        n_rows.column("id").to_pylist()
    pruned = list(n_tbl.scan(row_filter="s == 'x/y=z'").plan_files())  # by partition value
    assert 0 < len(pruned) < len(paths) // 3
    assert n_tbl.scan(row_filter="s == 'x/y=z'").to_arrow().num_rows == 10
    assert tables["n"].in_doubt("nat") == []
    assert not list((tmp_path / "n").rglob("_spark-*"))


def test_iceberg_transforms_in_spark_as_pyiceberg(spark: Any) -> None:
    """The derived columns' Spark SQL against pyiceberg's own transforms, at the edges
    (a microsecond before 1970 and before a day, an hour, a month, a year), in a session
    time zone that is not UTC (Iceberg's ``timestamptz`` transforms are UTC's); a
    ``timestamp`` without zone (TIMESTAMP_NTZ) and a ``date`` too."""
    from pyiceberg import types as t
    from pyiceberg.transforms import parse_transform

    from twophase.sinks.iceberg.native import _expr

    instants = ["1969-12-31 23:59:59.999999", "1970-01-01 00:00:00", "1968-02-29 13:30:00",
                "2024-12-31 23:59:59.999999", "2025-01-01 00:00:00", "2026-03-29 01:59:59"]
    cases = [("ts", t.TimestamptzType(), "TIMESTAMP'{}Z'"),
             ("ntz", t.TimestampType(), "TIMESTAMP_NTZ'{}'"),
             ("d", t.DateType(), "DATE'{}'")]
    epoch = dt.datetime(1970, 1, 1)
    zone = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        for column, ice_type, literal in cases:
            for name in ("year", "month", "day", "hour"):
                expr = _expr(name, column, ice_type)
                if ice_type == t.DateType() and name == "hour":
                    assert expr is None
                    continue
                assert expr is not None
                values = [v[:10] if column == "d" else v for v in instants]
                rows = ", ".join(f"({literal.format(v)})" for v in values)
                got = [r[0] for r in spark.sql(
                    f"SELECT {expr} FROM VALUES {rows} AS v({column})").collect()]
                unit = dt.timedelta(days=1) if column == "d" else dt.timedelta(microseconds=1)
                raw = [(dt.datetime.fromisoformat(v) - epoch) // unit for v in values]
                want = [parse_transform(name).transform(ice_type)(x) for x in raw]
                assert got == want, (column, name, values)
    finally:
        spark.conf.set("spark.sql.session.timeZone", zone)
