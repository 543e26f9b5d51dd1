"""TransactionalSink end to end: real Spark (local[2]), real PostgreSQL, real files."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from twophase.protocol import State
from twophase.testing.job import (
    JobConfig,
    build_participants,
    expected_ids,
    place_batch,
    run,
    write_input,
)
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark

_ids = itertools.count()


@pytest.fixture
def job(tmp_path: Path, pg_dsn: str) -> JobConfig:
    n = next(_ids)
    return JobConfig(
        input_dir=str(tmp_path / "in"),
        checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}",
        sink=f"orders{n}",
        pg_dsn=pg_dsn,
        pg_table=f"orders_{n}",
        files_path=str(tmp_path / "out"),
        partitions=2,
        vote_timeout=60.0,
    )


def _prepared(pg_dsn: str) -> list[str]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT gid FROM pg_prepared_xacts").fetchall()]


def test_every_id_exactly_once_in_every_system(spark: Any, job: JobConfig, pg_dsn: str) -> None:
    write_input(job.input_dir, batches=3, rows_per_batch=50)
    sink = run(job, spark)
    assert [r.outcome for r in sink.history] == ["committed"] * 3
    assert sum(r.rows for r in sink.history) == 150
    report = verify(build_participants(job), expected_ids(3, 50), sink=job.sink)
    assert report.ok, report.lines()
    assert [s.rows for s in report.systems] == [150, 150]
    assert spark.read.parquet(job.files_path).count() == 150
    assert _prepared(pg_dsn) == []


def test_empty_batch_commits_and_writes_nothing(spark: Any, job: JobConfig) -> None:
    write_input(job.input_dir, batches=1, rows_per_batch=10)
    empty = pa.table({"id": pa.array([], pa.int64())})
    place_batch(job.input_dir, 1, empty)
    write_input(job.input_dir, batches=1, rows_per_batch=10, first=2)
    sink = run(job, spark)
    assert [r.rows for r in sink.history] == [10, 0, 10]
    want = list(range(10)) + list(range(20, 30))
    assert verify(build_participants(job), want, sink=job.sink).ok


def test_replay_of_committed_batch_writes_nothing(spark: Any, job: JobConfig) -> None:
    write_input(job.input_dir, batches=2, rows_per_batch=20)
    run(job, spark)
    # Forget that Spark finished batch 1: on restart Spark runs batch 1 again, as after a
    # crash between the sink's return and Spark's commit log write.
    for name in ("1", ".1.crc"):
        (Path(job.checkpoint) / "commits" / name).unlink(missing_ok=True)
    sink = run(job, spark)
    assert [(r.batch_id, r.outcome) for r in sink.history] == [(1, "replay")]
    report = verify(build_participants(job), expected_ids(2, 20), sink=job.sink)
    assert report.ok, report.lines()


def test_refused_batch_fails_query_naming_cause_and_leaves_nothing(
    spark: Any, job: JobConfig, pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {job.pg_table} (id bigint PRIMARY KEY, customer text, "
            "amount numeric(12,2), ts timestamptz)"
        )
    write_input(job.input_dir, batches=1, rows_per_batch=10)
    clash = pa.table({"id": pa.array([100, 100], pa.int64())})
    place_batch(job.input_dir, 1, clash)
    job.max_attempts = 2
    with pytest.raises(Exception) as info:
        run(job, spark, participants=None)
    message = str(info.value)
    assert "postgres-" in message and "voted NO" in message, message
    assert "duplicate key" in message or "unique" in message.lower(), message
    # batch 0 committed everywhere; batch 1 nowhere; nothing prepared
    report = verify(build_participants(job), list(range(10)), sink=job.sink)
    assert report.ok, report.lines()
    assert _prepared(pg_dsn) == []


def test_checkpoint_reset_starts_new_lineage(spark: Any, job: JobConfig) -> None:
    from twophase.coordinator.store import Store

    write_input(job.input_dir, batches=2, rows_per_batch=5)
    run(job, spark)
    job.checkpoint = job.checkpoint + "-reset"
    sink = run(job, spark)
    # batch ids restarted at 0 and were *not* skipped as already committed
    outcomes = [(r.batch_id, r.outcome) for r in sink.history]
    assert outcomes == [(0, "committed"), (1, "committed")]
    store = Store(job.coordinator)
    try:
        lineages = {row.txn.lineage for row in store.list(sink=job.sink)}
    finally:
        store.close()
    assert len(lineages) == 2
    report = verify(build_participants(job), expected_ids(2, 5), sink=job.sink)
    assert report.systems[0].duplicates == 10  # the user re-read the input: new data


def _run_job_process(
    cfg: JobConfig, tmp: Path, failpoints: str | None
) -> subprocess.CompletedProcess[str]:
    path = tmp / "job.json"
    cfg.dump(path)
    env = dict(os.environ)
    env.pop("TWOPHASE_FAILPOINTS", None)
    if failpoints:
        env["TWOPHASE_FAILPOINTS"] = failpoints
    return subprocess.run(
        [sys.executable, "-m", "twophase.testing.job", str(path)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )


@pytest.mark.parametrize("point", ["after_decision", "before_return"])
def test_driver_sigkill_then_restart_is_exactly_once(
    job: JobConfig, tmp_path: Path, pg_dsn: str, point: str
) -> None:
    write_input(job.input_dir, batches=3, rows_per_batch=30)
    killed = _run_job_process(job, tmp_path, f"{point}=kill*1")
    assert killed.returncode == -9, killed.stderr[-3000:]
    done = _run_job_process(job, tmp_path, None)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert lines[-1] == {"done": True}
    report = verify(build_participants(job), expected_ids(3, 30), sink=job.sink)
    assert report.ok, report.lines()
    assert _prepared(pg_dsn) == []


def test_two_queries_two_sinks_share_one_daemon(
    spark: Any, tmp_path: Path, pg_dsn: str
) -> None:
    from tests.coordinator.test_coordinator_daemon import TOKEN, start_daemon
    from twophase import TransactionalSink

    daemon = start_daemon(f"sqlite:///{tmp_path / 'daemon.db'}")
    try:
        queries, sinks, jobs = [], [], []
        for name in ("left", "right"):
            cfg = JobConfig(
                input_dir=str(tmp_path / name / "in"), checkpoint=str(tmp_path / name / "ckpt"),
                coordinator=daemon.url, token=TOKEN, sink=f"shared_{name}", pg_dsn=pg_dsn,
                pg_table=f"shared_{name}", files_path=str(tmp_path / name / "out"), partitions=1,
            )
            write_input(cfg.input_dir, batches=3, rows_per_batch=25)
            sink = TransactionalSink(cfg.sink, build_participants(cfg), cfg.coordinator,
                                     token=TOKEN, partitions=1)
            queries.append(
                spark.readStream.schema("id long, customer string, amount decimal(12,2), "
                                        "ts timestamp")
                .option("maxFilesPerTrigger", 1).parquet(cfg.input_dir)
                .writeStream.foreachBatch(sink).option("checkpointLocation", cfg.checkpoint)
                .trigger(availableNow=True).start()
            )
            sinks.append(sink)
            jobs.append(cfg)
        for q in queries:
            q.awaitTermination(300)
        for sink, cfg in zip(sinks, jobs, strict=True):
            sink.close()
            assert [r.outcome for r in sink.history] == ["committed"] * 3
            report = verify(build_participants(cfg), expected_ids(3, 25), sink=cfg.sink)
            assert report.ok, report.lines()
        from twophase.client.api import CoordinatorClient

        with CoordinatorClient(daemon.url, TOKEN) as client:
            for cfg in jobs:
                txns = client.list(sink=cfg.sink)
                assert len(txns) == 3 and {t.state for t in txns} == {State.COMMITTED}
    finally:
        daemon.stop()


def test_kafka_branch_over_the_wire(spark: Any, job: JobConfig, kafka_bootstrap: str) -> None:
    """Three participants including Kafka (Apache Kafka), all judged exactly-once (Kafka
    from its partition logs and a read_committed consumer, which must agree); marker
    offsets checked."""
    from confluent_kafka import Consumer, TopicPartition

    job.kafka_bootstrap = kafka_bootstrap
    job.kafka_topic = f"spark-{job.sink}"
    from tests.support.kafka import create_topic

    create_topic(kafka_bootstrap, job.kafka_topic)
    write_input(job.input_dir, batches=2, rows_per_batch=40)
    sink = run(job, spark)
    assert [r.outcome for r in sink.history] == ["committed"] * 2
    report = verify(build_participants(job), expected_ids(2, 40), sink=job.sink)
    assert report.ok, report.lines()
    kafka = next(s for s in report.systems if s.kind == "kafka")
    assert kafka.rows == 80 and kafka.exact and kafka.open_transactions == 0
    assert kafka.duplicates == kafka.missing == kafka.mismatch == 0
    assert "a read_committed consumer agrees" in kafka.note, kafka.note
    # (aborted rows are possible: a slow machine can abort an attempt at its vote deadline;
    # the retry lands the rows once and the log shows the first attempt's rows aborted)
    # each branch's marker group committed offset checkpoint+1 = 2 for the last batch
    for partition in range(2):
        group = f"twophase.{job.sink}.{_lineage(job)}.kafka-{job.kafka_topic}.{partition}"
        c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group})
        try:
            [tp] = c.committed([TopicPartition(job.kafka_topic, 0)], timeout=10)
        finally:
            c.close()
        assert tp.offset == 2, (group, tp)


def _lineage(job: JobConfig) -> str:
    from twophase.coordinator.store import Store

    store = Store(job.coordinator)
    try:
        return str(store.list(sink=job.sink)[0].txn.lineage)
    finally:
        store.close()


def test_sink_construction_checks(tmp_path: Path) -> None:
    from twophase import TransactionalSink
    from twophase.sinks.files import StagedFileParticipant
    from twophase.sinks.kafka import KafkaParticipant

    kafka = KafkaParticipant("t", {"bootstrap.servers": "127.0.0.1:1"},
                             transaction_timeout_ms=60_000)
    with pytest.raises(ValueError, match="must exceed the sink's vote window"):
        TransactionalSink("s", [kafka], "sqlite:///x.db", vote_timeout=300)
    files = StagedFileParticipant(path=str(tmp_path))
    with pytest.raises(ValueError, match="invalid lineage"):
        TransactionalSink("s", [files], "sqlite:///x.db", lineage="job_1")
    with pytest.raises(ValueError, match="unique"):
        TransactionalSink("s", [files, files], "sqlite:///x.db")


def test_a_pyspark_not_of_the_jvms_release_is_refused_before_anything_is_written(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a driver whose Python side is another Spark release than its JVM (a packed venv
    # with its own pyspark on a platform's Spark): refused at the first batch, before the
    # coordinator is started or a participant touched (twophase.spark.compat)
    import pyspark

    from twophase import TransactionalSink
    from twophase.errors import EnvironmentProblem
    from twophase.sinks.files import StagedFileParticipant

    jvm = spark.version
    other = "3.4.4" if jvm.startswith("4.") else "4.3.0"
    monkeypatch.setattr(pyspark, "__version__", other)
    store, out = tmp_path / "coord.db", tmp_path / "out"
    sink = TransactionalSink("mismatch", [StagedFileParticipant(path=str(out))],
                             coordinator=f"sqlite:///{store}")
    with pytest.raises(EnvironmentProblem) as err:
        sink(spark.range(3), 0)
    msg = str(err.value)
    assert f"pyspark {other} talks to Spark {jvm}" in msg.splitlines()[0], msg
    assert f"Fix: install pyspark=={jvm}" in msg
    assert not store.exists() and not out.exists()
    sink.close()
