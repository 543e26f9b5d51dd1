"""The files participant's side of the native data path, on real files and without Spark:
a folder laid out as Spark's Parquet writer leaves it (``part-NNNNN-<uuid>-c000`` files,
``.crc`` litter) is adopted as the attempt's staged branches under the Python path's
names; a folder never adopted (a driver killed mid-write) reads as PREPARED, is found
by ``in_doubt`` and swept by ``abort``."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from twophase.errors import InvalidRequest
from twophase.participant import BranchRef, BranchStatus, native_eligible
from twophase.protocol import TxnKey
from twophase.sinks.files import STAGING_DIR, StagedFileParticipant

KEY = TxnKey("s", "lin-1", 4, 2)


def _spark_like(p: StagedFileParticipant, rows: dict[int, int]) -> Path:
    """A write folder as Spark leaves it: partition -> row count (0 writes an empty file)."""
    where = Path(p.native_location(KEY))
    where.mkdir(parents=True)
    job = uuid.uuid4()
    for partition, n in rows.items():
        name = f"part-{partition:05d}-{job}-c000.snappy.parquet"
        pq.write_table(pa.table({"id": list(range(n))}, schema=pa.schema([("id", pa.int64())])),
                       where / name)
        (where / f".{name}.crc").write_bytes(b"crc")
    return where


def _ref(p: StagedFileParticipant, partition: int, attempt: int = KEY.attempt) -> BranchRef:
    return BranchRef(*KEY._replace(attempt=attempt), participant=p.name, partition=partition)


def test_eligibility_and_override(tmp_path: Path) -> None:
    assert native_eligible(StagedFileParticipant(str(tmp_path / "a")))
    assert native_eligible(StagedFileParticipant(str(tmp_path / "a"), native=True))
    assert not native_eligible(StagedFileParticipant(str(tmp_path / "a"), native=False))
    assert not native_eligible(StagedFileParticipant(str(tmp_path / "a"), "jsonl"))

    class OwnPrepare(StagedFileParticipant):
        def prepare(self, branch: Any, schema: Any, batches: Any) -> Any:  # its own way
            return super().prepare(branch, schema, batches)

    assert not native_eligible(OwnPrepare(str(tmp_path / "a")))  # writes its own way
    assert native_eligible(OwnPrepare(str(tmp_path / "a"), native=True))
    with pytest.raises(InvalidRequest, match="native=True needs format='parquet'"):
        StagedFileParticipant(str(tmp_path / "a"), "jsonl", native=True)
    with pytest.raises(InvalidRequest, match="native must be"):
        StagedFileParticipant(str(tmp_path / "a"), native="yes")  # type: ignore[arg-type]


def test_adopt_stages_spark_files_under_the_python_paths_names(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path / "out"))
    p.probe()
    where = _spark_like(p, {0: 3, 1: 0, 3: 5})
    handles = p.adopt(KEY, 4)
    assert sorted(handles) == [0, 3]  # the zero-row file is an empty branch: nothing staged
    assert handles[3]["rows"] == "5" and handles[3]["state"] == "prepared"
    assert not where.exists()  # the folder, its empty file and the .crc litter are gone
    staged = sorted(f.name for f in (tmp_path / "out" / STAGING_DIR).iterdir())
    assert staged == sorted(p.staged_name(_ref(p, i)) for i in (0, 3))
    for i in (0, 3):
        assert p.status(_ref(p, i)) == BranchStatus.PREPARED
        p.commit(_ref(p, i), handles[i])
    assert p.read_back("id").values == (0, 1, 2, 0, 1, 2, 3, 4)
    assert p.in_doubt("s") == []


def test_adopt_finds_a_committed_branch_by_its_final_name(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path / "out"))
    p.probe()
    pq.write_table(pa.table({"id": [7]}), p.final_path(_ref(p, 0)))  # committed before
    _spark_like(p, {0: 2})
    assert p.adopt(KEY, 1)[0]["state"] == "already-committed"
    back = p.read_back("id")
    assert (back.values, back.prepared) == ((7,), 0)


def test_a_write_folder_never_adopted_is_prepared_found_and_swept(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path / "out"))
    p.probe()
    where = _spark_like(p, {0: 2, 1: 2})
    assert p.status(_ref(p, 1)) == BranchStatus.PREPARED
    assert p.status(_ref(p, 1, attempt=1)) == BranchStatus.ABSENT  # another attempt's
    assert p.in_doubt("s") == [_ref(p, 0)]
    assert p.in_doubt("other") == []
    assert p.read_back("id").prepared == 1
    p.abort(_ref(p, 0), None)
    assert not where.exists()
    assert p.status(_ref(p, 1)) == BranchStatus.ABSENT
    assert p.in_doubt("s") == []


def test_adopt_refuses_two_files_of_one_partition(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path / "out"))
    p.probe()
    where = _spark_like(p, {0: 1})
    pq.write_table(pa.table({"id": [9]}), where / f"part-00000-{uuid.uuid4()}-c001.snappy.parquet")
    with pytest.raises(Exception, match="one file per task expected"):
        p.adopt(KEY, 1)


def test_which_path_each_participant_takes(tmp_path: Path) -> None:
    from twophase.engine.native import split_native
    from twophase.sinks.postgres import PostgresParticipant

    auto = StagedFileParticipant(str(tmp_path / "a"))
    asked = StagedFileParticipant(str(tmp_path / "b"), native=True)
    python = StagedFileParticipant(str(tmp_path / "c"), native=False)
    pg = PostgresParticipant(dsn="postgresql://localhost/x", table="t")
    assert split_native([auto, asked]) == ((auto, asked), ())  # all native
    assert split_native([auto, pg]) == ((), (auto, pg))  # beside Python: asked only
    assert split_native([asked, auto, python]) == ((asked,), (auto, python))
