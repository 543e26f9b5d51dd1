"""The tables' side of the native data path without Spark: a write folder filled as
Spark's writer fills it (``part-NNNNN-<uuid>.parquet``, one file per task) is PREPARED
while it exists, found by ``in_doubt`` and swept by ``abort``; ``adopt`` refuses a file
that does not fit the table, naming it, before any vote; an adopted attempt commits as
one snapshot / version and reads back."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.sinks.iceberg.iceberg_support import local_catalog
from twophase.errors import ParticipantError
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
    from twophase.errors import InvalidRequest

    ice = IcebergParticipant("ns.p", local_catalog(tmp_path), partition_by=["id"], native=True)
    with pytest.raises(InvalidRequest, match="partitioned"):
        ice.native_format()
    auto = DeltaParticipant(str(tmp_path / "p"), partition_by=["name"])
    assert auto.native_format() is None  # automatic: the Python path
    with pytest.raises(InvalidRequest, match="object storage"):
        DeltaParticipant("s3://b/t", native=True).native_format()
