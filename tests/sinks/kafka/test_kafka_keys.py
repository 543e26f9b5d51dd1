"""KafkaParticipant keys and headers over the wire (tansu): one key column as is, several
as a JSON object, and headers naming sink, lineage, batch and partition on every message."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from tests.sinks.kafka.test_kafka_participant import SCHEMA, batch, branch, make
from tests.support.kafka import kafka_bootstrap, read_all
from twophase.errors import InvalidRequest
from twophase.participant import ParticipantError
from twophase.sinks.kafka import KafkaParticipant

__all__ = ["kafka_bootstrap"]  # the fixture, imported for pytest


def test_composite_key_is_a_json_object_and_headers_trace_the_batch(
    kafka_bootstrap: str,
) -> None:
    p = make(kafka_bootstrap, key=["k", "id"])
    p.check(SCHEMA)
    b = branch(p, batch_id=7, partition=3, sink="counts")
    p.commit(b, p.prepare(b, SCHEMA, [batch(0, 20)]))
    msgs = read_all(kafka_bootstrap, p.topic, expect=20)
    assert len(msgs) == 20
    for m in msgs:
        row = json.loads(m.value())
        assert json.loads(m.key()) == {"k": row["k"], "id": row["id"]}
        assert m.key() == json.dumps({"k": row["k"], "id": row["id"]},
                                     separators=(",", ":")).encode()
        assert dict(m.headers()) == {
            "twophase.sink": b"counts", "twophase.lineage": b.lineage.encode(),
            "twophase.batch": b"7", "twophase.partition": b"3",
        }
    p.close()


def test_single_key_column_is_the_key_as_is(kafka_bootstrap: str) -> None:
    p = make(kafka_bootstrap, key=["id"])
    p.check(SCHEMA)
    b = branch(p)
    p.commit(b, p.prepare(b, SCHEMA, [batch(0, 5)]))
    keys = sorted(m.key() for m in read_all(kafka_bootstrap, p.topic, expect=5))
    assert keys == [str(i).encode() for i in range(5)]
    p.close()


def test_key_bad_input(kafka_bootstrap: str) -> None:
    conf = {"bootstrap.servers": kafka_bootstrap}
    for bad in ([], ["k", "k"], [""], 3):
        with pytest.raises(InvalidRequest, match="key must be a column name or a list"):
            KafkaParticipant("t", conf, key=bad)  # type: ignore[arg-type]
    with pytest.raises(ParticipantError, match=r"key column\(s\) \['nope'\] are not in"):
        KafkaParticipant("t", conf, key=["k", "nope"]).check(SCHEMA)
    floats = pa.schema([("id", pa.int64()), ("x", pa.float64())])
    p = KafkaParticipant("t", conf, key=["id", "x"])
    p._check_columns(floats)  # JSON-able: fine (NaN is refused per row, at prepare)


def test_descriptor_keeps_composite_and_single_keys() -> None:
    conf = {"bootstrap.servers": "127.0.0.1:1"}
    for key in (["k", "id"], "k", None):
        p = KafkaParticipant("t", conf, key=key)
        q = KafkaParticipant.from_descriptor(p.descriptor(), {})
        assert (q.keys, q.key) == (p.keys, p.key)
