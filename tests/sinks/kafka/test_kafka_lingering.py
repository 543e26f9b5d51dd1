"""A Kafka transaction left open by a SIGKILLed task stalls every read_committed reader at
the last stable offset until the broker's transaction timeout (600 s by default here).
``twophase resolve`` finds it through the AdminClient (ListTransactions /
DescribeTransactions) and aborts it by fencing its transactional.id: the readers go on,
and the partition log and a read_committed consumer agree exactly."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.kafka import create_topic, read_all, unique_topic
from twophase.client.connection import connect
from twophase.engine.resolve import resolve_sink
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
    p = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, connect_timeout_s=15)
    sink = f"linger_{uuid.uuid4().hex[:8]}"
    lineage = uuid.uuid4().hex[:12]
    dead = make_branch(p, sink=sink, lineage=lineage, partition=0)
    voted = _prepare_in_child_and_kill(p, dead)  # its transaction stays open on the broker
    alive = make_branch(p, sink=sink, lineage=lineage, partition=1)
    p.commit(alive, p.prepare(alive, SCHEMA, [batch_for(alive)]))
    committed = sorted(r["id"] for r in batch_for(alive).to_pylist())

    # The stall: the committed branch sits behind the open transaction.
    assert read_all(kafka_bootstrap, topic, idle_s=2.0) == []
    [open_txn] = p.open_transactions(sink)
    assert open_txn.transactional_id == voted["transactional_id"]
    assert f"{topic}-0" in open_txn.partitions and open_txn.age_s >= 0  # (+ its marker)
    assert p.open_transactions(f"other_{sink}") == []  # another sink's are not its

    conn = connect(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        dry = resolve_sink(conn.client(operator=True), sink, [p], dry_run=True)
        assert [(a.txn, a.action) for a in dry.actions] == [
            (f"kafka transaction {open_txn.transactional_id}", "abort")]
        assert len(p.open_transactions(sink)) == 1  # a dry run aborts nothing
        report = resolve_sink(conn.client(operator=True), sink, [p])
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
                            connect_timeout_s=2)
    conn = connect(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        report = resolve_sink(conn.client(operator=True), "nothing_open", [down])
    finally:
        conn.close()
    assert not report.ok
    [entry] = report.unresolved
    assert entry.branch == down.name and "cannot list them" in entry.action, entry


@pytest.mark.spark
def test_a_starting_sink_aborts_lingering_transactions_but_not_decided_ones(
    tmp_path: Path, kafka_bootstrap: str, spark: Any
) -> None:
    """Issue 31 item 3: a crash leaves a transaction open that no later batch's
    ``init_transactions`` touches (its partition is not written again); the restarted
    sink aborts it before its first batch, and the readers it stalled go on at once, not
    after ``transaction.timeout.ms``. A transaction of a batch the coordinator holds as
    COMMIT-decided (another run may be committing it) is left alone."""
    from twophase import TransactionalSink
    from twophase.client.wire import VoteIn

    stalled, decided_topic = unique_topic("lstart"), unique_topic("ldecided")
    for t in (stalled, decided_topic):
        create_topic(kafka_bootstrap, t)
    # lingering transactions are resumable prepares' (a staged prepare opens none)
    p = KafkaParticipant(stalled, {"bootstrap.servers": kafka_bootstrap}, connect_timeout_s=15)
    sink, old = f"lstart_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex[:12]
    dead = make_branch(p, sink=sink, lineage=old, partition=5)
    voted = _prepare_in_child_and_kill(p, dead)
    alive = make_branch(p, sink=sink, lineage=old, partition=1)
    p.commit(alive, p.prepare(alive, SCHEMA, [batch_for(alive)]))
    assert read_all(kafka_bootstrap, stalled, idle_s=2.0) == []  # stalled behind `dead`
    assert [t.transactional_id for t in p.open_transactions(sink)] == [
        voted["transactional_id"]]

    store = f"sqlite:///{tmp_path / 'c.db'}"
    rows = [{"id": 900_000 + i, "label": "new", "amount": 1.0} for i in range(4)]
    df = spark.createDataFrame(rows, "id long, label string, amount double")
    started = time.monotonic()
    ts = TransactionalSink(sink, [p], coordinator=store, lineage=uuid.uuid4().hex[:12],
                           partitions=1, preflight=False)
    try:
        ts(df, 0)  # batch 0 of the new run writes partition 0 only, not 5
    finally:
        ts.close()
    assert p.open_transactions(sink) == []
    expected = sorted(r["id"] for r in batch_for(alive).to_pylist()) + [r["id"] for r in rows]
    seen = sorted(json.loads(m.value())["id"]
                  for m in read_all(kafka_bootstrap, stalled, expect=len(expected)))
    assert seen == expected  # the last stable offset moved past the aborted transaction
    assert time.monotonic() - started < p.transaction_timeout_ms / 1000 / 2
    log = read_log({"bootstrap.servers": kafka_bootstrap}, stalled)
    assert log.open_transactions == 0
    assert sorted(json.loads(v)["id"] for v in log.aborted if v) == sorted(
        r["id"] for r in batch_for(dead).to_pylist())
    p.close()

    # The rule's other half: q's batch of another run is COMMIT-decided, its branch 7 not
    # committed yet (its task may be committing it now): spared; its undecided one goes.
    q = KafkaParticipant(decided_topic, {"bootstrap.servers": kafka_bootstrap},
                         connect_timeout_s=15)
    conn = connect(store)
    try:
        client = conn.client()
        epoch = client.register(sink)
        res = client.begin(sink, old, 0, epoch, [q.name], 8, 60.0)
        assert res.txn is not None
        in_flight = make_branch(q, sink=sink, lineage=old, partition=7)
        undecided = make_branch(q, sink=sink, lineage=uuid.uuid4().hex[:12], batch_id=3,
                                partition=9)  # no branch of the decided batch
        handles = {b: _prepare_in_child_and_kill(q, b) for b in (in_flight, undecided)}
        committing = client.vote(res.txn.key, epoch, [
            VoteIn(f"{q.name}/{i}", True, handles[in_flight] if i == 7 else {})
            for i in range(8)])
        assert committing.state.value == "COMMITTING"
        aborted = q.clear_left_open(sink, client)
    finally:
        conn.close()
    assert [t.name for t in aborted] == [handles[undecided]["transactional_id"]]
    assert [t.transactional_id for t in q.open_transactions(sink)] == [
        handles[in_flight]["transactional_id"]]
    q.abort_lingering(sink)  # leave nothing open on the session's broker
    q.close()


def test_the_daemon_shows_a_lingering_transaction_on_metrics_and_console(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    """Issue 31 item 3: `twophase serve` (a real process, `--target-watch 1s`) asks the
    registered sink's Kafka participant, rebuilt from its descriptor, what it holds open:
    /metrics shows the open transaction, its age and the records past the last stable
    offset, the console names them; after `resolve` both show nothing held open."""
    import httpx

    from twophase.participant import descriptor_of
    from twophase.testing.servers import LocalDaemon

    topic = unique_topic("lwatch")
    create_topic(kafka_bootstrap, topic)
    p = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, connect_timeout_s=15)
    sink = f"lwatch_{uuid.uuid4().hex[:8]}"
    dead = make_branch(p, sink=sink, lineage=uuid.uuid4().hex[:12], partition=0)
    _prepare_in_child_and_kill(p, dead)
    rows = batch_for(dead).num_rows
    daemon = LocalDaemon(f"sqlite:///{tmp_path / 'c.db'}", "op-" + uuid.uuid4().hex,
                         tmp_path / "daemon.log", args=("--target-watch", "1s"))
    daemon.start()
    auth = {"Authorization": f"Bearer {daemon.token}"}
    labels = f'participant="{p.name}",sink="{sink}"'
    plabels = f'participant="{p.name}",partition="{topic}-0",sink="{sink}"'

    def scrape(want: str) -> str:
        deadline = time.monotonic() + 60
        while True:
            text = httpx.get(f"{daemon.url}/metrics", timeout=10).text
            if want in text or time.monotonic() > deadline:
                return text
            time.sleep(0.5)

    try:
        conn = connect(daemon.url, token=daemon.token)
        try:
            desc = descriptor_of(p)
            assert desc is not None
            conn.client().register(sink, [desc])
            text = scrape(f"twophase_target_open_transactions{{{labels}}} 1.0")
            assert f"twophase_target_open_transactions{{{labels}}} 1.0" in text, text[-3000:]
            assert f"twophase_target_check_ok{{{labels}}} 1.0" in text
            assert (f'twophase_target_unstable_records{{{plabels}}} '
                    f"{float(rows)}") in text, text[-3000:]  # its records, past the LSO
            page = httpx.get(f"{daemon.url}/ui/view", headers=auth, timeout=10).text
            assert "1 open transaction(s)" in page and f"{topic}-0: {rows}" in page, page
            report = resolve_sink(conn.client(operator=True), sink, [p])
            assert report.ok, report.as_dict()
            text = scrape(f"twophase_target_open_transactions{{{labels}}} 0.0")
            assert f"twophase_target_open_transactions{{{labels}}} 0.0" in text, text[-3000:]
            assert (f'twophase_target_unstable_records{{{plabels}}} '
                    "0.0") in text
        finally:
            conn.close()
    finally:
        daemon.stop()
        p.close()
