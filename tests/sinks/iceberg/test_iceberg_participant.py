"""IcebergParticipant beyond the kit: one snapshot per batch with its marker, lost commit
races, complete mode, schema misfits and evolution, partitioned tables, a warehouse on
the S3-API server, and the rows read back independently by DuckDB."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from tests.sinks.iceberg.iceberg_support import IcebergTarget
from twophase.errors import InvalidRequest
from twophase.participant import BranchRef, BranchStatus, rebuild
from twophase.protocol import TxnKey
from twophase.sinks.iceberg import IcebergParticipant
from twophase.sinks.iceberg.marker import commit_base

SCHEMA = pa.schema([("id", pa.int64()), ("country", pa.string()),
                    ("ts", pa.timestamp("us", tz="UTC"))])
T0 = dt.datetime(2026, 3, 1, 22, 0, tzinfo=dt.timezone.utc)


def rows(batch: int, partition: int, n: int = 50) -> pa.RecordBatch:
    base = batch * 100_000 + partition * 1_000
    return pa.RecordBatch.from_pylist(
        [{"id": base + i, "country": ("fr", "de", "jp")[i % 3],
          "ts": T0 + dt.timedelta(hours=i)} for i in range(n)], schema=SCHEMA)


@pytest.fixture
def target() -> Iterator[IcebergTarget]:
    t = IcebergTarget()
    yield t
    t.close()


def run_batch(p: IcebergParticipant, lineage: str, batch: int, partitions: int = 3,
              attempt: int = 0, n: int = 50) -> TxnKey:
    """Prepare every branch as the tasks would, then commit the batch as the driver."""
    handles = {}
    for part in range(partitions):
        ref = BranchRef("orders", lineage, batch, attempt, p.name, part)
        handles[part] = p.prepare(ref, SCHEMA, [rows(batch, part, n)])
    key = TxnKey("orders", lineage, batch, attempt)
    p.commit_batch(key, handles)
    return key


def ids(t: IcebergTarget) -> list[int]:
    return sorted(r["id"] for r in t.rows())


def ours(t: IcebergTarget) -> list[Any]:
    return [s for s in t.snapshots() if s.summary["twophase.sink"] == "orders"]


def test_one_snapshot_per_batch_with_its_marker(target: IcebergTarget) -> None:
    p = target.participant()
    p.check(SCHEMA)
    for batch in range(3):
        key = run_batch(p, "lin-a", batch)
        p.commit_batch(key, {})  # again, as a recovery would: nothing new
        p.commit_batch(key, {0: {}, 1: {}, 2: {}})
    snaps = ours(target)
    assert len(snaps) == 3
    assert [s.summary.operation.value for s in snaps] == ["append"] * 3
    assert [(s.summary["twophase.lineage"], s.summary["twophase.batch"],
             s.summary["twophase.attempt"], s.summary["twophase.participant"],
             s.summary["twophase.partitions"]) for s in snaps] == [
        ("lin-a", str(b), "0", "ice", "0-2") for b in range(3)]
    assert ids(target) == sorted(r["id"] for b in range(3) for part in range(3)
                                 for r in rows(b, part).to_pylist())
    back = p.read_back("id")
    assert (back.commits, back.extra_commits, back.prepared) == (3, 0, 0)
    assert sorted(back.values) == ids(target)


def test_a_later_attempt_never_commits_a_committed_batch_again(target: IcebergTarget) -> None:
    p = target.participant()
    p.check(SCHEMA)
    run_batch(p, "lin-a", 0, attempt=0)
    # a second attempt of the same batch writes nothing and commits nothing
    run_batch(p, "lin-a", 0, attempt=1)
    assert len(ours(target)) == 1
    assert len(ids(target)) == 150
    for part in range(3):
        assert p.status(BranchRef("orders", "lin-a", 0, 1, "ice", part)) is \
            BranchStatus.COMMITTED


def test_superseded_attempt_is_swept_and_never_committed(target: IcebergTarget) -> None:
    p = target.participant()
    p.check(SCHEMA)
    stale = BranchRef("orders", "lin-a", 0, 0, "ice", 1)
    p.prepare(stale, SCHEMA, [rows(0, 1)])  # attempt 0 aborted, its files left behind
    run_batch(p, "lin-a", 0, attempt=1)
    assert p.status(stale) is BranchStatus.PREPARED
    assert p.in_doubt("orders") == [stale]
    assert p.read_back("id").prepared == 1
    p.abort(stale, None)
    assert p.in_doubt("orders") == []
    assert len(ids(target)) == 150


class Racing(IcebergParticipant):
    """Runs ``race`` right after commit_batch read the table: another writer commits
    between our read and our commit, so our commit loses the optimistic race."""

    race: Callable[[], None] | None = None

    def _load(self) -> Any:
        tbl = super()._load()
        race, self.race = self.race, None
        if race is not None:
            race()
        return tbl


def racing(target: IcebergTarget) -> Racing:
    return Racing(target.table, target.catalog, name="ice")


def test_concurrent_append_between_prepare_and_commit(target: IcebergTarget) -> None:
    p = racing(target)
    p.check(SCHEMA)
    handles = {part: p.prepare(BranchRef("orders", "lin-a", 0, 0, "ice", part), SCHEMA,
                               [rows(0, part)]) for part in range(2)}
    other = pa.Table.from_batches([rows(9, 9, 5)])
    p.race = lambda: target.load().append(other)  # a plain pyiceberg writer
    p.commit_batch(TxnKey("orders", "lin-a", 0, 0), handles)
    assert p.race is None  # the race ran, our first commit lost it
    expect = sorted([r["id"] for part in range(2) for r in rows(0, part).to_pylist()]
                    + other.column("id").to_pylist())
    assert ids(target) == expect
    assert len(ours(target)) == 1 and len(target.snapshots()) == 2


def test_lost_race_against_the_same_batch_is_not_applied_twice(target: IcebergTarget) -> None:
    p = racing(target)
    p.check(SCHEMA)
    handles = {part: p.prepare(BranchRef("orders", "lin-a", 0, 0, "ice", part), SCHEMA,
                               [rows(0, part)]) for part in range(2)}
    key = TxnKey("orders", "lin-a", 0, 0)
    # twophase resolve (another process) commits the very batch between our read and commit
    p.race = lambda: target.participant().commit_batch(key, handles)
    p.commit_batch(key, handles)
    assert len(ours(target)) == 1
    assert len(ids(target)) == 100


def test_a_commit_on_a_trimmed_base_keeps_the_whole_history(target: IcebergTarget) -> None:
    """The snapshot is computed against the table's heads only (``commit_base``): what
    lands is the catalog's full metadata plus it, other writers' snapshots and a tag on
    an old one included."""
    p = target.participant()
    p.check(SCHEMA)
    run_batch(p, "lin-a", 0)
    first = target.load().current_snapshot().snapshot_id
    target.load().manage_snapshots().create_tag(first, "first").commit()
    target.load().append(pa.Table.from_batches([rows(9, 9, 5)]))  # another writer
    for batch in (1, 2, 3):
        run_batch(p, "lin-a", batch)
    md = target.load().metadata
    snaps = md.snapshots
    assert len(snaps) == 5 and len(ours(target)) == 4
    assert [s.parent_snapshot_id for s in snaps] == [None] + [s.snapshot_id for s in snaps[:-1]]
    assert [s.sequence_number for s in snaps] == [1, 2, 3, 4, 5]
    assert [e.snapshot_id for e in md.snapshot_log] == [s.snapshot_id for s in snaps]
    assert len(md.metadata_log) >= 6  # create, 4 batches, the other append (and the tag)
    assert md.refs["first"].snapshot_id == first
    assert int(snaps[-1].summary["total-records"]) == 4 * 150 + 5
    assert len(ids(target)) == 4 * 150 + 5
    base = commit_base(target.load(), trim=True).metadata  # the heads, retry off
    assert {s.snapshot_id for s in base.snapshots} == {first, snaps[-1].snapshot_id}
    assert (base.snapshot_log, base.metadata_log) == ([], [])
    assert base.properties["commit.retry.num-retries"] == "0"


def test_complete_mode_replaces_the_rows_in_one_snapshot(target: IcebergTarget) -> None:
    target.options = {"mode": "complete"}
    p = target.participant()
    p.check(SCHEMA)
    run_batch(p, "lin-a", 0, n=50)
    run_batch(p, "lin-a", 1, n=20)
    assert ids(target) == sorted(r["id"] for part in range(3)
                                 for r in rows(1, part, 20).to_pylist())
    snaps = ours(target)
    assert [s.summary.operation.value for s in snaps] == ["append", "overwrite"]
    assert len(target.snapshots()) == 2
    run_batch(p, "lin-a", 1, n=20)  # replayed: no third snapshot
    assert len(target.snapshots()) == 2


def test_schema_misfit_is_refused_before_anything_is_written(target: IcebergTarget) -> None:
    target.participant().check(SCHEMA)
    wider = SCHEMA.append(pa.field("amount", pa.float64()))
    with pytest.raises(InvalidRequest, match=r"amount.*add_columns"):
        target.participant().check(wider)
    retyped = pa.schema([("id", pa.string()), ("country", pa.string()),
                         ("ts", pa.timestamp("us", tz="UTC"))])
    with pytest.raises(InvalidRequest, match=r"column types differ"):
        target.participant().check(retyped)
    assert target.snapshots() == []
    assert target.load().schema().as_arrow().names == SCHEMA.names


def test_add_columns_evolves_the_schema(target: IcebergTarget) -> None:
    p = target.participant()
    p.check(SCHEMA)
    run_batch(p, "lin-a", 0, partitions=1, n=3)
    wider = SCHEMA.append(pa.field("amount", pa.float64()))
    target.options = {"on_schema_change": "add_columns"}
    q = target.participant()
    q.check(wider)
    assert target.load().schema().as_arrow().names == [*SCHEMA.names, "amount"]
    batch = pa.RecordBatch.from_pylist([{"id": 7, "country": "fr", "ts": T0, "amount": 1.5}],
                                       schema=wider)
    h = q.prepare(BranchRef("orders", "lin-a", 1, 0, "ice", 0), wider, [batch])
    q.commit_batch(TxnKey("orders", "lin-a", 1, 0), {0: h})
    got = {r["id"]: r["amount"] for r in target.rows()}
    assert got == {0: None, 1: None, 2: None, 7: 1.5}


def test_add_columns_adds_a_non_nullable_stream_column_as_optional(
        target: IcebergTarget) -> None:
    """Spark's ``lit(...)`` column is non-nullable; rows already in the table lack it, so
    the table's new column is optional (pyiceberg refuses to add a required one)."""
    p = target.participant()
    p.check(SCHEMA)
    run_batch(p, "lin-a", 0, partitions=1, n=2)
    wider = SCHEMA.append(pa.field("note", pa.string(), nullable=False))
    target.options = {"on_schema_change": "add_columns"}
    q = target.participant()
    q.check(wider)
    assert not target.load().schema().find_field("note").required
    batch = pa.RecordBatch.from_pylist([{"id": 7, "country": "fr", "ts": T0, "note": "x"}],
                                       schema=wider)
    h = q.prepare(BranchRef("orders", "lin-a", 1, 0, "ice", 0), wider, [batch])
    q.commit_batch(TxnKey("orders", "lin-a", 1, 0), {0: h})
    assert {r["id"]: r["note"] for r in target.rows()} == {0: None, 1: None, 7: "x"}


def test_partitioned_by_identity_and_day(target: IcebergTarget) -> None:
    target.options = {"partition_by": ["country", "day(ts)"], "target_file_bytes": 4096}
    p = target.participant()
    p.check(SCHEMA)
    tbl = target.load()
    assert [(str(f.transform), f.name) for f in tbl.spec().fields] == [
        ("identity", "country"), ("day", "ts_day")]
    run_batch(p, "lin-a", 0, partitions=2, n=60)  # 60 hours from 22:00 UTC: 4 days
    tbl = target.load()
    tasks = list(tbl.scan().plan_files())
    seen = set()
    for task in tasks:
        part = task.file.partition
        seen.add((part[0], part[1]))
        data = duckdb.sql(f"SELECT country, CAST(ts AS DATE) d FROM read_parquet('{task.file.file_path}')").fetchall()  # noqa: E501
        assert {c for c, _ in data} == {part[0]}, "a data file spans partitions"
        assert {(d - dt.date(1970, 1, 1)).days for _, d in data} == {part[1]}
    expect = {(r["country"], (r["ts"].date() - dt.date(1970, 1, 1)).days)
              for part in range(2) for r in rows(0, part, 60).to_pylist()}
    assert seen == expect and len(expect) == 11  # 60 hours from 22:00 UTC touch 4 days
    assert ids(target) == sorted(r["id"] for part in range(2)
                                 for r in rows(0, part, 60).to_pylist())
    # a filter on the partition prunes files
    pruned = list(tbl.scan(row_filter="country == 'jp'").plan_files())
    assert 0 < len(pruned) < len(tasks)
    # an existing table with another spec is a clear error
    with pytest.raises(InvalidRequest, match=r"partitioned by \[identity\(country\), day\(ts\)\]"):
        IcebergParticipant(target.table, target.catalog, partition_by=["country"]).check(SCHEMA)


def test_rows_read_back_by_duckdb_match_pyiceberg(target: IcebergTarget) -> None:
    p = target.participant()
    p.check(SCHEMA)
    for batch in range(3):
        run_batch(p, "lin-a", batch)
    # an unreferenced prepared branch sits in the data folder: readers must not see it
    p.prepare(BranchRef("orders", "lin-a", 3, 0, "ice", 0), SCHEMA, [rows(3, 0)])
    tbl = target.load()
    paths = [t.file.file_path.removeprefix("file://") for t in tbl.scan().plan_files()]
    assert len(paths) == 9
    con = duckdb.connect()
    by_duck = sorted(r[0] for r in con.execute(
        "SELECT id FROM read_parquet(?)", [paths]).fetchall())
    assert by_duck == ids(target) == sorted(p.read_back("id").values)
    assert len(by_duck) == len(set(by_duck)) == 450


def test_warehouse_on_the_s3_api_server(s3: Any, s3_bucket: str) -> None:
    catalog = {"type": "sql", "uri": f"sqlite:///{uuid.uuid4().hex}.db",
               "warehouse": f"s3://{s3_bucket}/ice-{uuid.uuid4().hex[:8]}",
               "s3.endpoint": s3.endpoint, "s3.access-key-id": s3.access_key,
               "s3.secret-access-key": s3.secret_key, "s3.region": s3.region}
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        catalog["uri"] = f"sqlite:///{os.path.join(tmp, 'cat.db')}"
        target = IcebergTarget(catalog)
        try:
            p = target.participant()
            p.check(SCHEMA)
            key = run_batch(p, "lin-s3", 0)
            stale = BranchRef("orders", "lin-s3", 1, 0, "ice", 0)
            p.prepare(stale, SCHEMA, [rows(1, 0)])
            assert p.status(stale) is BranchStatus.PREPARED
            assert p.in_doubt("orders") == [stale]
            p.commit_batch(key, {})
            assert len(ours(target)) == 1 and len(ids(target)) == 150
            assert target.load().location().startswith("s3://")
            # rebuilt from its descriptor, the secret from the environment's place
            d = p.descriptor()
            assert s3.secret_key not in repr(d)
            q = rebuild(d, {"s3.secret-access-key": s3.secret_key})
            q.abort(stale, None)
            assert q.in_doubt("orders") == []
            assert sorted(q.read_back("id").values) == ids(target)
        finally:
            target.close()


def test_bad_arguments_are_refused() -> None:
    cat = {"type": "sql", "uri": "sqlite:///:memory:", "warehouse": "file:///tmp/x"}
    for table in ("noname", "a.b c", "../x.y", ""):
        with pytest.raises(InvalidRequest, match=r"namespace\.name"):
            IcebergParticipant(table, cat)
    with pytest.raises(InvalidRequest, match="mode"):
        IcebergParticipant("a.b", cat, mode="upsert")
    with pytest.raises(InvalidRequest, match="partition field"):
        IcebergParticipant("a.b", cat, partition_by=["bucket(16, id)"])
    with pytest.raises(InvalidRequest, match="catalog"):
        IcebergParticipant("a.b", {})


def test_a_second_prepare_of_a_branch_never_touches_the_first(target: IcebergTarget) -> None:
    """A Spark task retry (or a speculative copy) prepares the same branch and attempt
    again while the driver commits the first run's vote: each run has its own files."""
    p = target.participant()
    p.check(SCHEMA)
    ref = BranchRef("orders", "lin-a", 0, 0, "ice", 0)
    first = p.prepare(ref, SCHEMA, [rows(0, 0)])
    second = p.prepare(ref, SCHEMA, [rows(0, 0)])
    assert first["run"] != second["run"]
    p.commit_batch(ref.key, {0: first})
    assert ids(target) == [r["id"] for r in rows(0, 0).to_pylist()]
    assert p.status(ref) is BranchStatus.COMMITTED
    # committed from the record alone (no vote): one complete run, never both
    other = IcebergTarget()
    try:
        q = other.participant()
        q.check(SCHEMA)
        r2 = BranchRef("orders", "lin-b", 0, 0, "ice", 0)
        q.prepare(r2, SCHEMA, [rows(0, 0)])
        q.prepare(r2, SCHEMA, [rows(0, 0)])
        q.commit_batch(r2.key, {0: {}})
        assert ids(other) == [r["id"] for r in rows(0, 0).to_pylist()]
    finally:
        other.close()


def test_descriptor_keeps_secrets_out() -> None:
    cat = {"type": "sql", "uri": "postgresql://u:hunter2@db/cat", "warehouse": "s3://b/w",
           "s3.access-key-id": "AK", "s3.secret-access-key": "SK", "name": "prod"}
    p = IcebergParticipant("shop.orders", cat, name="lake", mode="complete",
                           partition_by=["country", "day(ts)"])
    d = p.descriptor()
    assert "hunter2" not in repr(d) and "SK" not in repr(d)
    assert d["options"]["secrets"] == "s3.secret-access-key,uri"
    q = rebuild(d, {"uri": cat["uri"], "s3.secret-access-key": "SK"})
    assert isinstance(q, IcebergParticipant)
    assert (q.catalog_props, q.catalog_name, q.mode, q.partition_by, q.table) == (
        {k: v for k, v in cat.items() if k != "name"}, "prod", "complete",
        (("identity", "country"), ("day", "ts")), "shop.orders")
    with pytest.raises(InvalidRequest, match="TWOPHASE_SECRET_LAKE_URI"):
        rebuild(d, {"s3.secret-access-key": "SK"})
