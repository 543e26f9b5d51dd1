"""PostgreSQL + staged Kafka in one TransactionalSink on real local[2] Spark: no
participant keeps its prepared branch in its task, so every batch runs barrier-free
(mode ``prepare``: ordinary tasks stage and vote, the driver copies and commits), with
more partitions than task slots. Judged by PostgreSQL and by the Kafka partition log
cross-checked with a read_committed consumer (``verify``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.kafka import create_topic, kafka_bootstrap, unique_topic
from twophase import TransactionalSink
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.postgres import PostgresParticipant
from twophase.testing.verify import verify

__all__ = ["kafka_bootstrap"]

pytestmark = [pytest.mark.spark, pytest.mark.real_kafka]


def test_postgres_and_staged_kafka_run_barrier_free_on_more_partitions_than_slots(
    spark: Any, tmp_path: Path, pg_dsn: str, kafka_bootstrap: str
) -> None:
    topic = unique_topic("staged")
    create_topic(kafka_bootstrap, topic, partitions=3)
    kafka = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, key="id",
                             prepare="staged", connect_timeout_s=15)
    pg = PostgresParticipant(dsn=pg_dsn, table=f"kstaged_{topic[-12:]}")
    sink = TransactionalSink("kstaged", [pg, kafka], f"sqlite:///{tmp_path / 'c.db'}",
                             lineage="kstaged-1", partitions=5)
    try:
        for batch_id in range(2):
            sink(spark.range(batch_id * 500, (batch_id + 1) * 500)
                 .selectExpr("id", "concat('row ', id) as label"), batch_id)
    finally:
        sink.close()
    assert [(r.outcome, r.partitions) for r in sink.history] == [("committed", 5)] * 2
    assert all(r.phases.get("driver_commit_s", 0) > 0
               for r in sink.history), [r.phases for r in sink.history]
    # the batch's report: its rows are the batch's, its commit is the driver's copy
    assert [r.rows for r in sink.history] == [500, 500]
    assert all(r.commit_s >= r.phases["driver_commit_s"] > 0 for r in sink.history)
    report = verify([pg, kafka], range(1000), sink="kstaged")
    assert report.ok, report
