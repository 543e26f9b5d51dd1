"""KafkaParticipant over the wire against the suite's Apache Kafka broker.

Transactions commit, the marker offset becomes visible with them, fencing, status
transitions, redo, and every bad-input case; aborted rows invisible and exactly-once of
the output are also in test_kafka_real_broker.py.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import pickle
import time
import uuid

import pyarrow as pa
import pytest

from tests.support.kafka import (
    committed_offset,
    create_topic,
    kafka_bootstrap,
    read_all,
    unique_topic,
)
from twophase.participant import BranchRef, BranchStatus, ParticipantError, PrepareRefused
from twophase.sinks.kafka import KafkaParticipant
from twophase.testing.servers import free_port

__all__ = ["kafka_bootstrap"]  # the fixture, imported for pytest

# Kafka answers a fenced producer's commit with PRODUCER_FENCED (or INVALID_PRODUCER_EPOCH):
# fatal, reported, never turned into an abort (tansu, the suite's broker before, closed the
# connection instead and this pattern allowed "still in doubt": no more).
FENCED = r"failed and was not aborted: .*(FENCED|EPOCH)"

SCHEMA = pa.schema([("id", pa.int64()), ("k", pa.string()), ("label", pa.string())])


def batch(start: int, n: int) -> pa.RecordBatch:
    ids = list(range(start, start + n))
    return pa.record_batch(
        [pa.array(ids, pa.int64()), pa.array([f"k{i % 7}" for i in ids]),
         pa.array([f"row {i} \"q\" ü" for i in ids])],
        schema=SCHEMA,
    )


def branch(participant: KafkaParticipant, batch_id: int = 0, *, attempt: int = 0,
           partition: int = 0, sink: str = "orders", lineage: str | None = None) -> BranchRef:
    return BranchRef(sink=sink, lineage=lineage or uuid.uuid4().hex[:16], batch_id=batch_id,
                     attempt=attempt, participant=participant.name, partition=partition)


def make(bootstrap: str, topic: str | None = None, **kw: object) -> KafkaParticipant:
    topic = topic or unique_topic()
    create_topic(bootstrap, topic)
    kw.setdefault("connect_timeout_s", 10.0)
    return KafkaParticipant(topic, {"bootstrap.servers": bootstrap}, **kw)  # type: ignore[arg-type]


def test_redo_after_commit_writes_nothing(kafka_bootstrap: str) -> None:
    p = make(kafka_bootstrap)
    b = branch(p, batch_id=0)
    p.commit(b, p.prepare(b, SCHEMA, [batch(0, 50)]))
    before = len(read_all(kafka_bootstrap, p.topic, isolation="read_uncommitted", expect=50))
    # Another process (a pickled copy) redoes the same branch: nothing is produced.
    q: KafkaParticipant = pickle.loads(pickle.dumps(p))
    handle = q.prepare(b, SCHEMA, [batch(0, 50)])
    assert handle["already_committed"] == "yes" and handle["rows"] == "0"
    q.commit(b, handle)
    after = len(read_all(kafka_bootstrap, p.topic, isolation="read_uncommitted", expect=before))
    assert before == after == 50
    # An earlier checkpoint of the same lineage also reads as committed (offsets only grow).
    earlier = BranchRef(b.sink, b.lineage, 0, 1, b.participant, 0)
    assert q.status(earlier) is BranchStatus.COMMITTED
    # A new lineage (new checkpoint location) starts from nothing: never skipped.
    assert q.status(branch(p, batch_id=0)) is BranchStatus.ABSENT


def test_value_column_and_stable_json(kafka_bootstrap: str) -> None:
    schema = pa.schema([
        ("id", pa.int32()), ("ts", pa.timestamp("us", "UTC")), ("amt", pa.decimal128(10, 2)),
        ("raw", pa.binary()), ("payload", pa.binary()),
    ])
    rb = pa.record_batch([
        pa.array([1, 2], pa.int32()),
        pa.array([dt.datetime(2024, 1, 2, 3, 4, 5, 123456, tzinfo=dt.timezone.utc), None],
                 pa.timestamp("us", "UTC")),
        pa.array([decimal.Decimal("12.50"), decimal.Decimal("-0.01")], pa.decimal128(10, 2)),
        pa.array([b"\x00\xff", b""]),
        pa.array([b"P1", None]),
    ], schema=schema)
    as_json = make(kafka_bootstrap)
    b = branch(as_json)
    as_json.commit(b, as_json.prepare(b, schema, [rb]))
    got = sorted((json.loads(m.value()) for m in read_all(kafka_bootstrap, as_json.topic,
                                                          expect=2)), key=lambda r: r["id"])
    assert got == [
        {"id": 1, "ts": "2024-01-02T03:04:05.123456Z", "amt": "12.50", "raw": "AP8=",
         "payload": "UDE="},
        {"id": 2, "ts": None, "amt": "-0.01", "raw": "", "payload": None},
    ]
    raw = make(kafka_bootstrap, value="payload", key="id")
    raw.check(schema)
    b = branch(raw)
    raw.commit(b, raw.prepare(b, schema, [rb]))
    msgs = read_all(kafka_bootstrap, raw.topic, expect=2)
    assert sorted((m.key(), m.value()) for m in msgs if m.value() is not None) == [(b"1", b"P1")]
    assert [m.key() for m in msgs if m.value() is None] == [b"2"]  # null value: tombstone


# -- bad input ---------------------------------------------------------------------------


def _nothing_left(p: KafkaParticipant, b: BranchRef, bootstrap: str) -> None:
    assert p.in_doubt(b.sink) == []
    assert p.status(b) is BranchStatus.ABSENT
    assert committed_offset(bootstrap, p.marker_group(b), p.topic) == -1


def test_unserializable_value_votes_no(kafka_bootstrap: str) -> None:
    schema = pa.schema([("id", pa.int64()), ("x", pa.float64())])
    p = make(kafka_bootstrap)
    b = branch(p)
    good = pa.record_batch([pa.array([1, 2]), pa.array([1.0, 2.0])], schema=schema)
    bad = pa.record_batch([pa.array([3, 4]), pa.array([1.0, float("nan")])], schema=schema)
    with pytest.raises(PrepareRefused, match=r"column 'x' row 1.*NaN"):
        p.prepare(b, schema, [good, bad])
    _nothing_left(p, b, kafka_bootstrap)


def test_oversized_row_votes_no(kafka_bootstrap: str) -> None:
    p = make(kafka_bootstrap, value="label")
    b = branch(p)
    big = pa.record_batch([pa.array([1, 2]), pa.array(["a", "b"]),
                           pa.array(["small", "x" * 1_200_000])], schema=SCHEMA)
    with pytest.raises(PrepareRefused, match=r"row 1 is 1200000 bytes.*limit of 1000000"):
        p.prepare(b, SCHEMA, [big])
    _nothing_left(p, b, kafka_bootstrap)


def test_oversized_against_configured_limit(kafka_bootstrap: str) -> None:
    topic = unique_topic()
    create_topic(kafka_bootstrap, topic)
    p = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap,
                                 "message.max.bytes": "2000"}, connect_timeout_s=10)
    b = branch(p)
    rb = pa.record_batch([pa.array([1]), pa.array(["a"]), pa.array(["y" * 3000])],
                         schema=SCHEMA)
    with pytest.raises(PrepareRefused, match=r"row 0 is \d+ bytes.*limit of 2000"):
        p.prepare(b, SCHEMA, [rb])
    _nothing_left(p, b, kafka_bootstrap)


@pytest.mark.parametrize("topic", [
    "", ".", "..", "../etc/passwd", "a b", "t;DROP TABLE x", "tøpic", "x" * 250, "a/b",
    "with\nnewline", "nul\x00",
])
def test_hostile_topic_names_refused(topic: str) -> None:
    with pytest.raises(ValueError, match="invalid Kafka topic name"):
        KafkaParticipant(topic, {"bootstrap.servers": "127.0.0.1:9"})


def test_unreachable_server_check_and_prepare() -> None:
    servers = f"127.0.0.1:{free_port()}"
    p = KafkaParticipant("t", {"bootstrap.servers": servers}, connect_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(ParticipantError, match=f"cannot reach Kafka at {servers}"):
        p.check(SCHEMA)
    b = branch(p)
    # the marker read or the producer's init, whichever meets the dead address first
    with pytest.raises(ParticipantError, match=f"(cannot reach Kafka|cannot initialise "
                                               f"transactional.id .*) at {servers}"):
        p.prepare(b, SCHEMA, [batch(0, 3)])
    assert time.monotonic() - started < 20
    assert p.in_doubt("orders") == []


def test_check_creates_topic_and_validates(kafka_bootstrap: str) -> None:
    topic = unique_topic("auto")
    p = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, key="k",
                         connect_timeout_s=10)
    p.check(SCHEMA)
    from confluent_kafka.admin import AdminClient

    md = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(topic=topic, timeout=10)
    assert md.topics[topic].error is None
    with pytest.raises(ParticipantError, match="key column 'nope' is not in the schema"):
        KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, key="nope").check(SCHEMA)
    with pytest.raises(ParticipantError, match="value column 'id' has type int64"):
        KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, value="id").check(SCHEMA)


def test_check_transaction_timeout_over_broker_max(kafka_bootstrap: str) -> None:
    # the suite's broker keeps Kafka's default maximum (15 minutes), read from its configs
    p = KafkaParticipant(unique_topic(), {"bootstrap.servers": kafka_bootstrap},
                         transaction_timeout_ms=900_001, connect_timeout_s=10)
    with pytest.raises(ParticipantError,
                       match=r"transaction_timeout_ms=900001 exceeds the broker's "
                             r"transaction.max.timeout.ms=900000"):
        p.check(SCHEMA)

