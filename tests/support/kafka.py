"""Kafka test support: the suite's Apache Kafka broker, small readers.

- ``kafka_broker`` (session): a private Apache Kafka 4.x broker (KRaft, one node,
  ``twophase.testing.apachekafka.LocalKafka``; jars from Maven, cached) on a free loopback
  port, started once for the session (~4 s) and stopped at its end. Tests that kill a
  broker start their own.
- ``kafka_bootstrap`` (session): its ``bootstrap.servers``; ``$KAFKA_BOOTSTRAP_SERVERS``
  points the same tests at an outside broker instead (then no local broker starts).
- ``secure_kafka`` (session): a second broker whose clients' listener is SASL_SSL (TLS
  with a throw-away CA, SCRAM-SHA-512 or PLAIN) with ACLs enforced; users ``admin``
  (superuser), ``app`` (granted exactly the ACLs docs/user/security.md lists, by
  :func:`grant_app`), ``nobody`` (no ACLs) and ``firstjob`` (no ACLs until
  tests/system/test_new_user.py runs docs/user/first-job.md's ``kafka-acls.sh`` commands:
  a principal of its own, so that what other tests granted ``app`` cannot hide a missing
  line). Started by the tests that use it (~4 s).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from twophase.testing.apachekafka import KafkaSecurity, LocalKafka

OUTSIDE_KAFKA_ENV = "KAFKA_BOOTSTRAP_SERVERS"


def outside_kafka_servers() -> str | None:
    value = os.environ.get(OUTSIDE_KAFKA_ENV, "").strip()
    return value or None


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[LocalKafka]:
    broker = LocalKafka()
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


SECURE_USERS = {"admin": "admin-secret", "app": "app-secret", "nobody": "nobody-secret",
                "firstjob": "firstjob-secret"}


@pytest.fixture
def private_broker(tmp_path: Any) -> Iterator[LocalKafka]:
    """An Apache Kafka broker of the test's own (a test that kills or restarts it), its
    folder and log in ``tmp_path``."""
    broker = LocalKafka(base_dir=str(tmp_path))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def secure_kafka() -> Iterator[LocalKafka]:
    broker = LocalKafka(security=KafkaSecurity(users=SECURE_USERS))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def grant(broker: LocalKafka, user: str, acls: list[tuple[str, str, str, str]]) -> None:
    """Create ALLOW bindings for ``user`` as the superuser: (resource type, name,
    pattern LITERAL/PREFIXED, operation), Kafka's names (CLUSTER, not librdkafka's BROKER)."""
    from confluent_kafka.admin import AclBinding, AdminClient

    admin = AdminClient(broker.client_config())
    bindings = [AclBinding(rtype.replace("CLUSTER", "BROKER"), name, pattern,
                           f"User:{user}", "*", op, "ALLOW")
                for rtype, name, pattern, op in acls]
    for future in admin.create_acls(bindings, request_timeout=15).values():
        future.result(timeout=15)


def grant_app(broker: LocalKafka, topic: str, user: str = "app") -> None:
    """Give ``user`` the ACLs a deployment's principal needs to write ``topic`` (and its
    staging topic) through the Kafka participant: the list
    :func:`twophase.sinks.kafka.acls.required_acls` returns, no more."""
    from twophase.sinks.kafka.acls import required_acls

    grant(broker, user, [(a.resource_type, a.name, a.pattern, a.operation)
                         for a in required_acls(topic)])


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest) -> str:
    outside = outside_kafka_servers()
    if outside:
        return outside
    broker: LocalKafka = request.getfixturevalue("kafka_broker")
    return broker.bootstrap


def unique_topic(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def create_topic(bootstrap: str | dict[str, str], topic: str, partitions: int = 1) -> None:
    """``bootstrap``: the servers, or a whole client config (a secured broker's)."""
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    admin = AdminClient(
        {"bootstrap.servers": bootstrap} if isinstance(bootstrap, str) else dict(bootstrap))
    for future in admin.create_topics([NewTopic(topic, partitions)]).values():
        future.result(timeout=15)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        md = admin.list_topics(topic=topic, timeout=5)
        t = md.topics.get(topic)
        if t is not None and t.error is None and len(t.partitions) == partitions:
            return
        time.sleep(0.1)
    raise AssertionError(f"topic {topic} did not appear")


def read_all(
    bootstrap: str, topic: str, *, isolation: str = "read_committed", idle_s: float = 1.5,
    expect: int | None = None, timeout_s: float = 20.0,
) -> list[Any]:
    """Every message a fresh reader sees from the start of every partition.

    Stops when ``expect`` messages arrived (then waits ``idle_s`` more for extras) or after
    ``idle_s`` without a message.
    """
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": f"reader-{uuid.uuid4().hex}",
        "isolation.level": isolation,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
    })
    try:
        md = c.list_topics(topic=topic, timeout=10)
        parts = sorted(md.topics[topic].partitions)
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        last = time.monotonic()
        while time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is None:
                if expect is not None and len(out) < expect:
                    continue
                if time.monotonic() - last > idle_s:
                    break
                continue
            if msg.error():
                continue
            out.append(msg)
            last = time.monotonic()
        return out
    finally:
        c.close()


def committed_offset(bootstrap: str, group: str, topic: str, *, open_txn: bool = False) -> int:
    """The committed offset of ``group`` on (topic, 0); -1 when none.

    Read stably (KIP-447: the answer waits for a transaction whose commit is being
    completed); ``open_txn=True`` when a transaction holding the group's offsets is known
    to be open: a stable read would wait for it until the timeout, so the committed
    (materialized) offset is read as it is."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    from twophase.sinks.kafka.errors import COORDINATOR_MOVES

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                  "enable.auto.commit": False,
                  "isolation.level": "read_uncommitted" if open_txn else "read_committed"})
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                [tp] = c.committed([TopicPartition(topic, 0)], timeout=10)
                break
            except KafkaException as exc:  # a coordinator still loading: ask again
                if exc.args[0].name() not in COORDINATOR_MOVES or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        return int(tp.offset) if tp.offset is not None and tp.offset >= 0 else -1
    finally:
        c.close()


def kafka_branches_committed(cfg: Any, store_url: str) -> int:
    """Every Kafka branch of every COMMITTED transaction of ``cfg`` (a ``JobConfig``)
    reads COMMITTED over the wire through ``voted_status``, what recovery and ``twophase
    resolve`` ask: its marker, or the partition log from the vote's offsets
    (docs/kafka.md). Returns how many branches were checked."""
    from twophase.coordinator.store import Store
    from twophase.participant import BranchRef, BranchStatus
    from twophase.protocol import parse_branch_id
    from twophase.sinks.kafka import KafkaParticipant
    from twophase.testing.job import build_participants

    kafka = next(p for p in build_participants(cfg) if isinstance(p, KafkaParticipant))
    store = Store(store_url, create=False)
    checked = 0
    try:
        for row in store.list(sink=cfg.sink, limit=100000):
            txn = row.txn
            if txn.state.value != "COMMITTED":
                continue
            for bid, st in txn.branches.items():
                name, partition = parse_branch_id(bid)
                if name != kafka.name:
                    continue
                ref = BranchRef(txn.sink, txn.lineage, txn.batch_id, txn.attempt, name,
                                partition)
                voted = dict(st.handle) if st.handle else None
                assert kafka.voted_status(ref, voted) == BranchStatus.COMMITTED, \
                    (bid, txn.key)
                checked += 1
    finally:
        store.close()
        kafka.close()
    return checked
