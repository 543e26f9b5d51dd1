"""Kafka producers reused across batches in one process (sinks/kafka/producers.py and intask.py,
``PRODUCERS``), against tansu: reuse, a cached producer fenced by another process, and a
worker killed while holding a cached producer. Exactly-once is judged from the partition
logs (COMMIT/ABORT markers), never from a tansu read_committed reader."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from pathlib import Path

import pyarrow as pa

from tests.support.kafka import committed_offset, create_topic, kafka_bootstrap, unique_topic
from twophase.participant import BranchRef, BranchStatus
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.kafka.participant import PRODUCERS
from twophase.sinks.kafka.producers import cache_key

__all__ = ["kafka_bootstrap"]  # the fixture, imported for pytest

SCHEMA = pa.schema([("id", pa.int64()), ("label", pa.string())])
ROOT = Path(__file__).resolve().parents[3]


def rows(batch_id: int, n: int = 20) -> list[pa.RecordBatch]:
    ids = [batch_id * 1000 + i for i in range(n)]
    return [pa.record_batch([pa.array(ids, pa.int64()), pa.array([f"r{i}" for i in ids])],
                            schema=SCHEMA)]


def make(bootstrap: str) -> KafkaParticipant:
    topic = unique_topic("reuse")
    create_topic(bootstrap, topic)
    return KafkaParticipant(topic, {"bootstrap.servers": bootstrap}, connect_timeout_s=10.0,
                            reuse_clients=True, prepare="in_task")


def ref(p: KafkaParticipant, lineage: str, batch_id: int) -> BranchRef:
    return BranchRef("orders", lineage, batch_id, 1, p.name, 0)


def task(p: KafkaParticipant, lineage: str, batch_id: int) -> object:
    """What one Spark task does with its own unpickled participant: prepare, commit,
    close; returns the producer that wrote the batch."""
    own: KafkaParticipant = pickle.loads(pickle.dumps(p))
    b = ref(own, lineage, batch_id)
    handle = own.prepare(b, SCHEMA, rows(batch_id))
    producer = own._prepared[b].producer
    own.commit(b, handle)
    own.close()
    return producer


def committed_ids(p: KafkaParticipant) -> Counter[int]:
    back = p.read_back("id")
    assert back.open == 0, back
    return Counter(int(v) for v in back.values)


def want(*batches: int) -> Counter[int]:
    return Counter(b * 1000 + i for b in batches for i in range(20))


def test_a_producer_is_reused_by_the_next_batch_in_the_process(kafka_bootstrap: str) -> None:
    p = make(kafka_bootstrap)
    lineage = uuid.uuid4().hex[:16]
    first = task(p, lineage, 0)
    assert PRODUCERS.take(cache_key(p, ref(p, lineage, 0))) is first  # idle after commit
    PRODUCERS.put(cache_key(p, ref(p, lineage, 0)), first)
    second = task(p, lineage, 1)
    third = task(p, lineage, 2)
    assert first is second is third  # one producer, no init_transactions after the first
    assert committed_offset(kafka_bootstrap, p.marker_group(ref(p, lineage, 2)), p.topic) == 3
    assert committed_ids(p) == want(0, 1, 2)
    # an aborted batch leaves the producer healthy too; the retry reuses it
    own: KafkaParticipant = pickle.loads(pickle.dumps(p))
    b3 = ref(own, lineage, 3)
    own.abort(b3, own.prepare(b3, SCHEMA, rows(3)))
    assert task(p, lineage, 3) is first
    assert committed_ids(p) == want(0, 1, 2, 3)
    # a redo of a committed batch begins no transaction and keeps the producer
    again: KafkaParticipant = pickle.loads(pickle.dumps(p))
    assert again.prepare(b3, SCHEMA, rows(3))["already_committed"] == "yes"
    assert task(p, lineage, 4) is first
    assert committed_ids(p) == want(0, 1, 2, 3, 4)


def _init_elsewhere(p: KafkaParticipant, branch: BranchRef) -> None:
    """Another process initialises the branch's transactional.id (a retried task on
    another worker would): the broker fences every earlier producer of that id."""
    code = textwrap.dedent("""
        import json, sys
        from confluent_kafka import Producer
        producer = Producer(json.loads(sys.argv[1]))
        producer.init_transactions(10)
        producer.close()
    """)
    cfg = p.producer_config(p.transactional_id(branch))
    subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], check=True, timeout=60)


def test_a_cached_producer_fenced_by_another_process_is_replaced(kafka_bootstrap: str) -> None:
    """The cached producer is fenced by another process's init: the next batch's prepare
    finds out at its first broker call (the marker offset, before any row), drops it and
    writes the batch once with a new producer; nothing is written twice."""
    p = make(kafka_bootstrap)
    lineage = uuid.uuid4().hex[:16]
    first = task(p, lineage, 0)
    _init_elsewhere(p, ref(p, lineage, 1))
    second = task(p, lineage, 1)
    assert second is not first
    assert committed_offset(kafka_bootstrap, p.marker_group(ref(p, lineage, 1)), p.topic) == 2
    back = p.read_back("id")
    assert back.aborted == 0  # the fenced producer produced nothing
    assert committed_ids(p) == want(0, 1)
    assert task(p, lineage, 2) is second  # the replacement is cached in turn
    assert committed_ids(p) == want(0, 1, 2)


WORKER = textwrap.dedent("""
    import pickle, sys, time
    sys.path.insert(0, sys.argv[3])
    from tests.sinks.kafka.test_kafka_reuse import SCHEMA, ref, rows, task
    p = pickle.loads(bytes.fromhex(sys.argv[1]))
    lineage = sys.argv[2]
    task(p, lineage, 0)  # committed: its producer waits in the cache
    own = pickle.loads(pickle.dumps(p))
    b = ref(own, lineage, 1)
    own.prepare(b, SCHEMA, rows(1))  # batch 1 on the cached producer: open, flushed
    print("ready", flush=True)
    time.sleep(600)
""")


def test_a_worker_killed_holding_a_cached_producer(kafka_bootstrap: str) -> None:
    """A Python worker commits batch 0, reuses its cached producer for batch 1 and is
    SIGKILLed with that transaction open. A new process finds the branch ABSENT, redoes
    it (its init fences the dead producer and aborts its transaction) and the next batch
    reuses the new producer: every row committed once, the dead transaction aborted."""
    p = make(kafka_bootstrap)
    lineage = uuid.uuid4().hex[:16]
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, pickle.dumps(p).hex(), lineage, str(ROOT)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "ready"
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(30)
    here: KafkaParticipant = pickle.loads(pickle.dumps(p))
    b1 = ref(here, lineage, 1)
    assert here.status(b1) is BranchStatus.ABSENT  # died with its producer: redo
    redo = task(p, lineage, 1)
    assert task(p, lineage, 2) is redo
    back = p.read_back("id")
    assert back.aborted == 20  # the killed worker's batch 1, aborted by the new init
    assert committed_ids(p) == want(0, 1, 2)


def test_a_redo_never_reuses_a_cached_producer(kafka_bootstrap: str) -> None:
    """A redo must fence every older producer of the id before it reads the marker and
    the log: it starts a new producer even when this process holds an idle one."""
    p = make(kafka_bootstrap)
    lineage = uuid.uuid4().hex[:16]
    cached = task(p, lineage, 0)
    own: KafkaParticipant = pickle.loads(pickle.dumps(p))
    b1 = ref(own, lineage, 1)
    handle = own.redo(b1, SCHEMA, rows(1), {})
    redone = own._prepared[b1].producer
    assert redone is not cached
    own.commit(b1, handle)
    assert task(p, lineage, 2) is redone  # the redo's producer serves the next batch
    assert committed_ids(p) == want(0, 1, 2)
