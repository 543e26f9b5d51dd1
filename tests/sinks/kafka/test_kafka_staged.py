"""The staged Kafka prepare (twophase/sinks/kafka/staged.py) against the suite's Apache
Kafka broker: staged in one object, committed from a fresh unpickled one (as the driver's
Committer does), judged by the partition log and a read_committed consumer
(``read_back``: both must agree, nothing left open)."""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.sinks.kafka.test_kafka_participant import SCHEMA, batch, branch, make
from tests.support.kafka import committed_offset, kafka_bootstrap, read_all
from twophase import failpoints
from twophase.participant import BranchStatus, ParticipantError
from twophase.sinks.kafka import KafkaParticipant

__all__ = ["kafka_bootstrap"]


def staged(bootstrap: str, **kw: object) -> KafkaParticipant:
    p = make(bootstrap, prepare="staged", key="k", **kw)
    p.check(SCHEMA)  # the driver's check: creates the staging topic
    return p


def fresh(p: KafkaParticipant) -> KafkaParticipant:
    clone: KafkaParticipant = pickle.loads(pickle.dumps(p))
    return clone


def visible(p: KafkaParticipant) -> list[int]:
    """The committed ids, from the partition log cross-checked with read_committed."""
    back = p.read_back("id")
    assert back.exact and back.open == 0 and back.mismatch == 0, back.note
    return sorted(back.values)


def test_staged_commit_from_a_fresh_object_exactly_once(kafka_bootstrap: str) -> None:
    p = staged(kafka_bootstrap)
    assert p.staging_topic == f"{p.topic}.twophase-staged"
    # created by check() with its own partition count, not auto-created by the broker
    # (the suite's broker has auto.create.topics.enable and num.partitions=1)
    from confluent_kafka.admin import AdminClient

    listed = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10)
    assert len(listed.topics[p.staging_topic].partitions) >= 8
    b = branch(p, batch_id=3, partition=1)
    task = fresh(p)  # the executor's copy
    handle = task.prepare(b, SCHEMA, [batch(0, 300), batch(300, 200)])
    task.close()
    assert handle["rows"] == "500" and handle["prepare"] == "staged"
    assert int(handle["last_offset"]) - int(handle["first_offset"]) == 499
    assert visible(p) == [] and p.status(b) is BranchStatus.ABSENT
    driver = fresh(p)
    driver.commit(b, handle)
    driver.commit(b, handle)  # already marked: skipped
    fresh(p).commit(b, handle)
    assert visible(p) == list(range(500))
    assert committed_offset(kafka_bootstrap, p.marker_group(b), p.topic) == 4
    assert p.status(b) is BranchStatus.COMMITTED
    msgs = read_all(kafka_bootstrap, p.topic, expect=500)
    assert all(m.key() == f"k{int(m.value().split(b',')[0][6:]) % 7}".encode() for m in msgs)
    assert {h for m in msgs for h, _ in m.headers()} == {
        "twophase.sink", "twophase.lineage", "twophase.batch", "twophase.partition"}
    again = fresh(p).prepare(b, SCHEMA, [batch(0, 500)])  # a redo finds the marker
    assert again["already_committed"] == "yes"
    driver.close()


def test_staged_abort_and_duplicate_attempts(kafka_bootstrap: str) -> None:
    p = staged(kafka_bootstrap)
    aborted = branch(p, batch_id=0)
    fresh(p).abort(aborted, p.prepare(aborted, SCHEMA, [batch(0, 40)]))
    p.abort(aborted, None)
    assert p.status(aborted) is BranchStatus.ABSENT
    # Two attempts of one branch (a retried or speculative task) staged side by side in
    # one staging partition, the second committed: only its records are copied.
    b = branch(p, batch_id=1, lineage=aborted.lineage)
    first = p.prepare(b, SCHEMA, [batch(1000, 30)])
    second = fresh(p).prepare(b, SCHEMA, [batch(2000, 20)])
    assert first["token"] != second["token"]
    fresh(p).commit(b, second)
    fresh(p).commit(b, first)  # the branch is marked: the other attempt is never copied
    assert visible(p) == list(range(2000, 2020))


def test_staged_count_mismatch_commits_nothing(kafka_bootstrap: str) -> None:
    p = staged(kafka_bootstrap)
    b = branch(p, batch_id=0)
    handle = dict(p.prepare(b, SCHEMA, [batch(0, 10)]))
    with pytest.raises(ParticipantError, match=r"10 staged records carry its token .* the "
                                               r"vote says 11; nothing was committed"):
        fresh(p).commit(b, {**handle, "rows": "11"})
    with pytest.raises(ParticipantError, match="without its vote's handle"):
        fresh(p).commit(b, None)
    assert p.status(b) is BranchStatus.ABSENT
    fresh(p).commit(b, handle)
    assert visible(p) == list(range(10))


def test_staged_commit_killed_mid_transaction_is_redone_once(kafka_bootstrap: str) -> None:
    p = staged(kafka_bootstrap)
    b = branch(p, batch_id=5, sink="killed")
    handle = fresh(p).prepare(b, SCHEMA, [batch(0, 1000)])
    with tempfile.TemporaryDirectory(prefix="twophase-kstaged-") as tmp:
        job = Path(tmp) / "job.pkl"
        job.write_bytes(pickle.dumps((p, b, dict(handle))))
        proc = subprocess.run([sys.executable, "-m", "tests.support.kafka_copy_and_die",
                               str(job)], capture_output=True, text=True, timeout=120,
                              check=False, env=None)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    # The dead driver's copy is open on one of the pool's ids: the redo's first use of the
    # pool initialises them all, which aborts it, and copies again.
    redo = fresh(p)
    redo.commit(b, handle)
    assert visible(p) == list(range(1000))
    back = p.read_back("id")
    assert back.aborted == 1000, back  # the killed copy's records, aborted by the fence
    redo.commit(b, handle)
    assert visible(p) == list(range(1000))


class _NothingDecided:
    def committing(self, sink: str) -> list[object]:
        return []


def test_a_starting_sink_aborts_a_dead_drivers_open_copy(kafka_bootstrap: str) -> None:
    """A driver killed mid-copy leaves its pool lane's transaction open, holding the
    marker group's offsets: every stable read of the marker (a redo's first step, in a
    task) waits until the broker's transaction timeout. The restarted sink's start-up
    cleanup finds the lane's id (``...commit.N``) and fences it: the marker reads at
    once and the branch is copied exactly once."""
    p = staged(kafka_bootstrap)
    sink = "deadcopy"
    b = branch(p, batch_id=2, sink=sink)
    handle = fresh(p).prepare(b, SCHEMA, [batch(0, 50)])
    _copy_and_die(p, b, handle)
    [lane] = p.open_transactions(sink)
    assert ".commit." in lane.transactional_id, lane
    restarted = fresh(p)
    assert [t.name for t in restarted.clear_left_open(
        sink, _NothingDecided())] == [lane.transactional_id]
    assert p.open_transactions(sink) == []
    assert restarted.status(b) is BranchStatus.ABSENT  # the marker reads, no wait
    restarted.commit(b, handle)
    back = p.read_back("id")
    assert back.aborted == 50 and back.open == 0, back
    assert visible(p) == list(range(50))


def test_two_processes_committing_one_batch_at_once_commit_each_branch_once(
    kafka_bootstrap: str,
) -> None:
    """A driver and a concurrent ``twophase resolve`` finishing the same COMMIT-decided
    batch at once: every copy of a branch runs on the branch's own transactional id, so
    the two processes' copies of one branch fence each other and at most one commits it;
    a fenced copy reads the marker and returns without copying again. Judged right
    after the race (no record twice, every branch a process reported done committed),
    then after one more pass (every record exactly once, nothing open)."""
    p = staged(kafka_bootstrap)
    lineage = branch(p).lineage
    work = []
    for part in range(8):
        b = branch(p, batch_id=2, partition=part, sink="racing", lineage=lineage)
        work.append((b, dict(fresh(p).prepare(b, SCHEMA, [batch(part * 1000, 200)]))))
    with tempfile.TemporaryDirectory(prefix="twophase-kracing-") as tmp:
        job, start = Path(tmp) / "job.pkl", Path(tmp) / "start"
        job.write_bytes(pickle.dumps((p, work)))
        procs = [subprocess.Popen([sys.executable, "-m", "tests.support.kafka_commit_all",
                                   str(job), str(start)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        time.sleep(3)  # both imported and waiting
        start.touch()
        outs = [proc.communicate(timeout=180) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [e[-2000:] for _, e in outs]
    outcomes = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    for one in outcomes:  # a failure is a copy fenced again and again, never anything else
        for part, what in one.items():
            assert what == "ok" or (what.startswith("ParticipantError: ") and "fenced"
                                    in what and f"branch {p.name}/{part} of batch 2" in what
                                    and "redone" in what), (part, what)
    done = {int(part) for one in outcomes for part, what in one.items() if what == "ok"}
    assert done, outcomes
    back = p.read_back("id")  # right after the race: nothing twice, nothing left open
    assert back.exact and back.open == 0 and back.mismatch == 0, back.note
    assert len(back.values) == len(set(back.values)), "a record committed twice"
    for b, _ in work:  # a branch a process reported done is committed
        assert b.partition not in done or p.status(b) is BranchStatus.COMMITTED, b
    finisher = fresh(p)
    for b, handle in work:  # what a fenced copy left is finished once, never twice
        finisher.commit(b, handle)
    finisher.close()
    assert visible(p) == sorted(i for part in range(8) for i in range(part * 1000,
                                                                     part * 1000 + 200))


def _held_at_mid_commit(monkeypatch: pytest.MonkeyPatch, thread: str
                        ) -> tuple[threading.Event, threading.Event, list[str]]:
    """Hold the named thread's first copy at ``mid_commit`` (its transaction open, the
    records and the marker offset sent) until ``go`` is set; ``at`` is set once it is
    there. Returns (at, go, the threads' names at each hit of the point)."""
    at, go, hits = threading.Event(), threading.Event(), []
    real = failpoints.hit

    def hit(point: str, participant: str | None = None, partition: int | None = None) -> None:
        if point == "mid_commit":
            name = threading.current_thread().name
            hits.append(name)
            if name == thread and hits.count(name) == 1:
                at.set()
                assert go.wait(120), "never released"
        real(point, participant, partition)

    monkeypatch.setattr(failpoints, "hit", hit)
    return at, go, hits


def _in_thread(name: str, call: Any) -> tuple[threading.Thread, list[BaseException | None]]:
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            out.append(None)
        except BaseException as exc:  # judged by the test
            out.append(exc)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t, out


def test_a_fenced_copy_finds_the_branch_committed_and_never_copies_it_again(
    kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two finishers of one branch interleaved at ``mid_commit``: A's copy is open when
    B copies the branch; B's init aborts A's copy, B commits. Released, A's commit is
    fenced; A reads the marker, finds it committed and returns without a second copy.
    By the log: A's 200 records aborted, B's 200 committed, nothing else."""
    p = staged(kafka_bootstrap)
    b = branch(p, batch_id=2, sink="interleaved")
    handle = fresh(p).prepare(b, SCHEMA, [batch(0, 200)])
    at, go, hits = _held_at_mid_commit(monkeypatch, "A")
    a, a_out = _in_thread("A", lambda: fresh(p).commit(b, handle))
    assert at.wait(120), a_out
    fresh(p).commit(b, handle)  # B, in this thread: not held
    assert visible(p) == list(range(200)) and p.read_back("id").aborted == 200
    go.set()
    a.join(120)
    assert a_out == [None]  # A's fenced copy ended as success: the branch is committed
    assert hits == ["A", "MainThread"]  # A never copied again
    back = p.read_back("id")
    assert back.aborted == 200 and back.open == 0, back
    assert visible(p) == list(range(200))
    assert p.open_transactions("interleaved") == []


def test_a_fenced_copy_takes_the_branch_over_when_the_fencing_copy_died(
    kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A's copy is open when B copies the branch and is SIGKILLed before its commit
    (its transaction left open, holding the marker). Released, A's commit is fenced; A
    reads the marker, waiting for B's transaction until ``connect_timeout_s``, finds it
    not committed and takes the branch over: its init aborts B's copy, and it copies
    once. By the log: A's first copy and B's aborted, one copy committed."""
    p = staged(kafka_bootstrap, connect_timeout_s=5.0)
    b = branch(p, batch_id=3, sink="takeover")
    handle = fresh(p).prepare(b, SCHEMA, [batch(0, 200)])
    at, go, hits = _held_at_mid_commit(monkeypatch, "A")
    a, a_out = _in_thread("A", lambda: fresh(p).commit(b, handle))
    assert at.wait(120), a_out
    _copy_and_die(p, b, handle)
    [left] = p.open_transactions("takeover")  # B's copy, open on the branch's id
    assert left.transactional_id.endswith(".commit.p0"), left
    go.set()
    a.join(120)
    assert a_out == [None]
    assert hits == ["A", "A"]  # A's first copy, fenced; A's second, committed
    back = p.read_back("id")
    assert back.aborted == 400 and back.open == 0, back
    assert visible(p) == list(range(200))
    assert p.open_transactions("takeover") == []


def test_staged_branch_reads_prepared_until_its_records_are_gone(kafka_bootstrap: str) -> None:
    """A finish commits a staged branch from the driver (twophase.engine.commit) because its
    voted state reads PREPARED while the staged range is there; once the staging topic's
    retention took it, ABSENT (only a redo from the replay can write it), and after the
    copy COMMITTED."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    p = staged(kafka_bootstrap)
    kept, lost = branch(p, batch_id=5, partition=0), branch(p, batch_id=5, partition=1)
    task = fresh(p)
    h_lost = task.prepare(lost, SCHEMA, [batch(50, 50)])
    h_kept = task.prepare(kept, SCHEMA, [batch(0, 50)])
    task.close()
    if h_kept["staging_partition"] == h_lost["staging_partition"]:  # staged after it
        assert int(h_kept["first_offset"]) > int(h_lost["first_offset"]) + 1
    driver = fresh(p)
    assert driver.voted_status(kept, h_kept) is BranchStatus.PREPARED
    assert driver.voted_status(lost, h_lost) is BranchStatus.PREPARED
    # retention, as the broker applies it: the lost branch's staging partition now
    # begins past its first staged record
    where = TopicPartition(h_lost["staging_topic"], int(h_lost["staging_partition"]),
                           int(h_lost["first_offset"]) + 1)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    [done] = admin.delete_records([where]).values()
    done.result(30)
    assert driver.voted_status(lost, h_lost) is BranchStatus.ABSENT
    assert driver.voted_status(kept, h_kept) is BranchStatus.PREPARED
    driver.commit(kept, h_kept)
    assert driver.voted_status(kept, h_kept) is BranchStatus.COMMITTED
    assert visible(p) == list(range(50))
    driver.close()


def test_the_prune_deletes_only_staged_records_of_committed_batches(
    kafka_bootstrap: str,
) -> None:
    """The driver's background prune (``Committer.prune`` -> ``prune_markers``) cuts the
    staging partition before its first record that is not this sink's, of this lineage,
    of a batch below the kept window: committed batches' records go; an in-doubt batch's
    (this sink's, in the window) and another sink's sharing the partition stay, and both
    are recovered afterwards from their staged records, exactly once."""
    from confluent_kafka import Consumer, TopicPartition

    from twophase.engine.commit import Committer

    p = staged(kafka_bootstrap)
    lineage = branch(p).lineage

    def stage(batch_id: int, first_id: int, sink: str = "orders", *,
              commit: bool) -> tuple[Any, dict[str, str]]:
        ref = branch(p, batch_id=batch_id, sink=sink, lineage=lineage)  # partition 0
        handle = dict(fresh(p).prepare(ref, SCHEMA, [batch(first_id, 20)]))
        if commit:
            fresh(p).commit(ref, handle)
        return ref, handle

    def prune(batch_id: int) -> int:  # as the driver after batch_id, keeping 1 batch
        committer = Committer([p])
        try:
            job = committer.prune("orders", lineage, batch_id, keep=1, every=1)
            assert job is not None
            return int(job.result(timeout=120))
        finally:
            committer.close()

    def low(handle: dict[str, str]) -> int:
        reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "twophase.t"})
        try:
            where = TopicPartition(p.staging_topic, int(handle["staging_partition"]))
            return int(reader.get_watermark_offsets(where, 10)[0])
        finally:
            reader.close()

    _, first = stage(0, 0, commit=True)
    stage(1, 100, commit=True)
    in_doubt, in_doubt_handle = stage(2, 200, commit=False)  # COMMIT decided, not copied
    assert prune(3) == 40  # batches 0 and 1 go; batch 2 is in the window (and in doubt)
    assert low(first) == int(in_doubt_handle["first_offset"])
    fresh(p).commit(in_doubt, in_doubt_handle)  # the recovery reads what was kept
    other, other_handle = stage(0, 300, "othersink", commit=False)  # another sink's
    stage(3, 400, commit=True)
    assert prune(5) == 20  # batch 2 goes; the cut stops at the other sink's record
    assert low(first) == int(other_handle["first_offset"])
    fresh(p).commit(other, other_handle)
    assert visible(p) == [i for s in (0, 100, 200, 300, 400) for i in range(s, s + 20)]


def _copy_and_die(p: Any, b: Any, handle: Any) -> None:
    """A process that opens the branch's copy, sends its records and marker, and is
    SIGKILLed before committing (tests/support/kafka_copy_and_die.py)."""
    with tempfile.TemporaryDirectory(prefix="twophase-kstaged-") as tmp:
        job = Path(tmp) / "job.pkl"
        job.write_bytes(pickle.dumps((p, b, dict(handle))))
        proc = subprocess.run([sys.executable, "-m", "tests.support.kafka_copy_and_die",
                               str(job)], capture_output=True, text=True, timeout=120,
                              check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
