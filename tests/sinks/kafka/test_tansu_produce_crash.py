"""A tansu defect the chaos run's ``broker`` victim found (docs/chaos.md, "Broker kills"):
tansu on S3 storage, SIGKILLed while a transactional producer is producing, loses
records it had not written yet but whose producer sequence it had recorded. After the
restart librdkafka retries the in-flight batch; tansu answers
DUPLICATE_SEQUENCE_NUMBER, which in Kafka's protocol means "already written", so
librdkafka marks the records delivered ("previous send succeeded but was not
acknowledged"), the commit succeeds, and the log lacks them (sometimes a reserved,
empty offset range, sometimes nothing at all). A Kafka broker rebuilds its producer
state from the log, so a sequence it acknowledges is always in it.

No twophase code is involved: a plain confluent-kafka transactional producer, a new one
per transaction. This test fails the day a tansu without the defect ships: then the
chaos run's broker kills can be expected to pass, and this test must go.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import threading
import time
from collections.abc import Iterator

import pytest

from tests.kafka_support import create_topic
from twophase.sinks.kafka.log import read_log
from twophase.testing.localkafka import LocalTansu
from twophase.testing.locals3 import LocalS3

ROWS, PARTITIONS, TRIALS = 400, 3, 10


@pytest.fixture
def durable_tansu(s3: LocalS3) -> Iterator[LocalTansu]:
    bucket = s3.create_bucket(f"dupseq-{secrets.token_hex(4)}")
    broker = LocalTansu(storage=f"s3://{bucket}/", s3={
        "endpoint": s3.endpoint, "access_key": s3.access_key, "secret_key": s3.secret_key,
        "region": s3.region})
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _trial(broker: LocalTansu, n: int, rng: random.Random) -> tuple[list[int], list[str]]:
    """One transaction of ROWS records over PARTITIONS partitions, flushed every 20, the
    broker killed at a random moment of it and restarted; returns the committed ids
    read from the log and librdkafka's eos/msg debug lines."""
    from confluent_kafka import Producer

    topic = f"dupseq-{secrets.token_hex(3)}"
    create_topic(broker.bootstrap, topic, PARTITIONS)
    lines = _Lines()
    logger = logging.getLogger(f"dupseq.{topic}")
    logger.addHandler(lines)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    producer = Producer({"bootstrap.servers": broker.bootstrap, "transactional.id":
                         f"dupseq.{n}", "debug": "eos,msg", "logger": logger})
    producer.init_transactions(30)
    producer.begin_transaction()
    delay = rng.uniform(0.0, 0.8)

    def crash() -> None:
        time.sleep(delay)
        broker.kill()
        time.sleep(rng.uniform(0.5, 2.0))
        broker.restart()

    killer = threading.Thread(target=crash)
    killer.start()
    for i in range(ROWS):
        producer.produce(topic, json.dumps({"id": i}).encode(), partition=i % PARTITIONS)
        if i % 20 == 19:
            producer.flush(60)
    killer.join()
    producer.flush(60)
    producer.commit_transaction(60)  # succeeds: librdkafka believes every record landed
    producer.poll(0)
    time.sleep(2.0)  # tansu on S3: a partition's end is read from second-resolution stamps
    log = read_log({"bootstrap.servers": broker.bootstrap}, topic, settle_s=5.0)
    assert log.open_transactions == 0 and not log.aborted, log
    return sorted(json.loads(v or b"{}")["id"] for v in log.committed), lines.lines


def test_tansu_loses_records_it_acknowledged_as_duplicates(durable_tansu: LocalTansu) -> None:
    rng = random.Random(1)
    seen = []
    for n in range(TRIALS):
        ids, lines = _trial(durable_tansu, n, rng)
        assert len(set(ids)) == len(ids), "a duplicate: not this defect"
        seen.append(len(ids))
        if len(ids) < ROWS:
            # the retried batch was answered "duplicate sequence" and counted delivered
            assert any("duplicate sequence number" in x for x in lines), lines[-40:]
            return
    pytest.fail(f"tansu kept every acknowledged record through {TRIALS} crashes ({seen}): "
                "the defect is fixed? see the module docstring")
