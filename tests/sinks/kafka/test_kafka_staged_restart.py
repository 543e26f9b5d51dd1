"""The staged Kafka commit across a broker crash: copy producers kept across batches
once lived through a SIGKILL and restart of the broker, and the next batch's copy
blocked in librdkafka's ``send_offsets_to_transaction`` past its timeout until the
broker's transaction timeout (10 minutes by default) ended it: a silent stall of the
driver's commit. (A copy's producer is now made for the copy and closed after it.)

One broker of its own (the test kills it); Kafka judged by its partition log and a
``read_committed`` consumer (``read_back``: they must agree, nothing open), exactly once.
"""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from tests.sinks.kafka.test_kafka_participant import SCHEMA, batch, branch
from tests.support.kafka import committed_offset, create_topic, private_broker, unique_topic
from twophase.participant import BranchRef, Handle
from twophase.sinks.kafka import KafkaParticipant
from twophase.testing.apachekafka import LocalKafka

CONNECT_S = 5.0
TXN_TIMEOUT_MS = 120_000  # the stall this test catches lasts this long


__all__ = ["private_broker"]  # the fixture, imported for pytest


@pytest.fixture
def broker(private_broker: LocalKafka) -> LocalKafka:
    """An Apache Kafka broker of its own (this test kills it)."""
    return private_broker


def _commit_all(driver: list[KafkaParticipant], refs: list[BranchRef],
                handles: list[Handle], limit: float) -> None:
    """Commit each branch from its own thread and driver copy (the Committer's lanes);
    fails when one has not returned within ``limit`` seconds."""
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            driver[i].commit(refs[i], handles[i])
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    began = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(refs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, began + limit - time.monotonic()))
    taken = time.monotonic() - began
    stuck = sum(t.is_alive() for t in threads)
    assert not stuck, f"{stuck} staged commit(s) still blocked after {taken:.0f}s"
    assert not errors, errors


def test_staged_commit_after_a_broker_restart_does_not_stall(broker: LocalKafka) -> None:
    topic = unique_topic()
    create_topic(broker.bootstrap, topic)
    p = KafkaParticipant(topic, {"bootstrap.servers": broker.bootstrap}, key="k",
                         prepare="staged", connect_timeout_s=CONNECT_S,
                         transaction_timeout_ms=TXN_TIMEOUT_MS)
    p.check(SCHEMA)
    driver = [pickle.loads(pickle.dumps(p)) for _ in range(2)]  # kept across batches
    first = branch(p, batch_id=0)
    lineage, rows = first.lineage, 0
    for batch_id in range(2):
        refs = [branch(p, batch_id=batch_id, partition=i, lineage=lineage) for i in range(2)]
        task = pickle.loads(pickle.dumps(p))
        handles: list[Handle] = [task.prepare(r, SCHEMA, [batch(rows + 30 * i, 30)])
                                 for i, r in enumerate(refs)]
        task.close()
        rows += 60
        if batch_id == 1:  # the lanes are idle, their producers connected: crash
            assert broker.kill()
            broker.restart()
        _commit_all(driver, refs, handles, limit=6 * CONNECT_S)
        _commit_all(driver, refs, handles, limit=2 * CONNECT_S)  # marked: no-ops
    back = p.read_back("id")
    assert back.exact and back.open == 0 and back.mismatch == 0, back.note
    assert sorted(back.values) == list(range(rows))  # every row once
    for i in range(2):
        ref = branch(p, batch_id=1, partition=i, lineage=lineage)
        assert committed_offset(broker.bootstrap, p.marker_group(ref), topic) == 2
    for d in driver:
        d.close()
