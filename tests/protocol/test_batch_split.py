"""How the sink splits a batch into partitions: Spark's own split (no shuffle) only where
a replay of the batch splits it the same way, proven here by replaying batches."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from twophase import TransactionalSink
from twophase.client.wire import VoteIn
from twophase.protocol import Decision
from twophase.sinks.files import StagedFileParticipant
from twophase.spark.split import input_partitions as _input_partitions
from twophase.testing.job import EVENT_DDL, write_input

pytestmark = pytest.mark.spark


def _run(spark: Any, inp: Path, ckpt: Path, sink: TransactionalSink) -> None:
    try:
        q = (spark.readStream.schema(EVENT_DDL).option("maxFilesPerTrigger", 2)
             .parquet(str(inp)).writeStream.foreachBatch(sink)
             .option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start())
        q.awaitTermination()
    finally:
        sink.close()


def _partitions(out: Path) -> dict[tuple[int, int], list[int]]:
    """(batch, partition) -> the ids of that branch's committed file, in file order."""
    got: dict[tuple[int, int], list[int]] = {}
    for f in sorted(out.glob("part-*.parquet")):
        m = re.search(r"-(\d{20})-.+-(\d{5})$", f.stem)
        assert m, f.name
        batch, partition = int(m[1]), int(m[2])
        got[(batch, partition)] = pq.read_table(f).column("id").to_pylist()
    return got


def test_replayed_batches_split_the_same_rows_into_the_same_partitions(
    spark: Any, tmp_path: Path
) -> None:
    inp, ckpt = tmp_path / "in", tmp_path / "ckpt"
    write_input(inp, batches=4, rows_per_batch=300)  # 2 files per batch: 2 input partitions
    first = TransactionalSink("split_a", [StagedFileParticipant(str(tmp_path / "a"))],
                              f"sqlite:///{tmp_path / 'a.db'}")
    _run(spark, inp, ckpt, first)
    assert [(r.rows, r.partitions, r.split) for r in first.history] == [(600, 2, "input")] * 2
    # Spark forgets it finished batch 1 and runs it again from the offset log, as after a
    # crash; a second sink (same query lineage) writes the replay somewhere else.
    for name in ("1", ".1.crc"):
        (ckpt / "commits" / name).unlink()
    again = TransactionalSink("split_b", [StagedFileParticipant(str(tmp_path / "b"))],
                              f"sqlite:///{tmp_path / 'b.db'}")
    _run(spark, inp, ckpt, again)
    assert [(r.batch_id, r.split) for r in again.history] == [(1, "input")]
    a, b = _partitions(tmp_path / "a"), _partitions(tmp_path / "b")
    assert sorted(a) == [(0, 0), (0, 1), (1, 0), (1, 1)] and sorted(b) == [(1, 0), (1, 1)]
    assert {k: v for k, v in a.items() if k[0] == 1} == b  # same rows, partition, order
    # no shuffle: each partition is one input file's rows, in the file's order
    files = {tuple(pq.read_table(f).column("id").to_pylist()) for f in inp.glob("*.parquet")}
    assert {tuple(ids) for ids in a.values()} == files


def test_plans_with_a_shuffle_or_a_union_keep_the_hash_split(spark: Any) -> None:
    df = spark.range(100)
    assert _input_partitions(df) is not None
    assert _input_partitions(df.groupBy((df.id % 3).alias("k")).count()) is None
    assert _input_partitions(df.union(spark.range(5))) is None
    assert _input_partitions(df.repartition(3)) is None


def test_a_durable_sink_keeps_the_querys_own_split(spark: Any) -> None:
    """A sink whose prepares are durable writes a shuffled batch (a stateful
    aggregation's ``spark.sql.shuffle.partitions``) with the split Spark made: no second
    shuffle by every column."""
    df = spark.range(100)
    counts = df.groupBy((df.id % 3).alias("k")).count()
    shuffled = int(spark.conf.get("spark.sql.shuffle.partitions"))
    assert _input_partitions(counts, any_split=True) == counts.rdd.getNumPartitions()
    assert counts.rdd.getNumPartitions() in (shuffled, 1)  # AQE may coalesce a batch plan
    assert _input_partitions(df.repartition(7), any_split=True) == 7
    assert _input_partitions(df.union(spark.range(5)), any_split=True) == (
        df.rdd.getNumPartitions() + spark.range(5).rdd.getNumPartitions())
    # local rows: the one case where the answer is not the partition count
    assert _input_partitions(spark.createDataFrame([], "id long"), any_split=True) == 0
    rows = spark.createDataFrame([(1,), (2,)], "id long")
    assert _input_partitions(rows, any_split=True) == rows.rdd.getNumPartitions() > 0


def test_an_empty_relation_commits_without_a_spark_job(spark: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # preflight=False: the executors' check is one Spark job per sink start, not per
    # batch (tests/spark/test_user_job.py covers it); this test counts the batch's own jobs.
    sink = TransactionalSink("empty_rel", [StagedFileParticipant(str(out))],
                             f"sqlite:///{tmp_path / 'c.db'}", lineage="batch-job-1",
                             preflight=False)
    empty = spark.createDataFrame([], EVENT_DDL)
    sc = spark.sparkContext
    sc.setJobGroup("twophase-empty-relation", "empty")
    try:
        sink(empty, 0)
        jobs = sc.statusTracker().getJobIdsForGroup("twophase-empty-relation")
    finally:
        sc.setJobGroup("", "")
        sink.close()
    assert jobs == []
    assert [(r.outcome, r.rows, r.split) for r in sink.history] == [("committed", 0, "none")]
    assert not list(out.glob("part-*"))


@contextlib.contextmanager
def _begun_by_hand(tmp_path: Path, sink: str, partitions: int) -> Iterator[Any]:
    """Batch 0 of ``sink`` begun by hand on the coordinator a sink of the same store URL
    will use, for one files participant: (store URL, participant, client, epoch, the
    attempt's record)."""
    from twophase.client.connection import connect

    url = f"sqlite:///{tmp_path / 'c.db'}"
    files = StagedFileParticipant(str(tmp_path / "out"))
    conn = connect(url)
    try:
        client = conn.client()
        epoch = client.register(sink)
        res = client.begin(sink, "lineage-" + sink.replace("_", "-"), 0, epoch, [files.name],
                           partitions, 30.0)
        assert res.txn is not None and res.txn.attempt == 1
        yield url, files, client, epoch, res.txn
    finally:
        conn.close()


def test_an_empty_relations_retry_aborts_the_failed_attempts_branch_without_a_job(
        spark: Any, tmp_path: Path) -> None:
    """Attempt 1 of an empty relation's batch left a branch prepared and was abandoned
    (ABORT, nothing acknowledged): the driver's empty vote for attempt 2 first aborts
    that branch by name and acknowledges it, as a task would, and still runs no Spark
    job."""
    from twophase.participant import BranchRef, BranchStatus

    # two branches, one voted: the attempt stays undecided until it is abandoned
    with _begun_by_hand(tmp_path, "empty_retry", 2) as (url, files, client, epoch, txn):
        ref = BranchRef(*txn.key, participant=files.name, partition=0)
        schema = pa.schema([("id", pa.int64())])
        first = files.prepare(ref, schema, [pa.record_batch({"id": [1]}, schema=schema)])
        client.vote(txn.key, epoch, [VoteIn(branch=f"{files.name}/0", yes=True,
                                            handle=dict(first))])
        client.abandon(txn.key, epoch, "the test's failed attempt")
        assert files.status(ref) is BranchStatus.PREPARED
        sink = TransactionalSink("empty_retry", [files], url, lineage=txn.lineage,
                                 preflight=False)
        sc = spark.sparkContext
        sc.setJobGroup("twophase-empty-retry", "empty")
        try:
            sink(spark.createDataFrame([], EVENT_DDL), 0)
            jobs = sc.statusTracker().getJobIdsForGroup("twophase-empty-retry")
        finally:
            sc.setJobGroup("", "")
            sink.close()
        assert jobs == []
        [report] = sink.history
        assert (report.outcome, report.rows, report.split, report.recovered) == (
            "committed", 0, "none", 1)
        assert files.status(ref) is BranchStatus.ABSENT
        assert client.get(txn.key).branches[f"{files.name}/0"].ack == Decision.ABORT
        assert not list((tmp_path / "out").rglob("*.parquet"))


def test_an_empty_relations_batch_found_in_doubt_is_finished_and_acknowledged(
        spark: Any, tmp_path: Path) -> None:
    """A driver died after its empty batch's votes decided COMMIT, before the acks: the
    restart finishes it as any in-doubt batch (nothing to redo, the driver acknowledges
    every branch) and writes nothing."""
    from twophase.participant import EMPTY_BRANCH

    with _begun_by_hand(tmp_path, "empty_doubt", 1) as (url, files, client, epoch, txn):
        decided = client.vote(txn.key, epoch, [VoteIn(
            branch=f"{files.name}/0", yes=True, handle={**EMPTY_BRANCH, "split": "none"})])
        assert decided.decision == Decision.COMMIT
        sink = TransactionalSink("empty_doubt", [files], url, lineage=txn.lineage,
                                 preflight=False)
        try:
            sink(spark.createDataFrame([], EVENT_DDL), 0)
        finally:
            sink.close()
        assert [(r.outcome, r.rows) for r in sink.history] == [("recovered", 0)]
        assert [s.ack for s in client.get(txn.key).branches.values()] == [Decision.COMMIT]
        assert not list((tmp_path / "out").rglob("*.parquet"))


def test_an_empty_partition_writes_no_file(spark: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = TransactionalSink("one_row", [StagedFileParticipant(str(out))],
                             f"sqlite:///{tmp_path / 'd.db'}", lineage="batch-job-2",
                             partitions=2)
    df = spark.createDataFrame(pa.table({"id": [7]}).to_pandas())
    try:
        sink(df, 0)
    finally:
        sink.close()
    assert [(r.outcome, r.rows, r.partitions) for r in sink.history] == [("committed", 1, 2)]
    files = list(out.glob("part-*"))
    assert len(files) == 1 and pq.read_table(files[0]).column("id").to_pylist() == [7]


def test_pyspark_41s_utc_schema_gets_the_session_zone_nested_too() -> None:
    # pyspark < 4.2's to_arrow_schema has no ``timezone`` and says UTC; the tasks'
    # batches carry the session zone (bench/tables_vs_spark.py runs on pyspark 4.1)
    from twophase.spark.compat import in_zone

    utc = pa.timestamp("us", tz="UTC")
    got = in_zone(pa.schema([("ts", utc), ("s", pa.struct([("t", utc)])),
                              ("l", pa.list_(utc)), ("m", pa.map_(pa.string(), utc)),
                              ("n", pa.timestamp("us")), ("id", pa.int64())]), "Asia/Tokyo")
    tokyo = pa.timestamp("us", tz="Asia/Tokyo")
    assert got == pa.schema([("ts", tokyo), ("s", pa.struct([("t", tokyo)])),
                             ("l", pa.list_(tokyo)), ("m", pa.map_(pa.string(), tokyo)),
                             ("n", pa.timestamp("us")), ("id", pa.int64())])
