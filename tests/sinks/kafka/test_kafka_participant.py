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
    kw.setdefault("prepare", "in_task")
    return KafkaParticipant(topic, {"bootstrap.servers": bootstrap}, **kw)  # type: ignore[arg-type]


def test_prepare_commit_rows_marker_and_status(kafka_bootstrap: str) -> None:
    p = make(kafka_bootstrap, key="k")
    b = branch(p, batch_id=4)
    group = p.marker_group(b)
    assert p.status(b) is BranchStatus.ABSENT
    handle = p.prepare(b, SCHEMA, [batch(0, 300), batch(300, 200), batch(500, 0)])
    assert handle["rows"] == "500"
    assert handle["transactional_id"] == f"twophase.orders.{p.name}.0"
    assert handle["marker_group"] == group
    assert p.status(b) is BranchStatus.PREPARED
    assert p.in_doubt("orders") == [b]
    # marker not yet visible (a stable read would wait for the open transaction)
    assert committed_offset(kafka_bootstrap, group, p.topic, open_txn=True) == -1
    p.commit(b, handle)
    assert p.status(b) is BranchStatus.COMMITTED
    assert committed_offset(kafka_bootstrap, group, p.topic) == 5  # checkpoint + 1
    assert p.in_doubt("orders") == []
    msgs = read_all(kafka_bootstrap, p.topic, expect=500)
    assert len(msgs) == 500
    rows = sorted((json.loads(m.value()) for m in msgs), key=lambda r: r["id"])
    assert rows[0] == {"id": 0, "k": "k0", "label": 'row 0 "q" ü'}
    assert [r["id"] for r in rows] == list(range(500))
    assert all(m.key() == f"k{json.loads(m.value())['id'] % 7}".encode() for m in msgs)
    p.commit(b, handle)  # already committed is success
    p.close()


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


def test_commit_from_another_process_must_redo(kafka_bootstrap: str) -> None:
    p = make(kafka_bootstrap)
    b = branch(p, batch_id=2)
    handle = p.prepare(b, SCHEMA, [batch(0, 10)])
    q: KafkaParticipant = pickle.loads(pickle.dumps(p))  # no producer travels
    assert q.status(b) is BranchStatus.ABSENT
    with pytest.raises(ParticipantError, match="cannot be committed from another process"):
        q.commit(b, handle)
    # The redo under the COMMIT decision: q's init fences p, writes again, commits.
    q.commit(b, q.prepare(b, SCHEMA, [batch(0, 10)]))
    assert q.status(b) is BranchStatus.COMMITTED
    p.commit_retry_s = p.connect_timeout_s = 2.0  # Kafka answers at once: no wait needed
    with pytest.raises(ParticipantError, match=FENCED):
        p.commit(b, handle)
    assert q.status(b) is BranchStatus.COMMITTED


def test_abort_in_process(kafka_bootstrap: str) -> None:
    p = make(kafka_bootstrap)
    b = branch(p, batch_id=7)
    handle = p.prepare(b, SCHEMA, [batch(0, 20)])
    p.abort(b, handle)
    assert p.status(b) is BranchStatus.ABSENT
    assert committed_offset(kafka_bootstrap, p.marker_group(b), p.topic) == -1
    p.abort(b, handle)  # already gone is success
    # A later attempt of the same checkpoint commits normally.
    b2 = BranchRef(b.sink, b.lineage, 7, 1, b.participant, 0)
    p.commit(b2, p.prepare(b2, SCHEMA, [batch(0, 20)]))
    assert committed_offset(kafka_bootstrap, p.marker_group(b), p.topic) == 8


def test_abort_from_another_process_fences_the_zombie(kafka_bootstrap: str) -> None:
    p = make(kafka_bootstrap)
    b = branch(p, batch_id=1)
    handle = p.prepare(b, SCHEMA, [batch(0, 20)])
    q: KafkaParticipant = pickle.loads(pickle.dumps(p))
    q.abort(b, handle)  # no producer here: fence the transactional.id
    p.commit_retry_s = p.connect_timeout_s = 2.0
    with pytest.raises(ParticipantError, match=FENCED):
        p.commit(b, handle)
    assert q.status(b) is BranchStatus.ABSENT
    assert committed_offset(kafka_bootstrap, p.marker_group(b), p.topic) == -1


def test_zombie_is_fenced_by_second_instance(kafka_bootstrap: str) -> None:
    p = make(kafka_bootstrap)
    b = branch(p, batch_id=3)
    zombie = KafkaParticipant(p.topic, p.config, connect_timeout_s=2,  # type: ignore[arg-type]
                              commit_retry_s=2, prepare="in_task")
    old = zombie.prepare(b, SCHEMA, [batch(0, 5)])
    new = p.prepare(b, SCHEMA, [batch(0, 5)])  # same transactional.id: fences the zombie
    assert old["transactional_id"] == new["transactional_id"]
    with pytest.raises(ParticipantError, match=FENCED):
        zombie.commit(b, old)
    assert zombie.status(b) is not BranchStatus.COMMITTED  # the zombie's commit did not land
    assert committed_offset(kafka_bootstrap, p.marker_group(b), p.topic, open_txn=True) == -1
    p.commit(b, new)
    assert committed_offset(kafka_bootstrap, p.marker_group(b), p.topic) == 4


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
                                 "message.max.bytes": "2000"}, connect_timeout_s=10,
                                 prepare="in_task")
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
        KafkaParticipant(topic, {"bootstrap.servers": "127.0.0.1:9"}, prepare="in_task")


def test_unreachable_server_check_and_prepare() -> None:
    servers = f"127.0.0.1:{free_port()}"
    p = KafkaParticipant("t", {"bootstrap.servers": servers}, connect_timeout_s=2,
                         prepare="in_task")
    started = time.monotonic()
    with pytest.raises(ParticipantError, match=f"cannot reach Kafka at {servers}"):
        p.check(SCHEMA)
    b = branch(p)
    with pytest.raises(PrepareRefused, match=f"cannot initialise transactional.id .* at {servers}"):
        p.prepare(b, SCHEMA, [batch(0, 3)])
    assert time.monotonic() - started < 20
    assert p.in_doubt("orders") == []


def test_check_creates_topic_and_validates(kafka_bootstrap: str) -> None:
    topic = unique_topic("auto")
    p = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, key="k",
                         connect_timeout_s=10, prepare="in_task")
    p.check(SCHEMA)
    from confluent_kafka.admin import AdminClient

    md = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(topic=topic, timeout=10)
    assert md.topics[topic].error is None
    with pytest.raises(ParticipantError, match="key column 'nope' is not in the schema"):
        KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, key="nope",
                         prepare="in_task").check(SCHEMA)
    with pytest.raises(ParticipantError, match="value column 'id' has type int64"):
        KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, value="id",
                         prepare="in_task").check(SCHEMA)


def test_check_transaction_timeout_over_broker_max(kafka_bootstrap: str) -> None:
    # the suite's broker keeps Kafka's default maximum (15 minutes), read from its configs
    p = KafkaParticipant(unique_topic(), {"bootstrap.servers": kafka_bootstrap},
                         transaction_timeout_ms=900_001, connect_timeout_s=10, prepare="in_task")
    with pytest.raises(ParticipantError,
                       match=r"transaction_timeout_ms=900001 exceeds the broker's "
                             r"transaction.max.timeout.ms=900000"):
        p.check(SCHEMA)


def _branch_in_log(p: KafkaParticipant, b: BranchRef) -> tuple[int, int, int]:
    from twophase.sinks.kafka.log import read_branch

    seen = read_branch(p.config, p.topic, dict(p.headers(b)), {})
    return seen.committed, seen.aborted, seen.open


def test_redo_of_a_committed_branch_beside_an_open_one(kafka_bootstrap: str) -> None:
    """Branch 1 of the batch is prepared and open (its task is about to be killed); branch
    0 commits. On Kafka its marker (the transaction's offset commit) is visible with its
    COMMIT marker even with branch 1 open on the same partition (tansu, the suite's broker
    before, applied it only once branch 1 ended: the duplicate the log judge found,
    docs/kafka.md). Marker and log agree, so the redo writes nothing."""
    p = make(kafka_bootstrap)
    lineage = uuid.uuid4().hex[:16]
    b0 = branch(p, batch_id=3, partition=0, lineage=lineage)
    b1 = branch(p, batch_id=3, partition=1, lineage=lineage)
    h1 = p.prepare(b1, SCHEMA, [batch(100, 20)])  # open: its task will die
    h0 = p.prepare(b0, SCHEMA, [batch(0, 30)])
    assert h0["offsets"].startswith("0:")  # where the vote wrote: the redo reads from there
    p.commit(b0, h0)
    assert committed_offset(kafka_bootstrap, p.marker_group(b0), p.topic) == 4  # no lag
    q: KafkaParticipant = pickle.loads(pickle.dumps(p))  # the retried task's process
    assert q.status(b0) is BranchStatus.COMMITTED  # the marker
    assert q.voted_status(b0, h0) is BranchStatus.COMMITTED  # the log with the vote
    assert q.voted_status(b0, None) is BranchStatus.COMMITTED  # no vote: the marker alone
    other = branch(p, batch_id=3, partition=0)  # another lineage: those records are not its
    assert q.voted_status(other, h0) is BranchStatus.ABSENT
    redone = q.redo(b0, SCHEMA, [batch(0, 30)], h0)
    assert redone["already_committed"] == "yes" and redone["rows"] == "0"
    q.commit(b0, redone)
    assert _branch_in_log(q, b0) == (30, 0, 0)  # once, nothing open
    # Without the vote's offsets (an older handle) the log is read from its start.
    assert q.redo(b0, SCHEMA, [batch(0, 30)], {})["already_committed"] == "yes"
    # The neighbour's redo fences its dead producer, writes and commits: once too.
    h1r = q.redo(b1, SCHEMA, [batch(100, 20)], h1)
    assert h1r["already_committed"] == "no" and h1r["rows"] == "20"
    q.commit(b1, h1r)
    assert _branch_in_log(q, b1) == (20, 20, 0)  # the dead attempt's 20 aborted
    assert q.status(b0) is BranchStatus.COMMITTED
    t0 = time.monotonic()
    p.close()  # holds b1's fenced producer: closing it must not hang
    assert time.monotonic() - t0 < 3 * p.connect_timeout_s
    q.close()


def test_redo_of_a_branch_aborted_in_the_log_writes_it(kafka_bootstrap: str) -> None:
    """The other side: the voted transaction was aborted (fenced), so the log shows its
    records aborted, not committed, and the redo writes them, once."""
    p = make(kafka_bootstrap)
    b = branch(p, batch_id=1)
    voted = p.prepare(b, SCHEMA, [batch(0, 15)])
    p.abort(b, voted)
    q: KafkaParticipant = pickle.loads(pickle.dumps(p))
    h = q.redo(b, SCHEMA, [batch(0, 15)], voted)
    assert h["already_committed"] == "no" and h["rows"] == "15"
    q.commit(b, h)
    assert _branch_in_log(q, b) == (15, 15, 0)
    q.close()

