"""Kafka assertions that only a real Apache Kafka broker shows: aborted records hidden from
read_committed readers, the broker's own limits.

They run by default on the suite's private Apache Kafka (``kafka_bootstrap``,
``tests/support/kafka.py``), marked ``real_kafka`` for the record; tansu, the suite's
broker before, could not back them.
"""

from __future__ import annotations

import json
import uuid

import pyarrow as pa
import pytest

from tests.support.kafka import (
    create_topic,
    kafka_bootstrap,
    read_all,
    unique_topic,
)
from twophase.participant import BranchRef, ParticipantError, PrepareRefused
from twophase.sinks.kafka import KafkaParticipant

__all__ = ["kafka_bootstrap"]

pytestmark = [pytest.mark.real_kafka]

SCHEMA = pa.schema([("id", pa.int64()), ("label", pa.string())])


def rows(start: int, n: int) -> pa.RecordBatch:
    return pa.record_batch([pa.array(range(start, start + n), pa.int64()),
                            pa.array([f"r{i}" for i in range(start, start + n)])], schema=SCHEMA)


def make(bootstrap: str, **kw: object) -> KafkaParticipant:
    topic = unique_topic("real")
    create_topic(bootstrap, topic, partitions=3)
    return KafkaParticipant(topic, {"bootstrap.servers": bootstrap}, connect_timeout_s=15,
                            **kw)  # type: ignore[arg-type]


def branch(p: KafkaParticipant, batch_id: int, attempt: int = 0, lineage: str = "") -> BranchRef:
    return BranchRef("real", lineage or uuid.uuid4().hex[:12], batch_id, attempt, p.name, 0)


def test_aborted_attempt_invisible_then_retry_exactly_once(kafka_bootstrap: str) -> None:
    p = make(kafka_bootstrap)
    first = branch(p, 0)
    p.abort(first, p.prepare(first, SCHEMA, [rows(0, 400)]))
    retry = BranchRef(first.sink, first.lineage, 0, 1, p.name, 0)
    p.commit(retry, p.prepare(retry, SCHEMA, [rows(0, 400)]))
    got = [json.loads(m.value())["id"] for m in read_all(kafka_bootstrap, p.topic,
                                                         expect=400, idle_s=3)]
    assert sorted(got) == list(range(400))  # the aborted 400 are invisible
    uncommitted = read_all(kafka_bootstrap, p.topic, isolation="read_uncommitted",
                           expect=800, idle_s=3)
    assert len(uncommitted) == 800  # they were written, and hidden by the abort


def test_check_reads_broker_limits(kafka_bootstrap: str) -> None:
    from confluent_kafka.admin import AdminClient, _config, _resource
    from confluent_kafka.cimpl import NewTopic

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    md = admin.list_topics(timeout=15)
    broker = str(min(md.brokers))
    res = _config.ConfigResource(_resource.ResourceType.BROKER, broker)
    [fut] = admin.describe_configs([res]).values()
    max_ms = int(fut.result(timeout=15)["transaction.max.timeout.ms"].value)
    p = KafkaParticipant(unique_topic("real"), {"bootstrap.servers": kafka_bootstrap},
                         transaction_timeout_ms=max_ms + 1000)
    with pytest.raises(ParticipantError, match=f"transaction.max.timeout.ms={max_ms}"):
        p.check(SCHEMA)
    topic = unique_topic("small")
    [fut] = admin.create_topics([NewTopic(topic, 1, config={"max.message.bytes": "2000"})]
                                ).values()
    fut.result(timeout=15)
    q = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, value="label")
    q.check(SCHEMA)
    assert q.max_message_bytes() == 2000
    big = pa.record_batch([pa.array([1]), pa.array(["z" * 5000])], schema=SCHEMA)
    with pytest.raises(PrepareRefused, match=r"row 0 is 5000 bytes.*limit of 2000"):
        q.prepare(branch(q, 0), SCHEMA, [big])
