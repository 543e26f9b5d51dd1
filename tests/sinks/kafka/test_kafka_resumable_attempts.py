"""Two attempts of one branch with the resumable prepare (Spark's retry or speculative
copy), each in its own process, against Apache Kafka and a real coordinator:

- attempts choosing their pool ids at the same moment do not fence each other's
  prepared transaction (each commits or aborts from its own handle);
- the attempt whose vote lost (here: killed after its prepare, as Spark kills a
  speculative copy) does not hold ``read_committed`` readers: the driver aborts its
  transaction right after applying the batch, so the winner's records are read at once,
  not after the transaction timeout, and nothing of the sink is left open."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kafka import create_topic, kafka_bootstrap, read_all, unique_topic
from twophase.client.api import CoordinatorClient
from twophase.client.wire import VoteIn
from twophase.coordinator.embedded import EmbeddedServer
from twophase.engine.commit import Committer
from twophase.engine.decide import decide
from twophase.participant import BranchRef, BranchStatus
from twophase.protocol import Decision, Transaction
from twophase.sinks.kafka import KafkaParticipant
from twophase.sinks.kafka.txnwire import describe_transaction

__all__ = ["kafka_bootstrap"]

pytestmark = [pytest.mark.real_kafka]

SINK = "orders"
ROWS = 50  # as CHILD writes

# one attempt of partition 0: waits for the common start, prepares with its Spark task
# attempt number, prints its handle, then ends as told (a killed speculative copy: kill)
CHILD = r"""
import json, os, signal, sys, time
import pyarrow as pa
from twophase.participant import BranchRef
from twophase.sinks.kafka import KafkaParticipant, resumable
boot, topic, ref, spark_attempt, start_at, ending = sys.argv[1:7]
resumable._spark_attempt = lambda: int(spark_attempt)  # what Spark's TaskContext says
p = KafkaParticipant(topic, {"bootstrap.servers": boot}, connect_timeout_s=10.0)
b = BranchRef(*json.loads(ref))
rows = pa.record_batch([pa.array(list(range(50)), pa.int64())], names=["id"])
time.sleep(max(0.0, float(start_at) - time.time()))
handle = p.prepare(b, rows.schema, [rows])
print(json.dumps(handle), flush=True)
if ending == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _attempts(bootstrap: str, topic: str, ref: BranchRef,
              attempts: list[tuple[int, float, str]]) -> list[dict[str, str]]:
    """Run one process per (Spark attempt number, start delay, ending) at once; their
    handles, in that order."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    now = time.time() + 4.0  # every child imported and waiting by then
    branch = json.dumps(dataclasses.astuple(ref))
    procs = [subprocess.Popen(
        [sys.executable, "-c", CHILD, bootstrap, topic, branch, str(n), str(now + delay),
         ending], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env) for n, delay, ending in attempts]
    handles = []
    for proc, (_, _, ending) in zip(procs, attempts, strict=True):
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == (-9 if ending == "kill" else 0), err[-2000:]
        handles.append(json.loads(out.splitlines()[0]))
    return handles


def _ids(messages: list[Any]) -> list[int]:
    return sorted(int(json.loads(m.value())["id"]) for m in messages)


def _participant(bootstrap: str) -> KafkaParticipant:
    topic = unique_topic("res-att")
    create_topic(bootstrap, topic)
    p = KafkaParticipant(topic, {"bootstrap.servers": bootstrap}, connect_timeout_s=10.0)
    assert p.prepare_mode == "resumable"  # the default
    return p


@contextlib.contextmanager
def _one_batch(p: KafkaParticipant, db: Path, lineage: str | None = None
               ) -> Iterator[tuple[CoordinatorClient, int, Transaction, BranchRef]]:
    """A real coordinator (embedded, SQLite at ``db``) with ``p``'s sink registered and
    batch 0 of one partition begun: (client, writer epoch, the batch, its branch)."""
    with EmbeddedServer(f"sqlite:///{db}", token="t" * 24) as srv, \
            CoordinatorClient(srv.url, srv.token) as client:
        epoch = client.register(SINK, [p.descriptor()])  # type: ignore[list-item]
        txn = client.begin(SINK, lineage or uuid.uuid4().hex[:16], 0, epoch, [p.name], 1,
                           120).txn
        assert txn is not None
        yield client, epoch, txn, BranchRef(*txn.key, p.name, 0)


def test_attempts_choosing_ids_at_once_do_not_fence_each_other(kafka_bootstrap: str) -> None:
    p = _participant(kafka_bootstrap)
    b = BranchRef(SINK, uuid.uuid4().hex[:16], 2, 1, p.name, 0)
    for _ in range(3):  # three rounds: the choice is made at the same moment each time
        first, second = _attempts(kafka_bootstrap, p.topic, b, [(0, 0.0, "exit"),
                                                                (1, 0.0, "exit")])
        assert first["transactional_id"] != second["transactional_id"]
        for h in (first, second):  # both still open with their own producer's epoch
            assert p.voted_status(b, h) is BranchStatus.PREPARED, h
            st = describe_transaction(p.config, h["transactional_id"], 10)
            assert st is not None and (st.producer_id, st.producer_epoch) == (
                int(h["producer_id"]), int(h["producer_epoch"]))
        p.abort(b, first)
        p.abort(b, second)
    # a fourth pair: the later attempt's vote wins this time
    first, second = _attempts(kafka_bootstrap, p.topic, b, [(0, 0.0, "exit"),
                                                            (1, 0.0, "exit")])
    p.commit(b, second)
    p.abort(b, first)
    assert _ids(read_all(kafka_bootstrap, p.topic, expect=ROWS)) == list(range(ROWS))
    assert p.open_transactions(SINK) == []


def test_driver_aborts_the_losing_attempt_so_readers_are_not_held(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    p = _participant(kafka_bootstrap)
    lineage = uuid.uuid4().hex[:16]
    with _one_batch(p, tmp_path / "c.db", lineage) as (client, epoch, txn, b):
        # the loser (a speculative copy) writes first and is killed by Spark before it
        # votes: its open transaction starts below the winner's records
        loser, winner = _attempts(kafka_bootstrap, p.topic, b, [(1, 0.0, "kill"),
                                                                (0, 2.0, "exit")])
        assert loser["transactional_id"] != winner["transactional_id"]
        open_before = {t.transactional_id for t in p.open_transactions(SINK)}
        assert open_before == {loser["transactional_id"], winner["transactional_id"]}
        # the winner's vote is recorded; a late vote of the loser would not be
        votes = [VoteIn(b.branch_id, True, winner, task="0.0"),
                 VoteIn(b.branch_id, True, loser, task="0.1")]
        final = decide(client, txn, epoch, votes, "")
        assert final.decision == Decision.COMMIT
        assert final.branches[b.branch_id].handle == winner
        committer = Committer([p])
        try:
            t0 = time.monotonic()
            after, error = committer.apply(client, epoch, final)
            applied_s = time.monotonic() - t0
            t0 = time.monotonic()
            assert committer.end_other_attempts(after) == 0  # nothing left: one listing
            sweep_s = time.monotonic() - t0
        finally:
            committer.close()
        print(f"apply {applied_s:.3f}s (commit + the losing attempt's abort), "
              f"a sweep finding nothing {sweep_s:.3f}s")
        assert error == "" and after.branches[b.branch_id].ack == Decision.COMMIT
    # read at once (the transaction timeout is 600 s): a reader held behind the loser's
    # open transaction would see nothing within the 15 s
    t0 = time.monotonic()
    seen = read_all(kafka_bootstrap, p.topic, expect=ROWS, timeout_s=15.0)
    assert _ids(seen) == list(range(ROWS)), (
        f"{len(seen)} records read_committed within {time.monotonic() - t0:.1f}s")
    assert p.open_transactions(SINK) == []  # ListTransactions + DescribeTransactions
    st = describe_transaction(p.config, loser["transactional_id"], 10)
    assert st is not None and st.state in ("PrepareAbort", "CompleteAbort"), st
    assert applied_s < 30.0


def test_a_copy_outrun_by_the_commit_ends_its_own_transaction(kafka_bootstrap: str) -> None:
    """A speculative copy that passed the marker check before the winner's commit and
    began its transaction after the driver's sweep: it finds the marker committed once
    it has written, aborts its own transaction and votes "already committed", so no
    transaction of the sink is left open to hold read_committed readers."""
    import pyarrow as pa

    from twophase.sinks.kafka.resumable import SLOTS, pool_id

    p = _participant(kafka_bootstrap)
    b = BranchRef(SINK, uuid.uuid4().hex[:16], 4, 0, p.name, 0)
    rows = pa.record_batch([pa.array(list(range(ROWS)), pa.int64())], names=["id"])
    winner = p.prepare(b, rows.schema, [rows])
    assert winner["already_committed"] == "no"

    def copy_feed() -> Any:
        p.commit(b, winner)  # the winner's branch commits while the copy writes
        yield rows

    copy = p.prepare(b, rows.schema, copy_feed())
    assert copy["already_committed"] == "yes", copy
    states = {pool_id(p, b, s): describe_transaction(p.config, pool_id(p, b, s), 10)
              for s in range(SLOTS)}
    assert not [t for t, st in states.items() if st is not None and st.state == "Ongoing"], \
        states
    assert p.open_transactions(SINK) == []
    # read at once: nothing open holds the reader, and the copy's records are aborted
    assert _ids(read_all(kafka_bootstrap, p.topic, expect=ROWS, timeout_s=15.0)) \
        == list(range(ROWS))
    p.commit(b, copy)  # the copy's vote commits nothing
    assert p.voted_status(b, winner) is BranchStatus.COMMITTED


def test_closing_the_committer_ends_a_copy_that_began_after_the_last_sweep(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The last batch of a query that stops: a copy Spark was killing began its
    transaction after that batch's sweep and died before its own marker check (here a
    process killed right after preparing, started once the batch was applied; its
    branch's marker is another partition's, so its start-of-prepare check lets it
    write). Nothing sweeps after the last batch but the committer's close, which the
    sink's ``close()`` runs: the copy's transaction ends there."""
    p = _participant(kafka_bootstrap)
    with _one_batch(p, tmp_path / "c.db") as (client, epoch, txn, b):
        (winner,) = _attempts(kafka_bootstrap, p.topic, b, [(0, 0.0, "exit")])
        votes = [VoteIn(b.branch_id, True, winner, task="0.0")]
        final = decide(client, txn, epoch, votes, "")
        committer = Committer([p])
        try:
            after, error = committer.apply(client, epoch, final)
            assert error == "" and after.branches[b.branch_id].ack == Decision.COMMIT
            late_ref = dataclasses.replace(b, partition=1)
            (late,) = _attempts(kafka_bootstrap, p.topic, late_ref, [(1, 0.0, "kill")])
            assert [t.transactional_id for t in p.open_transactions(SINK)] \
                == [late["transactional_id"]]
        finally:
            committer.close()
    assert p.open_transactions(SINK) == []
    st = describe_transaction(p.config, late["transactional_id"], 10)
    assert st is not None and st.state in ("PrepareAbort", "CompleteAbort"), st
    # the winner's rows, read at once; the late copy's are aborted
    assert _ids(read_all(kafka_bootstrap, p.topic, expect=ROWS, timeout_s=15.0)) \
        == list(range(ROWS))


def test_a_task_writing_many_partitions_votes_within_the_coordinators_bounds(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A task spreading its rows over every partition of a wide topic votes a handle the
    coordinator accepts: the written partitions are listed by number, not by
    topic-partition name, which for 200 partitions (seen in bench/scale.py) passed the
    4,096 characters a handle value may hold and failed the batch. Here 40 partitions
    of a 200-character topic name."""
    import pyarrow as pa

    from twophase.client.wire import MAX_TEXT

    topic = ("wide-" + uuid.uuid4().hex).ljust(200, "x")
    create_topic(kafka_bootstrap, topic, partitions=40)
    # keyed: librdkafka places keyless records stickily (a few partitions a batch), a
    # key's hash spreads 4,000 ids over all 40
    p = KafkaParticipant(topic, {"bootstrap.servers": kafka_bootstrap}, name="wide",
                         key="id", connect_timeout_s=10.0)
    rows = 4000
    batch = pa.record_batch([pa.array(list(range(rows)), pa.int64())], names=["id"])
    with _one_batch(p, tmp_path / "c.db") as (client, epoch, txn, b):
        handle = p.prepare(b, batch.schema, [batch])
        assert handle["partitions"] == ",".join(str(n) for n in range(40)), handle
        assert max(len(v) for v in handle.values()) <= MAX_TEXT
        final = decide(client, txn, epoch, [VoteIn(b.branch_id, True, handle, task="0.0")],
                       "")
        assert final.decision == Decision.COMMIT
        committer = Committer([p])
        try:
            after, error = committer.apply(client, epoch, final)
        finally:
            committer.close()
        assert error == "" and after.branches[b.branch_id].ack == Decision.COMMIT
    assert _ids(read_all(kafka_bootstrap, topic, expect=rows, timeout_s=30.0)) \
        == list(range(rows))
