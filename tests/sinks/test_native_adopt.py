"""The tables' side of the native data path without Spark: a write folder filled as
Spark's writer fills it (``part-NNNNN-<uuid>.parquet``, one file per task) is PREPARED
while it exists, found by ``in_doubt`` and swept by ``abort``; ``adopt`` refuses a file
that does not fit the table, naming it, before any vote; an adopted attempt commits as
one snapshot / version and reads back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.sinks.iceberg.iceberg_support import local_catalog
from twophase.errors import InvalidRequest, ParticipantError
from twophase.participant import BatchParticipant, BranchRef, BranchStatus
from twophase.protocol import TxnKey
from twophase.sinks.delta import DeltaParticipant
from twophase.sinks.iceberg import IcebergParticipant

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])
KEY = TxnKey("nat", "lin-1", 0, 1)


def _table(kind: str, tmp: Path) -> BatchParticipant:
    part: BatchParticipant
    if kind == "delta":
        part = DeltaParticipant(str(tmp / "dl"), name="dl")
    else:
        part = IcebergParticipant("ns.t", local_catalog(tmp), name="ice")
    part.check(SCHEMA)
    return part


def _spark_wrote(part: BatchParticipant, files: dict[int, pa.Table]) -> Path:
    where = Path(part.native_location(KEY).removeprefix("file://"))  # type: ignore[attr-defined]
    where.mkdir(parents=True)
    for partition, rows in files.items():
        pq.write_table(rows, where / f"part-{partition:05d}-0f3a-c000.snappy.parquet")
    (where / "._SUCCESS.crc").write_bytes(b"")  # Spark's litter
    return where


def _ref(part: BatchParticipant, partition: int) -> BranchRef:
    return BranchRef(*KEY, participant=part.name, partition=partition)


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_write_folder_is_prepared_until_adopted_then_commits_once(
        kind: str, tmp_path: Path) -> None:
    part = _table(kind, tmp_path)
    assert part.native_format() == "parquet"  # type: ignore[attr-defined]
    rows = {0: pa.table({"id": [1, 2], "name": ["a", "b"]}, schema=SCHEMA),
            2: pa.table({"id": [3], "name": ["c"]}, schema=SCHEMA),
            1: pa.table({"id": pa.array([], pa.int64()), "name": pa.array([], pa.string())})}
    where = _spark_wrote(part, rows)
    # a driver killed here: no vote; the attempt is PREPARED and found by name
    assert part.status(_ref(part, 1)) == BranchStatus.PREPARED
    assert part.in_doubt("nat") == [_ref(part, 0)]
    handles = part.adopt(KEY, 3)  # type: ignore[attr-defined]
    assert sorted(handles) == [0, 2] and handles[0]["rows"] == "2"  # no empty branch
    assert not where.exists()
    assert part.status(_ref(part, 0)) == BranchStatus.PREPARED
    part.commit_batch(KEY, handles)
    part.commit_batch(KEY, handles)  # the marker: a second commit is nothing
    back = part.read_back("id")  # type: ignore[attr-defined]
    assert sorted(back.values) == [1, 2, 3]
    assert (back.prepared, back.commits, back.extra_commits) == (0, 1, 0)
    assert part.status(_ref(part, 2)) == BranchStatus.COMMITTED
    assert part.in_doubt("nat") == []


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_misfit_is_refused_before_the_vote_and_swept(kind: str, tmp_path: Path) -> None:
    part = _table(kind, tmp_path)
    where = _spark_wrote(part, {0: pa.table({"id": ["x"], "name": ["a"]})})  # id a string
    with pytest.raises(ParticipantError, match="does not fit the table") as err:
        part.adopt(KEY, 2)  # type: ignore[attr-defined]
    assert "native=False" in str(err.value)
    assert part.status(_ref(part, 0)) == BranchStatus.PREPARED  # not adopted: still there
    part.abort(_ref(part, 0), None)  # the next attempt's settle step, or resolve
    assert not where.exists()
    assert part.in_doubt("nat") == []
    assert part.status(_ref(part, 0)) == BranchStatus.ABSENT


def test_native_true_is_refused_where_it_cannot_be(tmp_path: Path) -> None:
    ice = IcebergParticipant("ns.p", {**local_catalog(tmp_path), "warehouse": "s3://b/wh"},
                             partition_by=["id"], native=True)
    with pytest.raises(InvalidRequest, match="not on the local file system"):
        ice.native_format()  # (a bucket partition field: tests/sinks/iceberg)
    with pytest.raises(InvalidRequest, match="object storage"):
        DeltaParticipant("s3://b/t", native=True).native_format()


PARTED = pa.schema([("id", pa.int64()), ("s", pa.string()), ("day", pa.date32())])


def _parted(tmp: Path) -> DeltaParticipant:
    part = DeltaParticipant(str(tmp / "dp"), name="dp", partition_by=["s", "day"])
    part.check(PARTED)
    return part


def _spark_wrote_parted(part: DeltaParticipant, files: dict[str, dict[int, list[int]]]
                        ) -> Path:
    """Spark's ``partitionBy`` layout: ``s=<escaped>/day=<date>/part-NNNNN-...``, the
    partition columns left out of the files."""
    where = Path(part.native_location(KEY))
    for leaf, tasks in files.items():
        (where / leaf).mkdir(parents=True)
        for partition, ids in tasks.items():
            pq.write_table(pa.table({"id": pa.array(ids, pa.int64())}),
                           where / leaf / f"part-{partition:05d}-0f3a.c000.snappy.parquet")
    return where


def log_adds(path: str) -> list[dict[str, Any]]:
    """Every add action in a Delta table's JSON commits, as written."""
    return [json.loads(line)["add"] for f in sorted((Path(path) / "_delta_log").glob("*.json"))
            for line in f.read_text().splitlines() if '"add"' in line[:8]]


def _values(part: DeltaParticipant) -> list[tuple[Any, ...]]:
    from deltalake import DeltaTable

    rows = DeltaTable(part.path).to_pyarrow_table().to_pylist()
    return sorted((r["id"], r["s"], str(r["day"])) for r in rows)


def test_delta_partitioned_adopts_hive_folders_as_partition_values(tmp_path: Path) -> None:
    part = _parted(tmp_path)
    assert part.native_format() == "parquet"
    assert part.native_partition_by() == ["s", "day"]
    where = _spark_wrote_parted(part, {
        "s=a b/day=2026-01-01": {0: [1, 2], 1: [3]},
        "s=x%2Fy%3Dz/day=2026-01-02": {1: [4]},  # '/' and '=' escaped as Spark does
        "s=__HIVE_DEFAULT_PARTITION__/day=2026-01-01": {0: [5]},  # a null value
    })
    assert part.status(_ref(part, 1)) == BranchStatus.PREPARED
    assert part.in_doubt("nat") == [_ref(part, 0)]  # a kill here: found by name
    handles = part.adopt(KEY, 2)
    assert not where.exists()
    assert (handles[0]["rows"], handles[1]["rows"]) == ("3", "2")
    part.commit_batch(KEY, handles)
    assert _values(part) == [(1, "a b", "2026-01-01"), (2, "a b", "2026-01-01"),
                             (3, "a b", "2026-01-01"), (4, "x/y=z", "2026-01-02"),
                             (5, None, "2026-01-01")]
    adds = log_adds(part.path)  # as the log holds them, for every reader
    assert sorted((json.dumps(a["partitionValues"], sort_keys=True),
                   json.loads(a["stats"])["numRecords"]) for a in adds) == [
        ('{"day": "2026-01-01", "s": "a b"}', 1), ('{"day": "2026-01-01", "s": "a b"}', 2),
        ('{"day": "2026-01-01", "s": null}', 1), ('{"day": "2026-01-02", "s": "x/y=z"}', 1)]
    for a in adds:  # statistics and files hold no partition column
        assert set(json.loads(a["stats"])["minValues"]) == {"id"}
        assert pq.read_schema(f"{part.path}/{a['path']}").names == ["id"]
    assert part.in_doubt("nat") == []


def test_delta_partitioned_too_many_files_to_vote_commit_from_the_values_record(
        tmp_path: Path) -> None:
    part = _parted(tmp_path)
    leaves = {f"s=v{i:03d}/day=2026-01-01": {0: [i]} for i in range(40)}
    _spark_wrote_parted(part, leaves)
    handles = part.adopt(KEY, 1)
    assert handles[0]["files"] == "*"  # the commit finds the files by name
    record = Path(part.path) / part._rel(*KEY[:3]) / ".dp-00000-1.values.json"
    hidden = record.rename(record.with_name("elsewhere"))
    with pytest.raises(ParticipantError, match="without partition values"):
        part.commit_batch(KEY, handles)  # never into no partition
    hidden.rename(record)
    part.commit_batch(KEY, handles)
    assert _values(part) == [(i, f"v{i:03d}", "2026-01-01") for i in range(40)]
    # an aborted attempt's record goes with its files
    key2 = TxnKey("nat", "lin-1", 1, 1)
    where = Path(part.native_location(key2))
    for i in range(40):
        (where / f"s=w{i}/day=2026-01-01").mkdir(parents=True)
        pq.write_table(pa.table({"id": [i]}),
                       where / f"s=w{i}/day=2026-01-01/part-00000-1.c000.parquet")
    part.adopt(key2, 1)
    folder = Path(part.path) / part._rel(*key2[:3])
    assert (folder / ".dp-00000-1.values.json").exists()
    part.abort(BranchRef(*key2, participant="dp", partition=0), None)
    assert sorted(folder.iterdir()) == []


def test_delta_partitioned_refuses_a_foreign_layout_and_generated_columns(
        tmp_path: Path) -> None:
    from deltalake import DeltaTable, Field, Schema

    part = _parted(tmp_path)
    _spark_wrote_parted(part, {"day=2026-01-01/s=a": {0: [1]}})  # not the table's order
    with pytest.raises(ParticipantError, match=r"not in the table's partition folders s=\.\.\./"
                                               r"day=\.\.\..*native=False"):
        part.adopt(KEY, 1)
    part.abort(_ref(part, 0), None)
    assert part.status(_ref(part, 0)) == BranchStatus.ABSENT
    DeltaTable.create(str(tmp_path / "g"), schema=Schema([
        Field("a", "long"), Field("b", "long", metadata={"delta.generationExpression": "a+1"})]))
    gen = DeltaParticipant(str(tmp_path / "g"), native=True)
    with pytest.raises(InvalidRequest, match=r"generated columns \(b\).*native=True"):
        gen.native_format()
