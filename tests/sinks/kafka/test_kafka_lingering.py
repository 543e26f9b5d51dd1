"""A Kafka transaction left open by a SIGKILLed task stalls every read_committed reader at
the last stable offset until the broker's transaction timeout (600 s by default here).
``twophase resolve`` finds it through the AdminClient (ListTransactions /
DescribeTransactions) and aborts it by fencing its transactional.id: the readers go on,
and the partition log and a read_committed consumer agree exactly."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from tests.support.kafka import create_topic, read_all, unique_topic
from twophase.connection import connect
from twophase.resolve import resolve_sink
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.kafka.log import read_log
from twophase.testing.conformance import (
    SCHEMA,
    _prepare_in_child_and_kill,
    batch_for,
    make_branch,
)


def test_resolve_aborts_a_lingering_transaction_that_stalls_readers(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    topic = unique_topic("linger")
    create_topic(kafka_bootstrap, topic)  # one partition: both branches land in it
    p = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, connect_timeout_s=15,
                         prepare="in_task")
    sink = f"linger_{uuid.uuid4().hex[:8]}"
    lineage = uuid.uuid4().hex[:12]
    dead = make_branch(p, sink=sink, lineage=lineage, partition=0)
    _prepare_in_child_and_kill(p, dead)  # its transaction stays open on the broker
    alive = make_branch(p, sink=sink, lineage=lineage, partition=1)
    p.commit(alive, p.prepare(alive, SCHEMA, [batch_for(alive)]))
    committed = sorted(r["id"] for r in batch_for(alive).to_pylist())

    # The stall: the committed branch sits behind the open transaction.
    assert read_all(kafka_bootstrap, topic, idle_s=2.0) == []
    [open_txn] = p.open_transactions(sink)
    assert open_txn.transactional_id == p.transactional_id(dead)
    assert f"{topic}-0" in open_txn.partitions and open_txn.age_s >= 0  # (+ its marker)
    assert p.open_transactions(f"other_{sink}") == []  # another sink's are not its

    conn = connect(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        dry = resolve_sink(conn.client(), sink, [p], dry_run=True)
        assert [(a.txn, a.action) for a in dry.actions] == [
            (f"kafka transaction {open_txn.transactional_id}", "abort")]
        assert len(p.open_transactions(sink)) == 1  # a dry run aborts nothing
        report = resolve_sink(conn.client(), sink, [p])
    finally:
        conn.close()
    assert report.ok and [a.action for a in report.actions] == ["abort"], report.as_dict()
    assert p.open_transactions(sink) == []

    seen = sorted(json.loads(m.value())["id"]
                  for m in read_all(kafka_bootstrap, topic, expect=len(committed)))
    assert seen == committed  # the readers go on: the committed branch, once
    log = read_log({"bootstrap.servers": kafka_bootstrap}, topic)
    assert log.open_transactions == 0
    assert sorted(json.loads(v)["id"] for v in log.committed if v) == seen  # agree
    assert sorted(json.loads(v)["id"] for v in log.aborted if v) == sorted(
        r["id"] for r in batch_for(dead).to_pylist())  # the dead task's rows: aborted
    p.close()


def test_resolve_with_kafka_down_reports_it_unresolved(tmp_path: Path) -> None:
    """Brokers that do not answer leave the lingering check unresolved (report not ok),
    named, instead of failing the whole resolve or passing silently."""
    from twophase.testing.servers import free_port

    down = KafkaParticipant("t-down", {"bootstrap.servers": f"127.0.0.1:{free_port()}"},
                            connect_timeout_s=2, prepare="in_task")
    conn = connect(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        report = resolve_sink(conn.client(), "nothing_open", [down])
    finally:
        conn.close()
    assert not report.ok
    [entry] = report.unresolved
    assert entry.branch == down.name and "cannot list them" in entry.action, entry
