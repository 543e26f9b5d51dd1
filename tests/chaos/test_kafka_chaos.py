"""Kafka's hard moments that a kill cannot make, judged from the partition log: the
zombie producer still *alive* while its replacement redoes the branch, and a transaction
expired by the broker while the COMMIT decision was being applied.

A real child process runs the partition's task (prepare, vote YES: COMMIT is decided)
and is held by a ``sleep`` failpoint at ``before_commit``, its transaction open. Here a
new writer (new epoch) finds the batch in doubt and finishes it: the Kafka branch is not
in this process, so it is redone, fencing the zombie. Then the zombie wakes and tries to
commit: it must fail with Kafka's PRODUCER_FENCED (or INVALID_PRODUCER_EPOCH). The log
must show each id once, the zombie's rows aborted, nothing open, and a read_committed
consumer must agree with the log. Zombie fencing by a live producer is also covered at the
participant level in ``tests/sinks/kafka/test_kafka_participant.py``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from tests.support.kafka import create_topic, unique_topic
from twophase import failpoints
from twophase.client.connection import connect
from twophase.client.wire import VoteIn
from twophase.digest import rows_digest
from twophase.engine.plan import BatchPlan
from twophase.engine.task import run_partition
from twophase.errors import ParticipantError
from twophase.protocol import BeginKind, Decision, State
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.kafka.log import read_log
from twophase.testing.verify import verify

HELPER = Path(__file__).resolve().parents[1] / "support" / "run_partition.py"
ROOT = Path(__file__).resolve().parents[2]
SCHEMA = pa.schema([("id", pa.int64()), ("label", pa.string())])
HOLD_S = 20.0  # the zombie's sleep at before_commit: the redo must finish inside it
# what a commit after the broker expired the transaction fails with
EXPIRED = r"failed and was not aborted: .*(FENCED|EPOCH).*must be redone under the COMMIT"


def _rows() -> pa.RecordBatch:
    ids = list(range(25))
    return pa.RecordBatch.from_pydict({"id": ids, "label": [f"r{i}" for i in ids]},
                                      schema=SCHEMA)


def test_live_zombie_while_the_replacement_redoes(tmp_path: Path, kafka_bootstrap: str) -> None:
    topic = unique_topic("zombie")
    create_topic(kafka_bootstrap, topic)
    kafka = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap},
                             connect_timeout_s=3.0, commit_retry_s=3.0, prepare="in_task")
    kafka.check(SCHEMA)
    sink = f"zombie_{uuid.uuid4().hex[:8]}"
    conn = connect(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        client = conn.client()
        epoch = client.register(sink)
        res = client.begin(sink, "lin-1", 0, epoch, [kafka.name], 1, 60.0)
        assert res.kind == BeginKind.NEW and res.txn is not None
        plan = BatchPlan(key=res.txn.key, epoch=epoch, partitions=1, mode="run",
                         coordinator_url=conn.url, token=conn.token, participants=(kafka,))
        (tmp_path / "plan.pkl").write_bytes(pickle.dumps(plan))
        with pa.OSFile(str(tmp_path / "rows.arrow"), "wb") as sinkf, \
                pa.ipc.new_stream(sinkf, SCHEMA) as writer:
            writer.write_batch(_rows())
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env[failpoints.ENV] = f"before_commit=sleep({HOLD_S})"
        zombie = subprocess.Popen(
            [sys.executable, str(HELPER), str(tmp_path / "plan.pkl"), "0",
             str(tmp_path / "rows.arrow")], env=env, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while client.get(plan.key).state != State.COMMITTING:
                assert zombie.poll() is None, zombie.stderr.read() if zombie.stderr else ""
                assert time.monotonic() < deadline, "the zombie never voted"
                time.sleep(0.2)
            held_from = time.monotonic()  # decided: the zombie now sleeps, transaction open
            # The replacement: a new writer finds the batch in doubt and finishes it.
            new_epoch = client.register(sink)
            again = client.begin(sink, "lin-1", 0, new_epoch, [kafka.name], 1, 60.0)
            assert again.kind == BeginKind.IN_DOUBT and again.txn is not None
            finish = BatchPlan(
                key=again.txn.key, epoch=new_epoch, partitions=1, mode="finish",
                coordinator_url=conn.url, token=conn.token, participants=(kafka,),
                handles={b: dict(s.handle) for b, s in again.txn.branches.items() if s.handle},
                digests={b: s.digest for b, s in again.txn.branches.items() if s.digest})
            out = run_partition(pickle.loads(pickle.dumps(finish)), 0, SCHEMA, [_rows()])
            assert out.redone == 1
            assert time.monotonic() - held_from < HOLD_S, "redo finished after the zombie woke"
            assert zombie.poll() is None  # the zombie is alive through the whole redo
            assert client.get(plan.key).state == State.COMMITTED
            _, err = zombie.communicate(timeout=120)
        finally:
            if zombie.poll() is None:
                zombie.kill()
        assert zombie.returncode == 4, err  # its commit failed: fenced
        assert "FENCED" in err or "EPOCH" in err, err
        report = verify([kafka], range(25), sink=sink)
        [s] = report.systems
        assert report.ok and s.duplicates == s.missing == s.open_transactions == 0, \
            report.lines()
        assert s.aborted == 25, report.lines()  # the zombie's rows: aborted by the fence
    finally:
        conn.close()
        kafka.close()


@pytest.mark.filterwarnings("ignore:Producer abort_transaction failed during close")
def test_transaction_expired_while_applying_commit_is_redone(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    """Past the transaction timeout: the broker itself aborts the open transaction and
    bumps the producer's epoch while the COMMIT decision is being applied (the suite's
    broker checks for expired transactions every second; the participant's
    ``transaction_timeout_ms`` is 2 s here). The preparing process's commit then fails
    (never turned into an abort), and the next writer redoes the branch under the
    decision: exactly once in the log and by a read_committed consumer, the expired rows
    aborted."""
    topic = unique_topic("expiry")
    create_topic(kafka_bootstrap, topic)
    kafka = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap},
                             connect_timeout_s=3.0, commit_retry_s=3.0,
                             transaction_timeout_ms=2000, prepare="in_task")
    kafka.check(SCHEMA)
    sink = f"expiry_{uuid.uuid4().hex[:8]}"
    conn = connect(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        client = conn.client()
        epoch = client.register(sink)
        res = client.begin(sink, "lin-1", 0, epoch, [kafka.name], 1, 60.0)
        assert res.txn is not None
        plan = BatchPlan(key=res.txn.key, epoch=epoch, partitions=1, mode="run",
                         coordinator_url=conn.url, token=conn.token, participants=(kafka,))
        ref = plan.ref(kafka, 0)
        handle = kafka.prepare(ref, SCHEMA, [_rows()])
        answer = client.vote(plan.key, epoch, [VoteIn(
            branch=ref.branch_id, yes=True, handle=dict(handle),
            digest=rows_digest(SCHEMA, [_rows()]))])
        assert answer.decision == Decision.COMMIT
        # the broker expires the transaction: its ABORT marker, the epoch bumped
        deadline = time.monotonic() + 30
        while read_log({"bootstrap.servers": kafka_bootstrap}, topic).open_transactions:
            assert time.monotonic() < deadline, "the broker never expired the transaction"
            time.sleep(0.5)
        with pytest.raises(ParticipantError, match=EXPIRED) as failed:
            kafka.commit(ref, handle)
        print(f"the expired transaction's commit: {failed.value}")
        kafka.close()  # the failed task's process ends: its producer goes with it
        assert verify([kafka], range(25)).systems[0].missing == 25  # nothing landed
        # the next writer finds COMMIT decided and redoes the branch
        again = client.begin(sink, "lin-1", 0, client.register(sink), [kafka.name], 1, 60.0)
        assert again.kind == BeginKind.IN_DOUBT and again.txn is not None
        finish = BatchPlan(
            key=again.txn.key, epoch=again.sink.epoch, partitions=1, mode="finish",
            coordinator_url=conn.url, token=conn.token, participants=(kafka,),
            handles={b: dict(s.handle) for b, s in again.txn.branches.items() if s.handle},
            digests={b: s.digest for b, s in again.txn.branches.items() if s.digest})
        out = run_partition(pickle.loads(pickle.dumps(finish)), 0, SCHEMA, [_rows()])
        assert out.redone == 1 and client.get(plan.key).state == State.COMMITTED
        report = verify([kafka], range(25), sink=sink)
        [s] = report.systems
        assert report.ok and s.open_transactions == 0 and s.aborted == 25, report.lines()
    finally:
        conn.close()
        kafka.close()
