"""Exactly once through ``writeStream.format("twophase")`` when things die: the
reference job (its own driver process, real Spark) with the data source door, writing
every participant kind at once. The whole driver (its Python, Spark's JVM and every
Python worker: the process group) is SIGKILLed while a failpoint holds it at a protocol
step; a Python worker is SIGKILLed after its prepare (Spark retries the task). Each run
restarts from its checkpoint with one more batch; at the end every id is in every system
once (Kafka judged from its partition logs and a read_committed consumer) and nothing
is left prepared: no PostgreSQL prepared transaction, no MariaDB XA branch, no staged
file, no open Kafka transaction."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest

from tests.support.driver_kill import kill_when_held, prepared, start_driver
from tests.support.kafka import create_topic, unique_topic
from twophase import failpoints
from twophase.sinks.files import STAGING_DIR
from twophase.testing.job import JobConfig, build_participants, expected_ids, write_input
from twophase.testing.verify import VerifyReport, verify

pytestmark = [pytest.mark.spark, pytest.mark.real_kafka]

ROWS = 40


def _killed_runs(cfg: JobConfig, tmp_path: Path, driver_kills: list[str],
                 worker_kill: str) -> VerifyReport:
    """One driver run per failpoint in ``driver_kills`` (each ``sleep``s where it fires),
    its process group SIGKILLed there, one more batch of input after each; then a run
    whose Python worker is SIGKILLed at ``worker_kill`` (Spark retries the task) and which
    runs to its end. Returns the verifier's report over every batch."""
    cfg_path, log = tmp_path / "job.json", tmp_path / "job.log"
    cfg.dump(cfg_path)
    write_input(cfg.input_dir, 1, ROWS)
    batches = 1
    for i, spec in enumerate(driver_kills):
        once = tmp_path / f"once{i}"
        proc = start_driver(cfg_path, {failpoints.ENV: f"{spec}=sleep(120)*1",
                                       failpoints.ONCE_DIR_ENV: str(once)}, log)
        kill_when_held(proc, once, log)
        write_input(cfg.input_dir, 1, ROWS, first=batches)
        batches += 1
    once = tmp_path / "worker"
    last = start_driver(cfg_path, {failpoints.ENV: f"{worker_kill}=kill*1",
                                   failpoints.ONCE_DIR_ENV: str(once)}, log)
    out, _ = last.communicate(timeout=600)
    assert last.returncode == 0, log.read_text()[-3000:]
    assert len(failpoints.fired(str(once))) == 1, worker_kill
    assert [json.loads(x) for x in out.splitlines() if x.startswith("{")][-1] == {"done": True}
    return verify(build_participants(cfg), expected_ids(batches, ROWS), sink=cfg.sink)


def _kafka_judged(report: VerifyReport) -> None:
    kafka = next(s for s in report.systems if s.kind == "kafka")
    assert kafka.exact and kafka.open_transactions == 0, report.lines()
    assert "a read_committed consumer agrees" in kafka.note, kafka.note


@pytest.mark.slow  # five driver runs of the every-kind job: about 3 minutes
def test_every_kind_killed_through_the_door(
    tmp_path: Path, pg_dsn: str, mariadb_server: Any, s3: Any, s3_bucket: str,
    kafka_bootstrap: str,
) -> None:
    """PostgreSQL, MariaDB XA, Parquet on S3 (moto), Iceberg, Delta and Kafka (the default
    resumable prepare) in one job through the door, killed at every driver step."""
    from tests.sinks.iceberg.iceberg_support import local_catalog
    from tests.support.s3 import unique_prefix

    tag = secrets.token_hex(3)
    topic = unique_topic("doorkill")
    create_topic(kafka_bootstrap, topic, partitions=2)
    cfg = JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", sink=f"dk{tag}", pg_dsn=pg_dsn,
        pg_table=f"dk_{tag}", files_path=f"s3://{s3_bucket}/{unique_prefix('doorkill')}",
        files_options=s3.storage_options, kafka_bootstrap=kafka_bootstrap, kafka_topic=topic,
        sql_urls=[mariadb_server.url], sql_table=f"dk_{tag}",
        delta_path=str(tmp_path / "delta"), iceberg_table=f"ns.dk_{tag}",
        iceberg_catalog=local_catalog(tmp_path / "ice"), partitions=4, input_partitions=2,
        vote_timeout=60.0, door=True,
        spark_conf={"spark.master": "local[2,4]"},  # up to 4 tries of a task
    )
    name = {p.kind: p.name for p in build_participants(cfg)}
    assert sorted(name) == sorted(["postgres", "files", "kafka", "sql", "delta", "iceberg"])
    report = _killed_runs(cfg, tmp_path, [
        # a task's Kafka transaction prepared (PostgreSQL's and the files' branches
        # before it), no vote handed back
        f"after_prepare@{name['kafka']}",
        # COMMIT decided; MariaDB's XA branch held before its commit while the other
        # commit lanes go on: a partly applied batch
        f"before_commit@{name['sql']}",
        f"after_commit@{name['kafka']}",  # Kafka's transaction committed, not acknowledged
        # Delta committed and acknowledged, Iceberg committed, not acknowledged
        f"after_batch_commit@{name['iceberg']}",
    ], worker_kill=f"after_prepare@{name['kafka']}")  # a worker's open Kafka transaction
    assert report.ok, report.lines()
    assert [s.rows for s in report.systems] == [ROWS * 5] * 6, report.lines()
    _kafka_judged(report)
    assert [g for g in prepared(pg_dsn) if cfg.sink in g] == []
    assert mariadb_server.sql("XA RECOVER") == []


@pytest.mark.slow  # five driver runs: about 3 minutes
def test_staged_kafka_killed_through_the_door(
    tmp_path: Path, pg_dsn: str, kafka_bootstrap: str,
) -> None:
    """Kafka's staged prepare (the driver copies the staged records into the topic)
    beside PostgreSQL and local files, killed before the commit and in the copy; the
    local files also with their branches staged and no vote handed back, and with a
    branch renamed into place, not acknowledged."""
    tag = secrets.token_hex(3)
    topic = unique_topic("doorstaged")
    create_topic(kafka_bootstrap, topic, partitions=2)
    cfg = JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", sink=f"ds{tag}", pg_dsn=pg_dsn,
        pg_table=f"ds_{tag}", files_path=str(tmp_path / "out"),
        kafka_bootstrap=kafka_bootstrap, kafka_topic=topic, kafka_prepare="staged",
        partitions=4, input_partitions=2, vote_timeout=60.0, door=True,
        spark_conf={"spark.master": "local[2,4]"},
    )
    name = {p.kind: p.name for p in build_participants(cfg)}
    report = _killed_runs(cfg, tmp_path, [
        f"before_commit@{name['files']}",  # COMMIT decided, the files' rename held
        # a task's file staged and fsynced (PostgreSQL's branch prepared before it), no
        # vote handed back: the restart's new attempt writes it again, the staged one
        # is swept
        f"after_prepare@{name['files']}",
        # a staged file renamed into the visible folder, not acknowledged: the restart
        # finds it committed and does not write it twice
        f"after_commit@{name['files']}",
        # the staged copy's transaction open (records and marker sent), not committed
        f"mid_commit@{name['kafka']}",
    ], worker_kill=f"after_prepare@{name['kafka']}")  # staged, no vote handed back
    assert report.ok, report.lines()
    assert [s.rows for s in report.systems] == [ROWS * 5] * 3, report.lines()
    _kafka_judged(report)
    files = next(s for s in report.systems if s.kind == "files")
    assert (files.prepared_leftovers, files.temp_leftovers) == (0, 0), report.lines()
    staging = tmp_path / "out" / STAGING_DIR
    assert not staging.exists() or [f for f in staging.rglob("*") if f.is_file()] == []
    assert [g for g in prepared(pg_dsn) if cfg.sink in g] == []
