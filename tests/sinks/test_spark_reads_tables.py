"""Spark's own connectors read the tables twophase writes (issue 32).

A streaming query writes a Delta table and an Iceberg table through one
TransactionalSink (2 partitions, 4 micro-batches, partitioned by ``region``, a column
``note`` added from batch 2 on: ``on_schema_change="add_columns"``). Then ONE Spark
process of its own, with Spark's Delta connector (``delta-spark``) and Iceberg's Spark
runtime from Maven Central (tests/support/spark_connectors.py: a Spark those are built
for), reads both, and what it reads is compared with the rows the input holds and with
delta-rs, pyiceberg and DuckDB:

- the same rows, in the evolved schema (nulls for ``note`` before the change);
- Delta: one version per batch (time travel to each); ``DESCRIBE DETAIL``; partition
  pruning (the scan's PartitionFilters and files read) and data skipping on the add
  actions' statistics (a filter on ``id`` or ``ts`` reads only the files whose range
  holds it), from a delta-rs log checkpoint (batches 0-1) and JSON commits (2-3);
  the app transaction: Spark's writer with ``txnAppId`` = the sink's app id skips a
  ``txnVersion`` twophase committed and applies the next (delta-rs then sees it too);
- Iceberg, through a JDBC catalog over pyiceberg's SQLite catalog: one snapshot per
  batch with the summary naming sink, lineage and batch, each snapshot read by time
  travel, partition and statistics pruning as pyiceberg plans it.

The Iceberg table's data files are written by Spark's own Parquet writer (the native
path, ``native=True``), the Delta table's by the Python path (``native=False``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from tests.sinks.iceberg.iceberg_support import local_catalog
from tests.support.spark_connectors import spark_read
from twophase.sinks.delta import DeltaParticipant, app_id
from twophase.sinks.iceberg import IcebergParticipant
from twophase.testing.job import write_input

pytestmark = pytest.mark.spark

SINK, BATCHES, ROWS, CHANGE_AT, CHECKPOINT_AFTER = "sparkreads", 4, 30, 2, 1
COLUMNS = [["id", "bigint"], ["customer", "string"], ["amount", "double"],
           ["ts", "timestamp"], ["region", "string"], ["note", "string"]]
PROBE_ID = 41  # batch 1, region r2
PROBE_TS = dt.datetime(2026, 1, 1, 0, 0, PROBE_ID, tzinfo=dt.timezone.utc)  # its ts
FILTERS = {"region": "region = 'r1'", "id": f"id = {PROBE_ID}",
           "ts": f"ts = timestamp'{PROBE_TS:%Y-%m-%d %H:%M:%S}'"}  # the reader's zone: UTC


def _expected() -> list[list[Any]]:
    """What the input holds (twophase.testing.job.write_input), as each batch was sent."""
    base = dt.datetime(2026, 1, 1)
    return [[i, f"customer-{i % 97}", (i % 10_000) / 100,
             (base + dt.timedelta(seconds=i)).strftime("%Y-%m-%d %H:%M:%S.%f"), f"r{i % 3}",
             f"b{i // ROWS}" if i // ROWS >= CHANGE_AT else None]
            for i in range(BATCHES * ROWS)]


def _plain(records: list[dict[str, Any]]) -> list[list[Any]]:
    out = []
    for r in sorted(records, key=lambda r: int(r["id"])):
        row: list[Any] = [r.get(c) for c, _ in COLUMNS]
        row[3] = r["ts"].astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")
        out.append(row)
    return out


def _duckdb_ids(paths: list[str]) -> list[int]:
    return sorted(r[0] for r in duckdb.connect().execute(
        "SELECT id FROM read_parquet(?)", [paths]).fetchall())


def _write(spark: Any, tmp_path: Path, delta: DeltaParticipant,
           ice: IcebergParticipant) -> None:
    from pyspark.sql import functions as F

    from twophase import TransactionalSink

    write_input(tmp_path / "in", batches=BATCHES, rows_per_batch=ROWS)
    sink = TransactionalSink(SINK, [delta, ice], f"sqlite:///{tmp_path / 'coord.db'}",
                             partitions=2)

    def each(df: Any, batch_id: int) -> None:
        out = df.select("id", "customer", F.col("amount").cast("double").alias("amount"),
                        "ts", F.concat(F.lit("r"), (F.col("id") % 3).cast("string"))
                        .alias("region"))
        if batch_id >= CHANGE_AT:
            out = out.withColumn("note", F.lit(f"b{batch_id}"))
        sink(out, batch_id)
        if batch_id == CHECKPOINT_AFTER:
            # a log checkpoint by delta-rs (as its post-commit hook writes one every 100
            # versions): Spark then reads batches 0-1's add actions (statistics) from the
            # checkpoint's Parquet and the later ones from the JSON commits
            from deltalake import DeltaTable

            DeltaTable(delta.path).create_checkpoint()

    q = (spark.readStream.schema("id long, customer string, amount decimal(12,2), ts timestamp")
         .option("maxFilesPerTrigger", 1).parquet(str(tmp_path / "in"))
         .writeStream.foreachBatch(each).option("checkpointLocation", str(tmp_path / "ckpt"))
         .trigger(availableNow=True).start())
    q.awaitTermination(300)
    sink.close()
    assert q.exception() is None
    assert [r.outcome for r in sink.history] == ["committed"] * BATCHES


@dataclass(frozen=True)
class Read:
    """The tables as twophase left them (delta-rs's add actions, pyiceberg's table) and
    what the one Spark process read of them."""

    delta_path: str
    app: str  # the sink's Delta app id
    adds: list[dict[str, Any]]
    lineage: str
    catalog: dict[str, str]
    spark: dict[str, Any]

    def ice(self) -> Any:
        from pyiceberg.catalog import load_catalog

        props = dict(self.catalog)
        return load_catalog(props.pop("name"), **props).load_table("shop.orders")


@pytest.fixture(scope="module")
def read(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Read:
    from deltalake import DeltaTable

    tmp_path = tmp_path_factory.mktemp("spark-reads")
    delta_path = str(tmp_path / "lake" / "orders")
    catalog = {**local_catalog(tmp_path / "ice"), "name": "lake"}
    # Delta on the Python path (its native files of a table with a double column carry
    # only numRecords: no data skipping to check), Iceberg on the native path (Spark
    # partitions by a derived column, region's MD5, and region stays in the files)
    delta = DeltaParticipant(delta_path, name="dl", partition_by=["region"],
                             on_schema_change="add_columns", native=False)
    ice = IcebergParticipant("shop.orders", catalog, name="ice", partition_by=["region"],
                             on_schema_change="add_columns", native=True)
    assert (delta.native_format(), ice.native_format()) == (None, "parquet")
    _write(spark, tmp_path, delta, ice)
    dt_ = DeltaTable(delta_path)
    [lineage] = {i["twophase.lineage"] for i in dt_.history() if i.get("twophase.sink") == SINK}
    adds = pa.table(dt_.get_add_actions(flatten=True)).to_pylist()
    row = {"customer": "spark", "amount": 1.5, "ts": "2026-02-01 00:00:00", "region": "r0",
           "note": "spark"}
    got = spark_read({
        "delta": {"path": delta_path, "filters": FILTERS, "app_id": app_id(SINK, lineage),
                  "committed_batch": BATCHES - 1, "replay_id": 100_000, "new_id": 200_000,
                  "row": row},
        "iceberg": {"catalog": "lake", "table": "shop.orders",
                    "uri": f"jdbc:sqlite:{tmp_path / 'ice' / 'catalog.db'}",
                    "warehouse": catalog["warehouse"], "filters": FILTERS},
    }, tmp_path / "spark-reader.log")
    return Read(delta_path, app_id(SINK, lineage), adds, lineage, catalog, got)


def _delta_rs_rows(path: str, version: int) -> list[list[Any]]:
    from deltalake import DeltaTable

    return _plain(DeltaTable(path, version=version).to_pyarrow_table().to_pylist())


def test_delta_rows_versions_and_schema_as_delta_rs_and_duckdb(read: Read) -> None:
    got, want = read.spark["delta"], _expected()
    last = got["versions"][-1]  # before Spark's own writes below
    assert _delta_rs_rows(read.delta_path, last) == want
    assert got["columns"] == COLUMNS
    assert got["rows"] == want
    assert _duckdb_ids([f"{read.delta_path}/{a['path']}" for a in read.adds]) == \
        [r[0] for r in want]
    log = Path(read.delta_path) / "_delta_log"
    assert [p.name for p in log.glob("*.checkpoint.parquet")] == \
        [f"{CHECKPOINT_AFTER + 1:020d}.checkpoint.parquet"]  # the create, batches 0, 1
    assert got["detail"] == {"numFiles": len(read.adds), "partitionColumns": ["region"],
                             "minReaderVersion": 1, "minWriterVersion": 2}
    # the create, batches 0 and 1, the column added (its own version, no rows), 2 and 3
    assert got["versions"] == list(range(BATCHES + 2))
    assert got["counts_by_version"] == [0, ROWS, 2 * ROWS, 2 * ROWS, 3 * ROWS, 4 * ROWS]


def test_delta_partition_pruning_and_statistics_used_by_spark(read: Read) -> None:
    got, adds = read.spark["delta"], read.adds
    # partition pruning: the region filter is a partition filter; only its files are read
    in_region = [a for a in adds if a["partition.region"] == "r1"]
    part = got["scans"]["region"]
    assert "PartitionFilters: [isnotnull(region" in part["plan"], part["plan"]
    assert part["metrics"]["numFiles"] == len(in_region) < len(adds), part["metrics"]
    # data skipping on the statistics twophase wrote: only the files whose range holds
    # the value are read (a file without statistics must be read)
    for column, value in (("id", PROBE_ID), ("ts", PROBE_TS)):
        holding = [a for a in adds if a.get(f"min.{column}") is None
                   or a[f"min.{column}"] <= value <= a[f"max.{column}"]]
        probe = got["scans"][column]
        assert probe["metrics"]["numFiles"] == len(holding) < len(adds), (column, probe)


def test_delta_app_transaction_seen_by_sparks_idempotent_writer(read: Read) -> None:
    from deltalake import DeltaTable

    got = read.spark["delta"]
    n, last = BATCHES * ROWS, got["versions"][-1]
    skipped, applied = got["txn_writes"]
    assert skipped == {"txn_version": BATCHES - 1, "rows": n, "ids": [],
                       "version": last}, skipped  # no new version
    assert applied == {"txn_version": BATCHES, "rows": n + 3,
                       "ids": [200_000, 200_001, 200_002], "version": last + 1}, applied
    after = DeltaTable(read.delta_path)  # and delta-rs and DuckDB see Spark's commit
    assert after.transaction_version(read.app) == BATCHES
    assert _duckdb_ids(after.file_uris()) == \
        [r[0] for r in _expected()] + [200_000, 200_001, 200_002]


def test_iceberg_rows_and_evolved_schema_as_pyiceberg_and_duckdb(read: Read) -> None:
    got, want, tbl = read.spark["iceberg"], _expected(), read.ice()
    assert _plain(tbl.scan().to_arrow().to_pylist()) == want
    files = [t.file.file_path.removeprefix("file://") for t in tbl.scan().plan_files()]
    assert _duckdb_ids(files) == [r[0] for r in want]
    assert [f.name for f in tbl.schema().fields] == [c for c, _ in COLUMNS]
    assert got["columns"] == COLUMNS
    assert got["rows"] == want


def test_iceberg_one_snapshot_per_batch_with_the_marker(read: Read) -> None:
    got, tbl = read.spark["iceberg"], read.ice()
    snaps = got["snapshots"]
    assert [s["id"] for s in snaps] == [s.snapshot_id for s in tbl.metadata.snapshots]
    assert [s["parent"] for s in snaps[1:]] == [s["id"] for s in snaps[:-1]]
    assert [s["operation"] for s in snaps] == ["append"] * BATCHES
    assert [{k: s["summary"].get(k) for k in ("twophase.sink", "twophase.lineage",
                                              "twophase.batch", "twophase.participant")}
            for s in snaps] == [{"twophase.sink": SINK, "twophase.lineage": read.lineage,
                                 "twophase.batch": str(b), "twophase.participant": "ice"}
                                for b in range(BATCHES)]
    assert got["counts_by_snapshot"] == [(b + 1) * ROWS for b in range(BATCHES)]


def test_iceberg_partition_and_statistics_pruning_in_spark(read: Read) -> None:
    got, tbl = read.spark["iceberg"], read.ice()
    total = len(list(tbl.scan().plan_files()))
    assert got["data_files"] == total
    part = got["scans"]["region"]
    assert "filters=region IS NOT NULL, region = 'r1'" in part["plan"], part["plan"]
    for column, pyiceberg_filter in (("region", "region == 'r1'"), ("id", f"id == {PROBE_ID}"),
                                     ("ts", f"ts == '{PROBE_TS.isoformat()}'")):
        planned = len(list(tbl.scan(row_filter=pyiceberg_filter).plan_files()))
        probe = got["scans"][column]
        assert probe["metrics"]["resultDataFiles"] == planned < total, (column, probe)
