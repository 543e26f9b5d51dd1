"""A job as a deployment runs it on secured targets: real local[2] Spark writing
PostgreSQL over TLS (``sslmode=verify-full`` against the server's CA, plaintext refused
by the server), Kafka over SASL_SSL (SCRAM-SHA-512, TLS verified, ACLs enforced, as the
least-privileged principal holding exactly the ACLs docs/user/security.md lists, staged
prepare as users get it) and Delta, in one TransactionalSink. Judged exactly once by
PostgreSQL, the Delta log and the Kafka partition logs (read through SASL_SSL)
cross-checked with a read_committed consumer. A wrong Kafka password or a DSN without
TLS is refused by the sink's first batch before anything is written, naming the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.kafka import create_topic, grant_app, secure_kafka, unique_topic
from twophase import TransactionalSink
from twophase.errors import TwophaseError
from twophase.sinks.delta import DeltaParticipant
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.postgres import PostgresParticipant
from twophase.testing.apachekafka import LocalKafka
from twophase.testing.localpg import LocalPostgres
from twophase.testing.verify import verify

__all__ = ["secure_kafka"]

pytestmark = [pytest.mark.spark, pytest.mark.real_kafka]


def test_job_into_postgres_tls_kafka_sasl_ssl_and_delta_exactly_once(
    spark: Any, tmp_path: Path, tls_pg: LocalPostgres, secure_kafka: LocalKafka
) -> None:
    topic = unique_topic("secjob")
    kafka = KafkaParticipant(topic, secure_kafka.client_config("app"), key="id",
                             connect_timeout_s=15)
    admin = secure_kafka.client_config()
    create_topic(admin, topic, partitions=2)
    create_topic(admin, kafka.staging_topic, partitions=2)
    grant_app(secure_kafka, topic)
    pg = PostgresParticipant(dsn=tls_pg.tls_dsn(), table=f"secjob_{topic[-12:]}")
    delta = DeltaParticipant(str(tmp_path / "delta"))
    sink = TransactionalSink("secjob", [pg, kafka, delta], f"sqlite:///{tmp_path / 'c.db'}",
                             lineage="secjob-1", partitions=2)
    try:
        for batch_id in range(2):
            sink(spark.range(batch_id * 100, (batch_id + 1) * 100)
                 .selectExpr("id", "concat('row ', id) as label"), batch_id)
    finally:
        sink.close()
    assert [r.outcome for r in sink.history] == ["committed"] * 2
    report = verify([pg, kafka, delta], range(200), sink="secjob")
    assert report.ok, report
    [kafka_report] = [r for r in report.systems if r.participant == kafka.name]
    assert kafka_report.exact and "consumer agrees" in kafka_report.note, kafka_report


def test_secured_targets_refuse_a_wrong_password_or_no_tls_before_any_write(
    spark: Any, tmp_path: Path, tls_pg: LocalPostgres, secure_kafka: LocalKafka
) -> None:
    topic = unique_topic("secref")
    create_topic(secure_kafka.client_config(), topic)
    grant_app(secure_kafka, topic)
    bad_kafka = KafkaParticipant(topic, {**secure_kafka.client_config("app"),
                                         "sasl.password": "wrong"}, connect_timeout_s=10)
    pg = PostgresParticipant(dsn=tls_pg.tls_dsn(), table=f"secref_{topic[-12:]}")
    sink = TransactionalSink("secref", [pg, bad_kafka], f"sqlite:///{tmp_path / 'c.db'}",
                             lineage="secref-1", partitions=2)
    try:
        with pytest.raises(TwophaseError, match=r"(?s)SASL authentication failed.*"
                                                r"sasl\.username and sasl\.password"):
            sink(spark.range(0, 10).selectExpr("id", "'x' as label"), 0)
    finally:
        sink.close()
    with psycopg.connect(tls_pg.tls_dsn()) as conn:  # nothing was written
        assert conn.execute("SELECT to_regclass(%s)", (f"secref_{topic[-12:]}",)
                            ).fetchone() == (None,)
    plain = PostgresParticipant(dsn=tls_pg.dsn + "?sslmode=disable", table="secref_plain")
    with pytest.raises(TwophaseError, match=r"no encryption|SSL"):
        plain.probe()
