"""DeltaParticipant against real Delta tables (deltalake) on local disk and on the
suite's S3-API server: the conformance kit, one version per batch carrying Delta's own
app transaction, lost races, complete mode, schema fit, and DuckDB as an independent
reader of the files the table references."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from twophase.errors import InvalidRequest
from twophase.participant import BranchRef, BranchStatus, Participant, rebuild
from twophase.protocol import TxnKey
from twophase.sinks.delta import DeltaParticipant, app_id
from twophase.testing.conformance import Harness, applicable_checks, batch_for, make_branch

SCHEMA = pa.schema([("id", pa.int64()), ("label", pa.string()), ("amount", pa.float64())])


class DeltaTarget:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="twophase-delta-"))
        self.path = str(self.root / "table")

    def participant(self) -> Participant:
        return DeltaParticipant(self.path, name="dl")

    def rows(self) -> list[dict[str, Any]]:
        if not DeltaTable.is_deltatable(self.path):
            return []
        return DeltaTable(self.path).to_pyarrow_table().to_pylist()

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


HARNESS = Harness(id="delta", new_target=DeltaTarget)


@pytest.mark.parametrize("check", applicable_checks(HARNESS), ids=lambda c: c.__name__)
def test_conformance(check: Any) -> None:
    check(HARNESS)


@pytest.fixture
def table(tmp_path: Path) -> Iterator[DeltaParticipant]:
    p = DeltaParticipant(str(tmp_path / "orders"), name="dl")
    p.check(SCHEMA)
    yield p
    p.close()


def _prepare(p: DeltaParticipant, b: BranchRef, n: int = 5) -> dict[str, str]:
    return dict(p.prepare(b, SCHEMA, [batch_for(b, n)]))


def _ids(path: str) -> list[int]:
    return sorted(DeltaTable(path).to_pyarrow_table(columns=["id"]).column("id").to_pylist())


def _duckdb_ids(dt: DeltaTable) -> list[int]:
    import duckdb

    files = dt.file_uris()
    if not files:
        return []
    rows = duckdb.sql(f"SELECT id FROM read_parquet({files!r})").fetchall()
    return sorted(r[0] for r in rows)


def test_one_version_per_batch_with_delta_app_transaction(table: DeltaParticipant) -> None:
    key = TxnKey("orders", "L-one", 0, 1)
    branches = [BranchRef(*key, "dl", p) for p in range(3)]
    handles = {b.partition: _prepare(table, b) for b in branches}
    before = DeltaTable(table.path).version()
    assert all(table.status(b) == BranchStatus.PREPARED for b in branches)
    assert _ids(table.path) == []  # prepared files are referenced by no version
    table.commit_batch(key, handles)
    table.commit_batch(key, handles)  # idempotent through the app transaction
    dt = DeltaTable(table.path)
    assert dt.version() == before + 1
    assert dt.transaction_version(app_id("orders", "L-one")) == 0
    info = dt.history(1)[0]
    assert (info["twophase.batch"], info["twophase.attempt"]) == ("0", "1")
    assert all(table.status(b) == BranchStatus.COMMITTED for b in branches)
    ids = sorted(r["id"] for b in branches for r in batch_for(b, 5).to_pylist())
    assert _ids(table.path) == ids == _duckdb_ids(dt)
    back = table.read_back("id")
    assert (back.commits, back.extra_commits, back.prepared) == (1, 0, 0)
    # a replayed prepare of a committed batch writes nothing
    assert _prepare(table, BranchRef("orders", "L-one", 0, 2, "dl", 0))["files"] == "[]"
    assert table.in_doubt("orders") == []


def test_a_superseded_attempts_files_are_swept(table: DeltaParticipant) -> None:
    old = BranchRef("orders", "L-sw", 0, 1, "dl", 0)
    _prepare(table, old)
    new = BranchRef("orders", "L-sw", 0, 2, "dl", 0)
    table.commit_batch(new.key, {0: _prepare(table, new)})
    assert table.status(new) == BranchStatus.COMMITTED
    assert table.status(old) == BranchStatus.PREPARED  # files nobody will commit
    assert table.in_doubt("orders") == [old]
    assert table.read_back("id").prepared == 1
    table.abort(old, None)
    assert table.status(old) == BranchStatus.COMMITTED  # swept; attempt 2 has the batch
    assert table.in_doubt("orders") == [] and table.read_back("id").prepared == 0
    assert len(_ids(table.path)) == 5


def test_a_lost_race_with_another_writer_is_retried_once(table: DeltaParticipant) -> None:
    key = TxnKey("orders", "L-race", 0, 1)
    handle = _prepare(table, BranchRef(*key, "dl", 0))
    # another writer lands a version between our read and our commit
    real = DeltaParticipant._table
    raced = {"done": False}

    def stale(self: DeltaParticipant) -> Any:
        dt = real(self)
        if not raced["done"]:
            raced["done"] = True
            write_deltalake(self.path, pa.table({"id": [10**9], "label": ["other"],
                                                 "amount": [1.0]}, schema=SCHEMA),
                            mode="append")
        return dt

    DeltaParticipant._table = stale  # type: ignore[method-assign]
    try:
        table.commit_batch(key, {0: handle})
    finally:
        DeltaParticipant._table = real  # type: ignore[method-assign]
    ids = _ids(table.path)
    assert len(ids) == 6 and ids.count(10**9) == 1
    assert table.read_back("id").extra_commits == 0


def test_the_same_batch_committed_from_two_processes_lands_once(
    table: DeltaParticipant,
) -> None:
    key = TxnKey("orders", "L-two", 0, 1)
    handles = {p: _prepare(table, BranchRef(*key, "dl", p)) for p in range(2)}
    code = (
        "import json,sys\n"
        "from twophase.sinks.delta import DeltaParticipant\n"
        "from twophase.protocol import TxnKey\n"
        "p = DeltaParticipant(sys.argv[1], name='dl')\n"
        "h = {int(k): v for k, v in json.loads(sys.argv[2]).items()}\n"
        "p.commit_batch(TxnKey('orders', 'L-two', 0, 1), h)\n"
    )
    import json

    procs = [subprocess.Popen([sys.executable, "-c", code, table.path, json.dumps(handles)])
             for _ in range(3)]
    assert [p.wait(120) for p in procs] == [0, 0, 0]
    assert len(_ids(table.path)) == 10
    assert table.read_back("id").extra_commits == 0


def test_complete_mode_replaces_the_rows_in_one_version(tmp_path: Path) -> None:
    p = DeltaParticipant(str(tmp_path / "counts"), name="dl", mode="complete")
    p.check(SCHEMA)
    for batch in range(2):
        key = TxnKey("counts", "L-c", batch, 1)
        b = BranchRef(*key, "dl", 0)
        p.commit_batch(key, {0: dict(p.prepare(b, SCHEMA, [batch_for(b, 3)]))})
        assert _ids(p.path) == [r["id"] for r in batch_for(b, 3).to_pylist()]
    assert DeltaTable(p.path).version() == 2  # create + one per batch
    assert p.read_back("id").prepared == 0


def test_a_misfit_table_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"id": pa.array(["1"], pa.string())}))
    p = DeltaParticipant(path, name="dl")
    with pytest.raises(InvalidRequest, match=r"does not fit the existing table: columns not "
                       r"in the table: label, amount; column types differ: id \(table string, "
                       r"stream int64\)\. Fix: select and cast"):
        p.check(SCHEMA)
    assert DeltaTable(path).version() == 0


def test_add_columns_evolves_the_table(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"id": pa.array([1], pa.int64())}))
    with pytest.raises(InvalidRequest, match="on_schema_change='add_columns'"):
        DeltaParticipant(path, name="dl").check(SCHEMA)
    p = DeltaParticipant(path, name="dl", on_schema_change="add_columns")
    p.check(SCHEMA)
    key = TxnKey("s", "L-add", 0, 1)
    b = BranchRef(*key, "dl", 0)
    p.commit_batch(key, {0: dict(p.prepare(b, SCHEMA, [batch_for(b, 2)]))})
    rows = DeltaTable(path).to_pyarrow_table().to_pylist()
    assert len(rows) == 3 and {"id", "label", "amount"} == set(rows[0])


def test_spark_timestamps_in_a_session_zone_land_as_utc(tmp_path: Path) -> None:
    import datetime as dt

    schema = pa.schema([("id", pa.int64()), ("ts", pa.timestamp("us", tz="Etc/UTC"))])
    p = DeltaParticipant(str(tmp_path / "t"), name="dl")
    p.check(schema)
    at = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc)
    key = TxnKey("s", "L-ts", 0, 1)
    b = BranchRef(*key, "dl", 0)
    rows = pa.RecordBatch.from_pylist([{"id": 1, "ts": at}], schema=schema)
    p.commit_batch(key, {0: dict(p.prepare(b, schema, [rows]))})
    assert DeltaTable(p.path).to_pyarrow_table().to_pylist() == [{"id": 1, "ts": at}]


def test_a_table_on_the_s3_api_server(s3: Any, s3_bucket: str) -> None:
    opts = {
        "AWS_ENDPOINT_URL": s3.endpoint, "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key, "AWS_REGION": s3.region,
        "AWS_ALLOW_HTTP": "true", "AWS_S3_ALLOW_UNSAFE_RENAME": "true",
    }
    path = f"s3://{s3_bucket}/lake/orders"
    p = DeltaParticipant(path, storage_options=opts, name="dl")
    p.check(SCHEMA)
    key = TxnKey("orders", "L-s3", 0, 1)
    handles = {i: _prepare(p, BranchRef(*key, "dl", i)) for i in range(2)}
    assert p.in_doubt("orders") == [BranchRef(*key, "dl", 0), BranchRef(*key, "dl", 1)]
    # rebuilt from the coordinator's record, the secret from the environment's side
    desc = p.descriptor()
    assert s3.secret_key not in repr(desc)
    again = rebuild(desc, {"AWS_SECRET_ACCESS_KEY": s3.secret_key})
    # branch 1 without its vote: found by name, its add action from the object's footer
    again.commit_batch(key, {0: handles[0], 1: {}})  # type: ignore[attr-defined]
    dt = DeltaTable(path, storage_options=opts)
    assert len(dt.to_pyarrow_table().to_pylist()) == 10
    assert [a["num_records"] for a in pa.table(dt.get_add_actions(flatten=True)).to_pylist()
            ] == [5, 5]
    assert p.in_doubt("orders") == [] and p.read_back("id").commits == 1


def test_hostile_paths_and_options_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="s3:// URIs"):
        DeltaParticipant("http://example/t")
    with pytest.raises(InvalidRequest, match="mode must be one of append, complete"):
        DeltaParticipant("/tmp/x", mode="merge")
    with pytest.raises(InvalidRequest, match="invalid participant name"):
        DeltaParticipant("/tmp/x", name="../etc")
    with pytest.raises(InvalidRequest, match="invalid lineage"):
        make_branch(DeltaParticipant("/tmp/x", name="dl"), lineage="a/../b")


def test_stats_in_the_add_actions_serve_readers_filters(table: DeltaParticipant) -> None:
    key = TxnKey("orders", "L-st", 0, 1)
    handles = {p: _prepare(table, BranchRef(*key, "dl", p), 6) for p in range(2)}
    # partition 1 committed from its footer only (a recovery that lost the vote)
    table.commit_batch(key, {0: handles[0], 1: {}})
    dt = DeltaTable(table.path)
    adds = sorted(pa.table(dt.get_add_actions(flatten=True)).to_pylist(),
                  key=lambda a: a["path"])
    by_branch = [sorted(r["id"] for r in batch_for(BranchRef(*key, "dl", p), 6).to_pylist())
                 for p in range(2)]
    assert [(a["num_records"], a["min.id"], a["max.id"], a["null_count.label"])
            for a in adds] == [(6, ids[0], ids[-1], 1) for ids in by_branch]
    lo = by_branch[1][0]
    got = dt.to_pyarrow_table(columns=["id"], filters=[("id", ">=", lo)]).column("id")
    assert sorted(got.to_pylist()) == [i for ids in by_branch for i in ids if i >= lo]


def test_a_partitioned_table(tmp_path: Path) -> None:
    schema = pa.schema([("id", pa.int64()), ("region", pa.string()), ("day", pa.date32())])
    path = str(tmp_path / "parts")
    p = DeltaParticipant(path, name="dl", partition_by=["region", "day"])
    p.check(schema)
    assert DeltaTable(path).metadata().partition_columns == ["region", "day"]
    import datetime as dt

    d1, d2 = dt.date(2026, 1, 1), dt.date(2026, 1, 2)
    rows = [{"id": i, "region": ["eu", "us", None][i % 3], "day": [d1, d2][i % 2]}
            for i in range(12)]
    key = TxnKey("s", "L-part", 0, 1)
    b0, b1 = BranchRef(*key, "dl", 0), BranchRef(*key, "dl", 1)
    h0 = dict(p.prepare(b0, schema, [pa.RecordBatch.from_pylist(rows[:6], schema=schema),
                                     pa.RecordBatch.from_pylist(rows[6:9], schema=schema)]))
    p.prepare(b1, schema, [pa.RecordBatch.from_pylist(rows[9:], schema=schema)])
    assert len(json.loads(h0["files"])) == 6  # one file per (region, day) the branch met
    p.commit_batch(key, {0: h0, 1: {}})  # branch 1 found by name, values from its footers
    table = DeltaTable(path)
    got = sorted(table.to_pyarrow_table().to_pylist(), key=lambda r: r["id"])
    assert got == rows
    adds = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    assert {(a["partition.region"], a["partition.day"]) for a in adds} == {
        (r, d) for r in ("eu", "us", None) for d in (d1, d2)}
    eu = table.to_pyarrow_table(filters=[("region", "=", "eu")]).column("id").to_pylist()
    assert sorted(eu) == [r["id"] for r in rows if r["region"] == "eu"]
    # a sink partitioned otherwise does not fit; neither does a type Delta cannot partition by
    with pytest.raises(InvalidRequest, match=r"the table is partitioned by \['region', "
                       r"'day'\], the sink by \['day'\]"):
        DeltaParticipant(path, name="dl", partition_by=["day"]).check(schema)
    ts = pa.schema([("id", pa.int64()), ("amount", pa.float64())])
    with pytest.raises(InvalidRequest, match=r"partition columns must be integers, strings, "
                       r"booleans or dates: amount \(double\)"):
        DeltaParticipant(str(tmp_path / "t2"), name="dl", partition_by="amount").check(ts)
    with pytest.raises(InvalidRequest, match="invalid partition column"):
        DeltaParticipant(path, name="dl", partition_by=["a/b"])


def test_stats_are_whole_or_only_the_row_count(tmp_path: Path) -> None:
    """delta-rs's reader skips a file for a filter on a column without min/max when the
    file has stats for others: so every column gets a range (timestamps as milliseconds,
    max rounded up), or the file gets only its row count (NaN, infinities, strings over
    32 characters). Filters on every column then find every row."""
    import datetime as dt

    utc = dt.timezone.utc
    schema = pa.schema([("id", pa.int64()), ("label", pa.string()), ("amount", pa.float64()),
                        ("ok", pa.bool_()), ("ts", pa.timestamp("us", tz="UTC")),
                        ("local", pa.timestamp("us")), ("day", pa.date32())])
    t1 = dt.datetime(2026, 1, 1, 0, 0, 0, 123456, tzinfo=utc)
    t2 = dt.datetime(2026, 1, 2, 0, 0, 0, 999999, tzinfo=utc)
    good = [{"id": 1, "label": "a", "amount": 1.5, "ok": True, "ts": t1,
             "local": t1.replace(tzinfo=None), "day": dt.date(2026, 1, 1)},
            {"id": 2, "label": None, "amount": 7.0, "ok": None, "ts": t2,
             "local": t2.replace(tzinfo=None), "day": None}]
    bad = [dict(good[0], id=3, label="x" * 40), dict(good[1], id=4, amount=float("nan")),
           dict(good[1], id=5, amount=float("inf"))]
    p = DeltaParticipant(str(tmp_path / "t"), name="dl")
    p.check(schema)
    key = TxnKey("s", "L-st2", 0, 1)
    handles = {}
    for i, rows in enumerate([good, bad[:1], bad[1:2], bad[2:]]):
        b = BranchRef(*key, "dl", i)
        handles[i] = dict(p.prepare(b, schema, [pa.RecordBatch.from_pylist(rows, schema=schema)]))
    p.commit_batch(key, handles)
    table = DeltaTable(p.path)
    adds = sorted(pa.table(table.get_add_actions(flatten=True)).to_pylist(),
                  key=lambda a: a["path"])
    whole = adds[0]
    assert (whole["min.id"], whole["max.id"], whole["null_count.ok"]) == (1, 2, 1)
    assert (whole["min.ts"], whole["max.ts"]) == (
        dt.datetime(2026, 1, 1, 0, 0, 0, 123000, tzinfo=utc),
        dt.datetime(2026, 1, 2, 0, 0, 1, tzinfo=utc))  # rounded down / up to milliseconds
    assert [a["num_records"] for a in adds] == [2, 1, 1, 1]
    assert all(a.get("min.id") is None and a.get("null_count.id") is None for a in adds[1:])
    every = good + bad

    def found(column: str, op: str, value: Any) -> list[int]:
        got = table.to_pyarrow_table(columns=["id"], filters=[(column, op, value)])
        return sorted(got.column("id").to_pylist())

    def want(pred: Any) -> list[int]:
        return sorted(r["id"] for r in every if pred(r))

    assert found("label", ">", "b") == want(lambda r: r["label"] is not None and r["label"] > "b")
    assert found("amount", ">", 6.0) == [2, 5]
    assert found("ok", "=", True) == want(lambda r: r["ok"] is True)
    later = dt.datetime(2026, 1, 2, 0, 0, 0, 999500, tzinfo=utc)
    assert found("ts", ">", later) == want(lambda r: r["ts"] > later)
    assert found("local", ">", later.replace(tzinfo=None)) == want(lambda r: r["ts"] > later)
    assert found("day", "=", dt.date(2026, 1, 1)) == want(lambda r: r["day"] is not None)
    assert found("id", ">", 1) == [2, 3, 4, 5]


def test_too_many_files_to_vote_are_found_by_name(tmp_path: Path) -> None:
    p = DeltaParticipant(str(tmp_path / "t"), name="dl", target_file_bytes=1024)
    p.check(SCHEMA)
    key = TxnKey("s", "L-many", 0, 1)
    b = BranchRef(*key, "dl", 0)
    pieces = [batch_for(BranchRef("s", "L-many", i, 1, "dl", 0), 6) for i in range(60)]
    handle = dict(p.prepare(b, SCHEMA, pieces))
    assert handle["files"] == "*" and handle["rows"] == "360"
    p.commit_batch(key, {0: handle})
    dt = DeltaTable(p.path)
    on_disk = list(Path(p.path).glob("twophase-s/L-many/*/dl-*.parquet"))
    assert len(on_disk) >= 10 and len(dt.file_uris()) == len(on_disk)
    assert sum(pa.table(dt.get_add_actions(flatten=True)).column("num_records").to_pylist()
               ) == 360 == len(_ids(p.path)) == len(_duckdb_ids(dt))
    assert p.status(b) == BranchStatus.COMMITTED and p.in_doubt("s") == []


def test_complete_mode_on_a_partitioned_table(tmp_path: Path) -> None:
    schema = pa.schema([("region", pa.string()), ("n", pa.int64())])
    p = DeltaParticipant(str(tmp_path / "c"), name="dl", mode="complete", partition_by="region")
    p.check(schema)
    for batch, counts in enumerate([{"eu": 1, "us": 2}, {"eu": 3, "apac": 4}]):
        key = TxnKey("s", "L-cp", batch, 1)
        b = BranchRef(*key, "dl", 0)
        rows = pa.RecordBatch.from_pylist([{"region": r, "n": n} for r, n in counts.items()],
                                          schema=schema)
        p.commit_batch(key, {0: dict(p.prepare(b, schema, [rows]))})
        got = DeltaTable(p.path).to_pyarrow_table().to_pylist()
        assert {r["region"]: r["n"] for r in got} == counts and len(got) == len(counts)
    assert DeltaTable(p.path).version() == 2


def test_delta_rs_reader_skips_files_with_partial_stats(tmp_path: Path) -> None:
    """Why stats are whole or nothing: delta-rs's reader skips a file, for a filter on a
    column without min/max, when the file has min/max for another column (rows lost);
    with the row count alone it reads the file. If this starts failing, delta-rs fixed
    it and partial stats become safe."""
    import os
    import time

    import pyarrow.parquet as pq
    from deltalake.transaction import AddAction

    schema = pa.schema([("id", pa.int64()), ("label", pa.string())])
    rows = pa.table({"id": [1, 2], "label": ["x" * 40, "b"]}, schema=schema)

    def labels_after_a(stats: dict[str, Any]) -> list[int]:
        path = str(tmp_path / f"t{len(stats)}")
        DeltaTable.create(path, schema=schema)
        pq.write_table(rows, f"{path}/f.parquet")
        DeltaTable(path).create_write_transaction(
            [AddAction("f.parquet", os.path.getsize(f"{path}/f.parquet"), {},
                       int(time.time() * 1000), True, json.dumps(stats))], "append", schema)
        got = DeltaTable(path).to_pyarrow_table(columns=["id"], filters=[("label", ">", "a")])
        return sorted(got.column("id").to_pylist())

    assert labels_after_a({"numRecords": 2}) == [1, 2]
    assert labels_after_a({"numRecords": 2, "minValues": {"id": 1},
                           "maxValues": {"id": 2}}) == []
