"""A branch voted by the in-task prepare of twophase 0.3 (retired in 0.4), in doubt
across the upgrade, finished by this version on Apache Kafka (``sinks/kafka/legacy.py``):
its open transaction aborted by fencing its transactional.id, a committed one read as
COMMITTED from the log and never written again, an uncommitted one refused naming the
redo. The 0.3 vote is made by hand as 0.3 made it: a producer of the branch's in-task
transactional.id writes the branch's records with its headers and leaves it open."""

from __future__ import annotations

import json
import uuid

import pyarrow as pa
import pytest
from confluent_kafka import Producer

from tests.support.kafka import create_topic, kafka_bootstrap, unique_topic
from twophase.participant import BranchRef, BranchStatus, ParticipantError
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.kafka.log import read_log
from twophase.sinks.kafka.records import headers

__all__ = ["kafka_bootstrap"]  # the fixture, imported for pytest

SCHEMA = pa.schema([("id", pa.int64())])


def _voted_by_0_3(p: KafkaParticipant, b: BranchRef, rows: int, *, commit: bool
                  ) -> dict[str, str]:
    """Write ``rows`` records of branch ``b`` in a transaction of its in-task id; commit
    it or leave it open (the task died after its vote). Returns the 0.3 handle."""
    producer = Producer(p.producer_config(p.transactional_id(b)) | {"log_level": 0})
    producer.init_transactions(15)
    producer.begin_transaction()
    first: dict[int, int] = {}

    def delivered(err: object, msg: object) -> None:
        assert err is None, err
        first.setdefault(msg.partition(), msg.offset())  # type: ignore[attr-defined]

    for i in range(rows):
        producer.produce(p.topic, json.dumps({"id": i}).encode(), partition=0,
                         headers=[(k, v) for k, v in headers(b)], on_delivery=delivered)
    assert producer.flush(15) == 0
    if commit:
        producer.commit_transaction(15)
    handle = p._handle(b, rows, already=False, offsets=first)
    assert "prepare" not in handle  # as 0.3 wrote it
    return handle


@pytest.mark.filterwarnings("ignore:Producer abort_transaction failed during close")
def test_a_0_3_vote_left_open_is_aborted_by_fencing(kafka_bootstrap: str) -> None:
    topic = unique_topic("legacy")
    create_topic(kafka_bootstrap, topic)
    p = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, connect_timeout_s=15)
    b = BranchRef("legacy", uuid.uuid4().hex[:12], 2, 0, p.name, 0)
    handle = _voted_by_0_3(p, b, 7, commit=False)
    assert p.voted_status(b, handle) is BranchStatus.ABSENT
    with pytest.raises(ParticipantError, match=r"retired in-task prepare .* must be redone"):
        p.commit(b, handle)
    p.abort(b, handle)  # a new producer of the id: init_transactions aborts the open one
    log = read_log(p.config, topic)
    assert log.open_transactions == 0 and len(log.aborted) == 7 and not log.committed, log
    p.close()


def test_a_committed_0_3_vote_reads_committed_and_is_not_redone(kafka_bootstrap: str) -> None:
    topic = unique_topic("legacy")
    create_topic(kafka_bootstrap, topic)
    p = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, connect_timeout_s=15)
    b = BranchRef("legacy", uuid.uuid4().hex[:12], 2, 0, p.name, 0)
    handle = _voted_by_0_3(p, b, 5, commit=True)  # no marker: the log is the proof
    assert p.voted_status(b, handle) is BranchStatus.COMMITTED
    p.commit(b, handle)  # committed: nothing to do
    batch = pa.record_batch([pa.array(range(5), pa.int64())], schema=SCHEMA)
    redone = p.redo(b, SCHEMA, [batch], handle)
    assert redone["already_committed"] == "yes" and redone["rows"] == "0", redone
    log = read_log(p.config, topic)
    assert len(log.committed) == 5 and log.open_transactions == 0, log
    p.close()
