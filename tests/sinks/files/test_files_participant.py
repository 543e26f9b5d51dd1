"""StagedFileParticipant on real files: naming, readers, bad input, hostile names."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from twophase.errors import TargetProblem, classify
from twophase.participant import BranchRef, BranchStatus, ParticipantError, PrepareRefused
from twophase.sinks.files import STAGING_DIR, StagedFileParticipant

SCHEMA = pa.schema([("id", pa.int64()), ("v", pa.float64())])


def _branch(p: StagedFileParticipant, **kw: Any) -> BranchRef:
    args: dict[str, Any] = {"sink": "s", "lineage": "lin-1", "batch_id": 0, "attempt": 0,
                            "participant": p.name, "partition": 0}
    args.update(kw)
    return BranchRef(**args)


def _batch(ids: list[int], v: float = 1.0) -> pa.RecordBatch:
    return pa.record_batch({"id": ids, "v": [v] * len(ids)}, schema=SCHEMA)


def _all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_file_names_and_handle(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path / "out"))
    assert p.name == "files-out" and p.kind == "files"
    b = _branch(p, batch_id=42, attempt=2, partition=7)
    h = p.prepare(b, SCHEMA, [_batch([1, 2])])
    staged = f"s~part-s~lin-1-{42:020d}-files-out-00007.attempt-2.parquet"
    assert dict(h) == {"kind": "files", "participant": "files-out", "staged": staged,
                       "final": f"part-s~lin-1-{42:020d}-files-out-00007.parquet",
                       "rows": "2", "state": "prepared"}
    assert _all_files(tmp_path / "out") == [f"{STAGING_DIR}/{staged}"]
    p.commit(b, h)
    assert _all_files(tmp_path / "out") == [h["final"]]


def test_default_name_is_sanitised(tmp_path: Path) -> None:
    assert StagedFileParticipant(str(tmp_path / "my orders!")).name == "files-my_orders_"
    assert StagedFileParticipant(str(tmp_path / ("x" * 200))).name == "files-" + "x" * 58


@pytest.mark.parametrize("kw", [
    {"name": "../../etc"}, {"name": "a/b"}, {"name": ".."}, {"name": ""},
    {"format": "csv"}, {"name": "x" * 65},
])
def test_hostile_names_and_bad_options_are_refused(tmp_path: Path, kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        StagedFileParticipant(str(tmp_path), **kw)


def test_nul_in_path_is_refused() -> None:
    with pytest.raises(ValueError, match="NUL"):
        StagedFileParticipant("/tmp/a\x00b")


def test_branch_parts_cannot_escape_path(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path / "out"))
    with pytest.raises(ValueError):
        _branch(p, lineage="../../x")
    with pytest.raises(ValueError, match="belongs to participant"):
        p.prepare(_branch(p, participant="other"), SCHEMA, [_batch([1])])
    assert not (tmp_path / "out").exists() or _all_files(tmp_path / "out") == []


def test_parquet_types_round_trip_and_dataset_sees_only_committed(tmp_path: Path) -> None:
    schema = pa.schema([("ts", pa.timestamp("us", tz="UTC")), ("d", pa.date32()),
                        ("dec", pa.decimal128(9, 2)), ("bin", pa.binary()), ("s", pa.string())])
    rows = [{"ts": dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc), "d": dt.date(2024, 1, 2),
             "dec": decimal.Decimal("1.25"), "bin": b"\x00", "s": 'a"\n'},
            {"ts": None, "d": None, "dec": None, "bin": None, "s": None}]
    p = StagedFileParticipant(str(tmp_path / "out"))
    p.check(schema)
    committed, pending = _branch(p), _branch(p, partition=1)
    p.commit(committed, p.prepare(committed, schema, [pa.RecordBatch.from_pylist(rows, schema)]))
    p.prepare(pending, schema, [pa.RecordBatch.from_pylist(rows, schema)])
    table = ds.dataset(str(tmp_path / "out"), format="parquet").to_table()
    assert table.schema.equals(schema) and table.to_pylist() == rows


def test_jsonl_uses_the_shared_encoding(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path / "j"), "jsonl")
    b = _branch(p)
    schema = pa.schema([("ts", pa.timestamp("ms", tz="UTC")), ("dec", pa.decimal128(5, 2))])
    batch = pa.RecordBatch.from_pylist(
        [{"ts": dt.datetime(2024, 5, 6, 7, 8, 9, tzinfo=dt.timezone.utc),
          "dec": decimal.Decimal("3.10")}], schema)
    p.commit(b, p.prepare(b, schema, [batch, batch]))
    lines = p.final_path(b).read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"ts": "2024-05-06T07:08:09.000Z", "dec": "3.10"}] * 2


def test_unserialisable_value_votes_no_and_leaves_nothing(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path / "j"), "jsonl")
    b = _branch(p)
    with pytest.raises(PrepareRefused, match=r"column 'v' row 1"):
        p.prepare(b, SCHEMA, [_batch([1]), pa.record_batch(
            {"id": [2, 3], "v": [0.5, float("nan")]}, schema=SCHEMA)])
    assert p.status(b) is BranchStatus.ABSENT and p.in_doubt("s") == []
    assert _all_files(tmp_path / "j") == []


def test_batch_with_another_schema_votes_no(tmp_path: Path) -> None:
    for fmt in ("parquet", "jsonl"):
        p = StagedFileParticipant(str(tmp_path / fmt), fmt)
        with pytest.raises(PrepareRefused, match="batch has schema"):
            p.prepare(_branch(p), SCHEMA, [_batch([1]), pa.record_batch({"id": ["x"]})])
        assert _all_files(tmp_path / fmt) == []


def test_a_crash_while_writing_leaves_no_staged_file(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path / "out"))

    def batches() -> Any:
        yield _batch([1])
        raise RuntimeError("executor lost its input")

    with pytest.raises(RuntimeError, match="executor lost"):
        p.prepare(_branch(p), SCHEMA, batches())
    assert _all_files(tmp_path / "out") == []


def test_unwritable_target_fails_check_and_votes_no(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    p = StagedFileParticipant(str(blocker / "out"))
    # permanent (issue 26): the participant, the cause, the host and the fix, no retry
    fix = r"Not a directory \(on host [^)]+\)\. Fix: pass a path this user can create"
    with pytest.raises(TargetProblem, match=r"cannot create the folder .*" + fix):
        p.check(SCHEMA)
    with pytest.raises(TargetProblem, match=r"cannot create the folder .*" + fix):
        p.prepare(_branch(p), SCHEMA, [_batch([1])])
    assert classify(TargetProblem("x")).permanent


def test_jsonl_check_refuses_types_without_json_form(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path / "j"), "jsonl")
    p.check(pa.schema([("x", pa.int64())]))
    bad = pa.schema([("a", pa.int64()), ("a", pa.int64())])
    with pytest.raises(ParticipantError, match="duplicate column"):
        p.check(bad)


def test_in_doubt_ignores_foreign_and_temporary_files(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path / "out"))
    b = _branch(p, sink="orders", partition=3)
    p.prepare(b, SCHEMA, [_batch([1])])
    staging = tmp_path / "out" / STAGING_DIR
    (staging / "README").write_text("x")
    (staging / f".{p.staged_path(b).name}.abc.tmp").write_text("half")
    (staging / "orders~part-lin-1-1-files-out-00001.attempt-0.parquet").write_text("?")
    other = StagedFileParticipant(str(tmp_path / "out"), name="other")
    other.prepare(_branch(other, sink="orders"), SCHEMA, [_batch([2])])
    assert p.in_doubt("orders") == [b]
    assert p.in_doubt("s") == []
    assert other.in_doubt("orders") == [_branch(other, sink="orders")]


def test_commit_of_aborted_branch_is_an_error(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path / "out"))
    b = _branch(p)
    p.abort(b, p.prepare(b, SCHEMA, [_batch([1])]))
    with pytest.raises(ParticipantError, match="neither the staged nor the final file"):
        p.commit(b, None)


def test_pickle_round_trip(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path / "out"), "jsonl", name="n1")
    clone = pickle.loads(pickle.dumps(p))
    assert (clone.path, clone.format, clone.name) == (p.path, "jsonl", "n1")


@pytest.mark.spark
def test_spark_reads_exactly_the_committed_rows(spark: Any, tmp_path: Path) -> None:
    for fmt in ("parquet", "jsonl"):
        out = tmp_path / fmt
        p = StagedFileParticipant(str(out), fmt)
        p.check(SCHEMA)
        done, pending = _branch(p), _branch(p, partition=1)
        p.commit(done, p.prepare(done, SCHEMA, [_batch([1, 2, 3])]))
        p.prepare(pending, SCHEMA, [_batch([10, 11])])
        assert os.listdir(out / STAGING_DIR)
        reader = spark.read.parquet if fmt == "parquet" else spark.read.json
        ids = sorted(r["id"] for r in reader(str(out)).collect())
        assert ids == [1, 2, 3], fmt
        p.abort(pending, None)
