"""The resumable prepare against Apache Kafka: the task's transaction left open, committed or
aborted from its vote's handle alone by another process (``EndTxn`` on Kafka's wire).

Each ending of the preparing process (SIGKILL right after the vote, a normal interpreter
exit, the producer dropped and collected with the participant closed) must leave the
transaction open for another process to commit: judged by the partition-log reader and a
``read_committed`` consumer, which must agree (``read_back``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pyarrow as pa
import pytest

from tests.support.kafka import create_topic, kafka_bootstrap, unique_topic
from twophase.errors import InvalidRequest
from twophase.participant import BranchRef, BranchStatus, ParticipantError
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.kafka.resumable import SLOTS, pool_id
from twophase.sinks.kafka.txnwire import describe_transaction

__all__ = ["kafka_bootstrap"]

pytestmark = [pytest.mark.real_kafka]

SCHEMA = pa.schema([("id", pa.int64())])

CHILD = r"""
import gc, json, os, signal, sys
import pyarrow as pa
from twophase.participant import BranchRef
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.kafka import resumable
boot, topic, lineage, ending = sys.argv[1:5]
p = KafkaParticipant(topic, {"bootstrap.servers": boot}, prepare="resumable",
                     connect_timeout_s=10.0)
b = BranchRef("orders", lineage, 3, 0, p.name, 0)
rows = pa.record_batch([pa.array(list(range(50)), pa.int64())], names=["id"])
handle = p.prepare(b, rows.schema, [rows])
print(json.dumps(handle), flush=True)
if ending == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if ending == "drop":  # a worker reused for the next task: the task's objects collected
    p.close()
    resumable.PARKED.clear()
    del p
    gc.collect()
"""


def make(bootstrap: str, **kw: object) -> KafkaParticipant:
    topic = unique_topic("res")
    create_topic(bootstrap, topic)
    kw.setdefault("connect_timeout_s", 10.0)
    return KafkaParticipant(topic, {"bootstrap.servers": bootstrap}, prepare="resumable",
                            **kw)  # type: ignore[arg-type]


def ref(p: KafkaParticipant, lineage: str, batch_id: int = 3, attempt: int = 0) -> BranchRef:
    return BranchRef("orders", lineage, batch_id, attempt, p.name, 0)


def rows(start: int, n: int) -> pa.RecordBatch:
    return pa.record_batch([pa.array(list(range(start, start + n)), pa.int64())],
                           schema=SCHEMA)


def committed_ids(p: KafkaParticipant) -> list[int]:
    back = p.read_back("id")  # the log judge, cross-checked with read_committed
    assert back.exact, back.note
    return sorted(int(v) for v in back.values)


@pytest.mark.parametrize("ending", ["kill", "exit", "drop"])
def test_another_process_commits_from_the_handle(kafka_bootstrap: str, ending: str) -> None:
    p = make(kafka_bootstrap)
    lineage = uuid.uuid4().hex[:16]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", CHILD, kafka_bootstrap, p.topic, lineage,
                          ending], capture_output=True, text=True, timeout=60, env=env)
    handle = json.loads(out.stdout.splitlines()[0])
    assert out.returncode == (-9 if ending == "kill" else 0), out.stderr[-2000:]
    assert handle["prepare"] == "resumable" and handle["partitions"] == "0"
    b = ref(p, lineage)
    assert p.voted_status(b, handle) is BranchStatus.PREPARED
    state = describe_transaction(p.config, handle["transactional_id"], 10)
    assert state is not None and state.state == "Ongoing"
    assert (state.producer_id, state.producer_epoch) == (
        int(handle["producer_id"]), int(handle["producer_epoch"]))
    p.commit(b, handle)
    p.commit(b, handle)  # idempotent
    assert p.voted_status(b, handle) is BranchStatus.COMMITTED
    assert committed_ids(p) == list(range(50))


def test_abort_from_the_handle_and_without_it(kafka_bootstrap: str) -> None:
    p = make(kafka_bootstrap)
    lineage = uuid.uuid4().hex[:16]
    b = ref(p, lineage)
    handle = p.prepare(b, SCHEMA, [rows(0, 10)])
    other = make(kafka_bootstrap)  # no shared state: the handle alone
    other.topic, other.name = p.topic, p.name
    other.abort(b, handle)
    other.abort(b, handle)
    assert other.voted_status(b, handle) is BranchStatus.ABSENT
    b2 = ref(p, lineage, batch_id=4)
    p.prepare(b2, SCHEMA, [rows(10, 10)])
    other.abort(b2, None)  # the vote was lost: what is open on the pool ids is aborted
    for slot in range(SLOTS):
        st = describe_transaction(p.config, pool_id(p, b2, slot), 10)
        assert st is None or st.state != "Ongoing"
    assert committed_ids(p) == []


def test_status_absent_when_the_id_was_initialised_again(kafka_bootstrap: str) -> None:
    """The broker ended it otherwise (here: the id initialised by another producer): the
    commit says the branch must be redone, the status reads ABSENT, and the redo's
    commit lands the rows once."""
    from confluent_kafka import Producer

    p = make(kafka_bootstrap)
    b = ref(p, uuid.uuid4().hex[:16])
    handle = p.prepare(b, SCHEMA, [rows(0, 20)])
    fencer = Producer(p.producer_config(handle["transactional_id"]))
    fencer.init_transactions(10)  # aborts the open transaction
    assert p.voted_status(b, handle) is BranchStatus.ABSENT
    with pytest.raises(ParticipantError, match=r"ended by the broker .*must be redone"):
        p.commit(b, handle)
    again = p.redo(b, SCHEMA, [rows(0, 20)], handle)
    p.commit(b, again)
    assert committed_ids(p) == list(range(20))
    done = p.redo(b, SCHEMA, [rows(0, 20)], again)  # committed: nothing written
    assert done["already_committed"] == "yes"
    p.commit(b, done)
    assert committed_ids(p) == list(range(20))


def test_status_absent_after_the_transaction_timeout(kafka_bootstrap: str) -> None:
    p = make(kafka_bootstrap, transaction_timeout_ms=1000)
    b = ref(p, uuid.uuid4().hex[:16])
    handle = p.prepare(b, SCHEMA, [rows(0, 5)])
    deadline = time.monotonic() + 20
    while p.voted_status(b, handle) is BranchStatus.PREPARED:
        assert time.monotonic() < deadline, "the broker never timed the transaction out"
        time.sleep(0.5)
    assert p.voted_status(b, handle) is BranchStatus.ABSENT
    with pytest.raises(ParticipantError, match="must be redone"):
        p.commit(b, handle)
    assert committed_ids(p) == []


def test_another_attempt_does_not_fence_the_first(kafka_bootstrap: str) -> None:
    """A retried or speculative copy of the same partition takes another pool id: the
    first attempt's transaction stays open and commits from its handle."""
    p = make(kafka_bootstrap)
    b = ref(p, uuid.uuid4().hex[:16])
    first = p.prepare(b, SCHEMA, [rows(0, 10)])
    second = p.prepare(b, SCHEMA, [rows(0, 10)])
    assert first["transactional_id"] != second["transactional_id"]
    assert p.voted_status(b, first) is BranchStatus.PREPARED
    p.commit(b, first)
    p.abort(b, second)
    assert committed_ids(p) == list(range(10))


def test_new_batch_does_not_abort_a_commit_not_yet_ended(kafka_bootstrap: str) -> None:
    """A driver killed between the COMMIT decision and ``EndTxn``: a new batch on the
    same partition must not abort the decided transaction (its id is skipped), which
    then commits from its handle."""
    p = make(kafka_bootstrap)
    lineage = uuid.uuid4().hex[:16]
    decided = p.prepare(ref(p, lineage, batch_id=3), SCHEMA, [rows(0, 10)])
    later = p.prepare(ref(p, lineage, batch_id=4), SCHEMA, [rows(10, 10)])
    assert later["transactional_id"] != decided["transactional_id"]
    p.commit(ref(p, lineage, batch_id=3), decided)
    p.commit(ref(p, lineage, batch_id=4), later)
    assert committed_ids(p) == list(range(20))


def test_pool_ids_are_bounded(kafka_bootstrap: str) -> None:
    """Ids do not grow with batches: ten batches of one partition use one pool id."""
    p = make(kafka_bootstrap)
    lineage = uuid.uuid4().hex[:16]
    seen = set()
    for n in range(10):
        b = ref(p, lineage, batch_id=n)
        h = p.prepare(b, SCHEMA, [rows(n, 1)])
        p.commit(b, h)
        seen.add(h["transactional_id"])
    assert seen == {pool_id(p, ref(p, lineage), 0)}
    assert committed_ids(p) == list(range(10))


def test_vote_window_longer_than_the_transaction_timeout_is_refused() -> None:
    p = KafkaParticipant("t", {"bootstrap.servers": "127.0.0.1:1"}, prepare="resumable",
                         transaction_timeout_ms=60_000)
    with pytest.raises(InvalidRequest, match=r"transaction_timeout_ms=60000 .*vote_timeout"):
        p.check_vote_window(120)


def test_a_finish_task_redoes_a_lost_branch_and_the_driver_commits_it(
    kafka_bootstrap: str, tmp_path: object
) -> None:
    """One commit path: COMMIT decided, the branch's transaction ended by the broker
    (lost). The finish's task redoes it from the replay and commits nothing: its new
    transaction is open, no ``read_committed`` reader sees a row, nothing is
    acknowledged. The driver's ``Committer.apply`` commits it from the redone handle:
    every row once, nothing left open."""
    from confluent_kafka import Producer

    from twophase.client.connection import connect
    from twophase.engine.commit import Committer
    from twophase.engine.decide import decide, votes_of
    from twophase.engine.plan import FINISH, PREPARE, BatchPlan, redone_handles
    from twophase.engine.task import run_partition
    from twophase.protocol import BeginKind, State

    p = make(kafka_bootstrap)
    sink = "kfinish"
    conn = connect(f"sqlite:///{tmp_path}/c.db")
    try:
        client = conn.client()

        def begin(epoch: int) -> tuple[BatchPlan, BeginKind]:
            res = client.begin(sink, "lin-1", 0, epoch, [p.name], 1, 30.0)
            assert res.txn is not None
            branches = res.txn.branches.items()
            return BatchPlan(
                key=res.txn.key, epoch=epoch, partitions=1,
                mode=FINISH if res.kind == BeginKind.IN_DOUBT else PREPARE,
                coordinator_url=conn.url, token=conn.token, participants=(p,),
                handles={b: dict(s.handle) for b, s in branches if s.handle},
                digests={b: s.digest for b, s in branches if s.digest},
                acked=tuple(b for b, s in branches if s.ack is not None)), res.kind

        plan, _ = begin(client.register(sink))
        voted = run_partition(plan, 0, SCHEMA, [rows(0, 20)])
        decided = decide(client, client.get(plan.key), plan.epoch,
                         votes_of([voted.as_dict()]), "")
        assert decided.state == State.COMMITTING  # the writer dies before its commit
        handle = decided.branches[f"{p.name}/0"].handle
        assert handle is not None
        Producer(p.producer_config(handle["transactional_id"])).init_transactions(10)
        finish, kind = begin(client.register(sink))
        assert kind == BeginKind.IN_DOUBT and finish.mode == FINISH
        out = run_partition(finish, 0, SCHEMA, [rows(0, 20)])
        assert out.redone == 1
        back = p.read_back("id")
        assert back.values == () and back.open == 1, back  # redone, left open
        assert client.get(plan.key).branches[f"{p.name}/0"].ack is None
        committer = Committer([p])
        try:
            final, error = committer.apply(client, finish.epoch, client.get(plan.key),
                                           redone_handles([out.as_dict()]))
        finally:
            committer.close()
        assert not error and final.state == State.COMMITTED, error
        assert committed_ids(p) == list(range(20))
        assert p.open_transactions(sink) == []
    finally:
        conn.close()
