"""A partitioned Iceberg table on the native data path, without Spark: Spark partitions
by hidden derived columns (``__twophase_p<i>``: an identity string's MD5, the time
transforms' ordinals) and keeps the source columns in the files; ``adopt`` checks each
file's one partition value (from its footer, as the commit derives it) against its
folder, before the vote. A bucket table stays on the Python path, with the reason.
Spark computing the same values: tests/spark/test_native_tables.py."""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.sinks.iceberg.iceberg_support import local_catalog
from twophase.errors import InvalidRequest, ParticipantError
from twophase.participant import BranchRef, BranchStatus
from twophase.protocol import TxnKey
from twophase.sinks.iceberg import IcebergParticipant

SCHEMA = pa.schema([("id", pa.int64()), ("s", pa.string()),
                    ("ts", pa.timestamp("us", tz="UTC")), ("k", pa.int32())])
KEY = TxnKey("nat", "lin-1", 0, 1)
UTC = dt.timezone.utc


def _part(tmp: Path) -> IcebergParticipant:
    part = IcebergParticipant("ns.t", local_catalog(tmp), name="ice",
                              partition_by=["s", "day(ts)", "k"])
    part.check(SCHEMA)
    return part


def _folder(s: str | None, day: int | None, k: int | None) -> str:
    """The folders Spark's ``partitionBy`` makes of the derived columns."""
    null = "__HIVE_DEFAULT_PARTITION__"
    md5 = null if s is None else hashlib.md5(s.encode()).hexdigest()
    return (f"__twophase_p0={md5}/__twophase_p1={null if day is None else day}/"
            f"__twophase_p2={null if k is None else k}")


def _write(part: IcebergParticipant, key: TxnKey,
           files: list[tuple[int, str, list[tuple[Any, ...]]]]) -> Path:
    where = Path(part.native_location(key).removeprefix("file://"))
    for partition, folder, rows in files:
        (where / folder).mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pylist([dict(zip(SCHEMA.names, r, strict=True)) for r in rows],
                                     schema=SCHEMA)
        pq.write_table(table, where / folder / f"part-{partition:05d}-0f3a.c000.snappy.parquet")
    return where


def _ts(day: int, hour: int = 0) -> dt.datetime:
    return dt.datetime(1970, 1, 1, tzinfo=UTC) + dt.timedelta(days=day, hours=hour)


def test_partitioned_adopt_reads_derived_folders_and_commits_partition_values(
        tmp_path: Path) -> None:
    part = _part(tmp_path)
    assert part.native_format() == "parquet"
    assert part.native_columns() == {
        "__twophase_p0": "md5(CAST(`s` AS BINARY))",
        "__twophase_p1": "((unix_micros(`ts`) - pmod(unix_micros(`ts`), 86400000000)) "
                         "div 86400000000)",
        "__twophase_p2": "`k`"}
    assert part.native_partition_by() == ["__twophase_p0", "__twophase_p1", "__twophase_p2"]
    where = _write(part, KEY, [
        (0, _folder("a b", 20418, 1), [(1, "a b", _ts(20418, 3), 1), (2, "a b", _ts(20418), 1)]),
        (1, _folder("a b", 20418, 1), [(3, "a b", _ts(20418, 23), 1)]),
        (0, _folder("x/y=z%", -1, None), [(4, "x/y=z%", _ts(-1, 5), None)]),  # before 1970
        (1, _folder(None, None, 2), [(5, None, None, 2)]),  # null values
        (1, _folder("", 0, 2), [(6, "", _ts(0), 2)]),  # '' is not null
    ])
    assert part.status(BranchRef(*KEY, participant="ice", partition=1)) == BranchStatus.PREPARED
    handles = part.adopt(KEY, 2)
    assert not where.exists()
    assert (handles[0]["rows"], handles[1]["rows"]) == ("3", "3")
    part.commit_batch(KEY, handles)
    tbl = part._load()
    got = sorted(((tuple(t.file.partition), t.file.record_count)  # type: ignore[arg-type]
                  for t in tbl.scan().plan_files()), key=repr)
    assert got == sorted([(("a b", 20418, 1), 2), (("a b", 20418, 1), 1),
                          (("x/y=z%", -1, None), 1), ((None, None, 2), 1), (("", 0, 2), 1)],
                         key=repr)
    assert sorted(tbl.scan().to_arrow().column("id").to_pylist()) == [1, 2, 3, 4, 5, 6]
    assert len(list(tbl.scan(row_filter="s == 'a b'").plan_files())) == 2  # pruned
    assert len(list(tbl.scan(row_filter="s is null").plan_files())) == 1
    assert part.in_doubt("nat") == []


def test_partitioned_adopt_refuses_a_file_off_its_folder_and_is_swept(tmp_path: Path) -> None:
    part = _part(tmp_path)
    _write(part, KEY, [(0, _folder("a", 5, 1), [(1, "a", _ts(6), 1)])])  # day 6 under 5
    with pytest.raises(ParticipantError, match=r"value 6 of ts_day .*filed it under '5'"
                                               r".*native=False"):
        part.adopt(KEY, 1)
    part.abort(BranchRef(*KEY, participant="ice", partition=0), None)
    assert part.in_doubt("nat") == []
    key2 = TxnKey("nat", "lin-1", 0, 2)
    _write(part, key2, [(0, _folder("a", 5, 1), [(1, "a", _ts(5), 1), (2, "a", _ts(6), 1)])])
    with pytest.raises(ParticipantError, match="no one partition value"):
        part.adopt(key2, 1)  # two days in one file: the commit could not place it
    key3 = TxnKey("nat", "lin-1", 0, 3)
    _write(part, key3, [(0, "__twophase_p0=x", [(1, "a", _ts(5), 1)])])
    with pytest.raises(ParticipantError, match=r"not in the folders __twophase_p0=\.\.\./"):
        part.adopt(key3, 1)


def test_bucket_stays_on_the_python_path_with_the_reason(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.schema import Schema
    from pyiceberg.transforms import BucketTransform
    from pyiceberg.types import LongType, NestedField

    part = IcebergParticipant("ns.b", local_catalog(tmp_path), name="ice")
    part._cat().create_namespace("ns")
    part._cat().create_table("ns.b", Schema(NestedField(1, "id", LongType())),
                             partition_spec=PartitionSpec(PartitionField(
                                 source_id=1, field_id=1000, transform=BucketTransform(4),
                                 name="id_bucket")))
    caplog.set_level(logging.INFO, logger="twophase")
    assert part.native_format() is None
    assert part.native_format() is None
    said = [r.getMessage() for r in caplog.records if "native path" in r.getMessage()]
    assert len(said) == 1 and "(bucket[4] of id)" in said[0], said  # once, with the cause
    assert part._native_why == (
        "partition field id_bucket (bucket[4] of id) is not one Spark computes as Iceberg "
        "does (the native path writes identity, year, month, day and hour of a top-level "
        "column)")
    with pytest.raises(InvalidRequest, match=r"native=True, but partition field id_bucket "
                                             r"\(bucket\[4\] of id\).*Fix: drop native=True"):
        IcebergParticipant("ns.b", local_catalog(tmp_path), native=True).native_format()
