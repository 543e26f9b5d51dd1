"""PostgreSQL + Kafka's resumable prepare in one TransactionalSink on real local[2] Spark:
the tasks write the records once into their own open transactions and vote their
handles; the driver commits them with ``EndTxn`` (no barrier stage, more partitions than
task slots). Judged by PostgreSQL and by the Kafka partition log cross-checked with a
read_committed consumer (``verify``)."""

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


def test_postgres_and_resumable_kafka_run_barrier_free_on_more_partitions_than_slots(
    spark: Any, tmp_path: Path, pg_dsn: str, kafka_bootstrap: str
) -> None:
    topic = unique_topic("resumable")
    create_topic(kafka_bootstrap, topic, partitions=3)
    kafka = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, key="id",
                             prepare="resumable", connect_timeout_s=15)
    pg = PostgresParticipant(dsn=pg_dsn, table=f"kres_{topic[-12:]}")
    sink = TransactionalSink("kres", [pg, kafka], f"sqlite:///{tmp_path / 'c.db'}",
                             lineage="kres-1", partitions=5)
    try:
        for batch_id in range(3):
            sink(spark.range(batch_id * 500, (batch_id + 1) * 500)
                 .selectExpr("id", "concat('row ', id) as label"), batch_id)
    finally:
        sink.close()
    assert [(r.outcome, r.partitions) for r in sink.history] == [("committed", 5)] * 3
    assert all(r.phases.get("driver_commit_s", 0) > 0
               for r in sink.history), [r.phases for r in sink.history]
    report = verify([pg, kafka], range(1500), sink="kres")
    assert report.ok, report
    assert kafka.open_transactions("kres") == []
