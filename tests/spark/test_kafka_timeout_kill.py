"""Kafka's transaction timeout against a driver that is down, end to end on real Spark.

A resumable Kafka branch is a transaction the task left open; the broker aborts it once
``transaction_timeout_ms`` passes. A driver SIGKILLed (its whole process group) after
the Kafka branches voted and before their ``EndTxn``, and kept down until the broker has
aborted them, must still end with every row once when it restarts from its checkpoint:

- killed before the decision is written: no decision means abort; the restart finds the
  Kafka branches ABSENT, rolls back the other systems' prepared branches and a new
  attempt writes the batch again from Spark's replay;
- killed after a COMMIT decision, before the Kafka branches' commit (PostgreSQL and the
  local files committed): the restart finds them ABSENT under COMMIT and redoes them
  from Spark's replay, digest-checked, committing them at once.

The broker is this module's own, with a short ``transaction.max.timeout.ms``: the sink's
transaction timeout is the shortest it accepts for the vote window (``vote_timeout`` +
60 s, ``KafkaParticipant.check_vote_window``), which is why these tests are slow.
Judged by the partition logs and a ``read_committed`` consumer (``verify``), and by the
path itself: the broker's abort seen in the log before the restart, the handles reading
ABSENT, the restart's report (a new attempt, or the branches redone)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.driver_kill import kill_when_held, prepared, start_driver
from tests.support.kafka import create_topic, unique_topic
from twophase import TransactionalSink, failpoints
from twophase.coordinator.store import Store
from twophase.errors import ParticipantError
from twophase.participant import BranchRef, BranchStatus
from twophase.protocol import State, Transaction, parse_branch_id
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.kafka.log import read_log
from twophase.sinks.postgres import PostgresParticipant
from twophase.testing.apachekafka import LocalKafka
from twophase.testing.job import JobConfig, build_participants, expected_ids, write_input
from twophase.testing.verify import verify

pytestmark = [pytest.mark.spark, pytest.mark.real_kafka]

ROWS = 40
PARTITIONS = 2
VOTE_TIMEOUT = 20.0  # the first batch's tasks start Python workers on a busy machine
TXN_TIMEOUT_MS = int((VOTE_TIMEOUT + 61) * 1000)  # the least the sink accepts: 81 s
BROKER_MAX_MS = TXN_TIMEOUT_MS  # Kafka's default is 15 minutes


@pytest.fixture(scope="module")
def short_max_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """An Apache Kafka broker whose transactions may last no longer than
    :data:`BROKER_MAX_MS`, looking for expired ones every second."""
    broker = LocalKafka(base_dir=str(tmp_path_factory.mktemp("kafka")), config={
        "transaction.max.timeout.ms": str(BROKER_MAX_MS),
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": "1000",
    })
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def _batch0(cfg: JobConfig) -> dict[int, Transaction]:
    """The coordinator's record of batch 0, by attempt."""
    store = Store(cfg.coordinator, create=False)
    try:
        return {r.txn.attempt: r.txn for r in store.list(sink=cfg.sink, limit=1000)
                if r.txn.batch_id == 0}
    finally:
        store.close()


def _voted_kafka_status(kafka: KafkaParticipant, txn: Transaction) -> list[BranchStatus]:
    """What each Kafka branch with a recorded vote reads from the broker."""
    out = []
    for bid, st in txn.branches.items():
        name, partition = parse_branch_id(bid)
        if name == kafka.name and st.handle:
            ref = BranchRef(txn.sink, txn.lineage, txn.batch_id, txn.attempt, name, partition)
            out.append(kafka.voted_status(ref, dict(st.handle)))
    return out


def _wait_for_the_broker_abort(kafka: KafkaParticipant, sink: str) -> None:
    """Until the broker has aborted the dead driver's open transactions; asserts they
    were open and lived their whole timeout (nothing else ended them)."""
    open_now = kafka.open_transactions(sink)
    assert len(open_now) == PARTITIONS, open_now  # both branches' transactions open
    oldest = max(t.age_s for t in open_now)
    began = time.monotonic()
    deadline = began + TXN_TIMEOUT_MS / 1000 + 60
    while kafka.open_transactions(sink):
        assert time.monotonic() < deadline, "the broker never aborted the transactions"
        time.sleep(1.0)
    lived = oldest + time.monotonic() - began
    assert lived >= TXN_TIMEOUT_MS / 1000 - 2, lived


@pytest.mark.slow  # the broker's abort comes 81 s after the prepare: about 2.5 minutes
@pytest.mark.parametrize("held", ["before_decision", "before_commit"])
def test_driver_down_past_the_transaction_timeout_ends_exactly_once(
    held: str, tmp_path: Path, pg_dsn: str, short_max_broker: LocalKafka,
) -> None:
    bootstrap = short_max_broker.bootstrap
    tag = secrets.token_hex(3)
    topic = unique_topic("ktimeout")
    create_topic(bootstrap, topic, partitions=PARTITIONS)
    cfg = JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", sink=f"kt{tag}", pg_dsn=pg_dsn,
        pg_table=f"kt_{tag}", files_path=str(tmp_path / "out"), kafka_bootstrap=bootstrap,
        kafka_topic=topic, kafka_transaction_timeout_ms=TXN_TIMEOUT_MS,
        partitions=PARTITIONS, input_partitions=PARTITIONS, vote_timeout=VOTE_TIMEOUT,
    )
    parts = build_participants(cfg)
    kafka = next(p for p in parts if isinstance(p, KafkaParticipant))
    assert kafka.prepare_mode == "resumable"
    if held == "before_decision":  # every vote in, the decision not written
        spec, firings = "coordinator_before_decision=sleep(120)*1", 1
    else:  # COMMIT written; each Kafka branch held before its EndTxn, the others commit
        spec, firings = f"before_commit@{kafka.name}=sleep(120)*{PARTITIONS}", PARTITIONS
    cfg_path, log, once = tmp_path / "job.json", tmp_path / "job.log", tmp_path / "once"
    cfg.dump(cfg_path)
    write_input(cfg.input_dir, 1, ROWS)
    driver = start_driver(cfg_path, {failpoints.ENV: spec, failpoints.ONCE_DIR_ENV: str(once)},
                          log)
    kill_when_held(driver, once, log, firings)

    # Down past the timeout: the broker aborts both transactions, nothing else runs.
    _wait_for_the_broker_abort(kafka, cfg.sink)
    before = read_log({"bootstrap.servers": bootstrap}, topic, timeout=60)
    assert (before.committed, len(before.aborted), before.open_transactions) == ([], ROWS, 0)
    [first] = _batch0(cfg).values()
    assert (first.decision is None) == (held == "before_decision"), first
    # the handles of the votes the coordinator recorded read ABSENT from the broker; the
    # driver sends the tasks' votes with the decision's write, so before the decision
    # none may be recorded (then the restart aborts what is open by the pool's names)
    statuses = _voted_kafka_status(kafka, first)
    assert set(statuses) <= {BranchStatus.ABSENT}, statuses
    if held == "before_commit":
        assert statuses == [BranchStatus.ABSENT] * PARTITIONS, statuses

    write_input(cfg.input_dir, 1, ROWS, first=1)
    last = start_driver(cfg_path, {}, log)
    out, _ = last.communicate(timeout=600)
    assert last.returncode == 0, log.read_text()[-4000:]
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert lines[-1] == {"done": True}, lines
    [b0] = [x for x in lines if x.get("batch") == 0]
    [b1] = [x for x in lines if x.get("batch") == 1]
    attempts = _batch0(cfg)
    if held == "before_decision":  # presumed abort, then a new attempt from the replay
        assert (b0["outcome"], b0["attempts"], b0["redone"]) == ("committed", 2, 0), b0
        assert attempts[1].state is State.ABORTED and attempts[2].state is State.COMMITTED
    else:  # the COMMIT stands; the lost Kafka branches written again and committed
        assert (b0["outcome"], b0["redone"]) == ("recovered", PARTITIONS), b0
        assert list(attempts) == [1] and attempts[1].state is State.COMMITTED, attempts
    assert (b1["outcome"], b1["attempts"], b1["redone"]) == ("committed", 1, 0), b1

    report = verify(build_participants(cfg), expected_ids(2, ROWS), sink=cfg.sink)
    assert report.ok, report.lines()
    assert [s.rows for s in report.systems] == [ROWS * 2] * 3, report.lines()
    judged = next(s for s in report.systems if s.kind == "kafka")
    assert judged.exact and "a read_committed consumer agrees" in judged.note, judged.note
    # the broker's abort is the only one: the restart aborted nothing more
    assert (judged.aborted, judged.open_transactions) == (ROWS, 0), report.lines()
    assert kafka.open_transactions(cfg.sink) == []
    assert [g for g in prepared(pg_dsn) if cfg.sink in g] == []


def test_a_timeout_over_the_broker_maximum_is_refused_before_the_first_write(
    spark: Any, tmp_path: Path, pg_dsn: str, kafka_bootstrap: str,
) -> None:
    """The sink's first batch asks the broker for its ``transaction.max.timeout.ms``
    (the suite's broker keeps Kafka's 15 minutes) before anything is written: the error
    names both numbers and the fix, and no system holds a row or an open transaction."""
    tag = secrets.token_hex(3)
    topic = unique_topic("overmax")
    create_topic(kafka_bootstrap, topic, partitions=2)
    pg = PostgresParticipant(dsn=pg_dsn, table=f"om_{tag}")
    kafka = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap},
                             transaction_timeout_ms=900_001, connect_timeout_s=15)
    store = f"sqlite:///{tmp_path / 'c.db'}"
    sink = TransactionalSink(f"om{tag}", [pg, kafka], store, lineage="om-1")
    try:
        with pytest.raises(ParticipantError,
                           match=r"transaction_timeout_ms=900001 exceeds the broker's "
                                 r"transaction.max.timeout.ms=900000; lower it or raise "
                                 r"the broker setting"):
            sink(spark.range(0, 100).selectExpr("id", "concat('row ', id) as label"), 0)
    finally:
        sink.close()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # no table, or an empty one
        name = f'"{pg.schema}"."{pg.table}"'
        if conn.execute("SELECT to_regclass(%s)", (name,)).fetchone() != (None,):
            assert conn.execute(f"SELECT count(*) FROM {name}").fetchone() == (0,)
    report = verify([kafka], [], sink=sink.name)
    assert report.ok and report.systems[0].rows == 0, report.lines()
    log = read_log({"bootstrap.servers": kafka_bootstrap}, topic)
    assert [p.high_watermark for p in log.partitions] == [0, 0]  # not even aborted records
    assert kafka.open_transactions(sink.name) == []
    assert [g for g in prepared(pg_dsn) if sink.name in g] == []
    if (tmp_path / "c.db").exists():  # no attempt was begun
        s = Store(store, create=False)
        try:
            assert s.list(sink=sink.name) == []
        finally:
            s.close()
