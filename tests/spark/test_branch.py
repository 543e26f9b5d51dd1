"""The task-side runner (``twophase.engine.task``) without Spark: real PostgreSQL, real
files, a real embedded coordinator; partitions run in threads the way Spark's tasks
would, then the driver's steps (decide, commit) run here as the sink runs them: a new
attempt's and a finish's alike (one commit path, the driver's ``Committer.apply``)."""

from __future__ import annotations

import itertools
import pickle
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from twophase.client.connection import Connection, connect
from twophase.engine.commit import Committer
from twophase.engine.decide import decide, votes_of
from twophase.engine.plan import FINISH, PREPARE, BatchPlan, BranchOutcome, redone_handles
from twophase.engine.task import run_partition
from twophase.errors import RedoMismatch
from twophase.participant import BranchStatus, Participant
from twophase.protocol import BeginKind, Decision, State
from twophase.sinks.files import StagedFileParticipant
from twophase.sinks.postgres import PostgresParticipant
from twophase.testing.verify import verify

SCHEMA = pa.schema([("id", pa.int64()), ("label", pa.string())])
_n = itertools.count()


def _batch(partition: int, n: int = 5) -> list[pa.RecordBatch]:
    ids = [partition * 1000 + i for i in range(n)]
    return [pa.RecordBatch.from_pydict({"id": ids, "label": [f"x{i}" for i in ids]},
                                       schema=SCHEMA)]


@pytest.fixture
def setup(tmp_path: Path, pg_dsn: str):  # type: ignore[no-untyped-def]
    k = next(_n)
    parts: list[Participant] = [
        PostgresParticipant(dsn=pg_dsn, table=f"branch_{k}"),
        StagedFileParticipant(path=str(tmp_path / "out")),
    ]
    for p in parts:
        p.check(SCHEMA)
    conn = connect(f"sqlite:///{tmp_path / 'c.db'}")
    yield f"branch{k}", parts, conn
    conn.close()


def _plan(sink: str, parts: list[Participant], conn: Connection, epoch: int, *,
          batch_id: int = 0) -> tuple[BatchPlan, BeginKind]:
    client = conn.client()
    res = client.begin(sink, "lin-1", batch_id, epoch, [p.name for p in parts], 2, 30.0)
    assert res.txn is not None
    handles = {b: dict(s.handle) for b, s in res.txn.branches.items() if s.handle}
    plan = BatchPlan(
        key=res.txn.key, epoch=epoch, partitions=2,
        mode=FINISH if res.kind == BeginKind.IN_DOUBT else PREPARE,
        coordinator_url=conn.url, token=conn.token, participants=tuple(parts),
        handles=handles, digests={b: s.digest for b, s in res.txn.branches.items() if s.digest},
        acked=tuple(b for b, s in res.txn.branches.items() if s.ack is not None),
        ack_earlier=tuple(t.attempt for t in res.recover
                                           if t.attempt != res.txn.attempt),
    )
    return plan, res.kind


def _prepare_and_vote_yes(plan: BatchPlan, parts: list[Participant], client: Any,
                          epoch: int, digest_kind: str = "v2") -> None:
    """Every branch prepares and votes YES by hand: COMMIT is decided, nothing applied."""
    from twophase.client.wire import VoteIn
    from twophase.digest import rows_digest

    for p in range(2):
        votes = []
        for part in parts:
            handle = part.prepare(plan.ref(part, p), SCHEMA, _batch(p))
            votes.append(VoteIn(branch=f"{part.name}/{p}", yes=True, handle=dict(handle),
                                digest=rows_digest(SCHEMA, _batch(p), digest_kind)))
        client.vote(plan.key, epoch, votes)


def _run_all(plan: BatchPlan) -> list[BranchOutcome]:
    outs: list[BranchOutcome] = []
    errors: list[BaseException] = []

    def task(p: int) -> None:
        try:
            # each Spark task gets its own unpickled copy of the plan and participants
            own = pickle.loads(pickle.dumps(plan))
            outs.append(run_partition(own, p, SCHEMA, _batch(p)))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=task, args=(p,)) for p in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return sorted(outs, key=lambda o: o.partition)


def _drive(conn: Connection, epoch: int, plan: BatchPlan, parts: list[Participant],
           outs: list[BranchOutcome]) -> State:
    """The driver's steps after the job, as ``BatchEngine.run`` takes them: send the
    votes (a finish has none: it is decided), apply the decision, a finish's lost
    branches from the handles its tasks redid."""
    client = conn.client()
    final = decide(client, client.get(plan.key), epoch,
                   votes_of(o.as_dict() for o in outs), "")
    committer = Committer(parts)
    try:
        final, error = committer.apply(client, epoch, final,
                                       redone_handles(o.as_dict() for o in outs))
    finally:
        committer.close()
    assert not error, error
    return final.state


def test_tasks_prepare_and_the_driver_commits_every_branch(setup) -> None:  # type: ignore[no-untyped-def]
    sink, parts, conn = setup
    epoch = conn.client().register(sink)
    plan, kind = _plan(sink, parts, conn, epoch)
    assert kind == BeginKind.NEW
    outs = _run_all(plan)
    assert sum(o.rows for o in outs) == 10
    assert conn.client().get(plan.key).decision is None  # no task voted itself
    assert _drive(conn, epoch, plan, parts, outs) == State.COMMITTED
    want = [p * 1000 + i for p in range(2) for i in range(5)]
    assert verify(parts, want, sink=sink).ok


def test_new_writer_settles_leftovers_of_a_dead_attempt(setup) -> None:  # type: ignore[no-untyped-def]
    """A driver died after its branches prepared but before any vote: the next writer's
    attempt aborts those leftovers (found by status) and lands the rows once."""
    sink, parts, conn = setup
    client = conn.client()
    dead_epoch = client.register(sink)
    dead, _ = _plan(sink, parts, conn, dead_epoch)
    for p in range(2):
        for part in parts:
            part.prepare(dead.ref(part, p), SCHEMA, _batch(p))
            assert part.status(dead.ref(part, p)) == BranchStatus.PREPARED
    epoch = client.register(sink)
    plan, kind = _plan(sink, parts, conn, epoch)
    assert kind == BeginKind.NEW and plan.key.attempt == 2
    outs = _run_all(plan)
    assert sum(o.recovered for o in outs) == 4
    assert client.get(dead.key).decision is not None
    assert _drive(conn, epoch, plan, parts, outs) == State.COMMITTED
    want = [p * 1000 + i for p in range(2) for i in range(5)]
    report = verify(parts, want, sink=sink)
    assert report.ok, report.lines()


def test_a_finish_task_only_redoes_and_the_driver_commits_every_branch(setup) -> None:  # type: ignore[no-untyped-def]
    """COMMIT decided, then the writer died: every branch still PREPARED but one lost (its
    staged file gone, as a Kafka branch would be). The finish's tasks redo the lost one
    and commit nothing: after the job no branch is acknowledged, the redone branch is
    PREPARED and a reader sees none of the batch's rows. The driver's ``Committer.apply``
    then commits every branch, the lost one from its redone handle: every row once."""
    sink, parts, conn = setup
    client = conn.client()
    epoch = client.register(sink)
    plan, _ = _plan(sink, parts, conn, epoch)
    _prepare_and_vote_yes(plan, parts, client, epoch)
    assert client.get(plan.key).state == State.COMMITTING
    files = parts[1]
    files.abort(plan.ref(files, 1), None)  # the "lost" branch
    assert files.status(plan.ref(files, 1)) == BranchStatus.ABSENT
    new_epoch = client.register(sink)
    finish, kind = _plan(sink, parts, conn, new_epoch)
    assert kind == BeginKind.IN_DOUBT and finish.mode == FINISH
    outs = _run_all(finish)
    assert sum(o.redone for o in outs) == 1
    assert set(redone_handles(o.as_dict() for o in outs)) == {f"{files.name}/1"}
    after_job = client.get(plan.key)
    assert after_job.state == State.COMMITTING
    assert all(st.ack is None for st in after_job.branches.values())  # no task acked
    assert files.status(plan.ref(files, 1)) == BranchStatus.PREPARED  # redone, not committed
    want = [p * 1000 + i for p in range(2) for i in range(5)]
    before = verify(parts, want, sink=sink)
    assert [r.missing for r in before.systems] == [10, 10], before.lines()  # none visible
    assert _drive(conn, new_epoch, finish, parts, outs) == State.COMMITTED
    report = verify(parts, want, sink=sink)
    assert report.ok, report.lines()


def _lost_after_commit(setup, digest_kind: str = "v2"):  # type: ignore[no-untyped-def]
    """COMMIT decided, the files branch of partition 0 lost: (sink, parts, client, plan,
    finish plan) for a redo."""
    sink, parts, conn = setup
    client = conn.client()
    epoch = client.register(sink)
    plan, _ = _plan(sink, parts, conn, epoch)
    _prepare_and_vote_yes(plan, parts, client, epoch, digest_kind)
    assert all(s.digest for s in client.get(plan.key).branches.values())  # stored with votes
    files = parts[1]
    files.abort(plan.ref(files, 0), None)  # lost
    finish, _ = _plan(sink, parts, conn, client.register(sink))
    assert finish.digests == {b: s.digest for b, s in client.get(plan.key).branches.items()}
    return sink, parts, client, plan, finish


def _same_count_other_value(p: int) -> list[pa.RecordBatch]:
    [b] = _batch(p)
    labels = b.column(1).to_pylist()
    labels[2] = "changed"
    return [pa.RecordBatch.from_pydict({"id": b.column(0), "label": labels}, schema=SCHEMA)]


@pytest.mark.parametrize("replay", ["more_rows", "same_count_other_value"])
def test_redo_refuses_a_replay_that_differs_from_the_vote_then_redrive(  # type: ignore[no-untyped-def]
    setup, replay: str
) -> None:
    """A lost branch is redone from the replayed batch; a replay with other rows than
    were voted (a nondeterministic query: more rows, or one value changed at the same
    row count, which a row count would miss) is refused naming the batch, partition,
    participant and the settling commands; nothing is written. Re-driving with the voted
    rows then finishes the batch."""
    sink, parts, client, plan, finish = _lost_after_commit(setup)
    files = parts[1]
    bad = _batch(0, n=7) if replay == "more_rows" else _same_count_other_value(0)
    with pytest.raises(RedoMismatch) as err:
        run_partition(finish, 0, SCHEMA, bad)
    msg = str(err.value)
    for part in (f"branch {files.name}/0", f"batch {plan.key.batch_id}", "partition 0",
                 "re-drive", "force-ack", '"outcome": "COMMIT"', "not deterministic"):
        assert part in msg, (part, msg)
    assert files.status(finish.ref(files, 0)) == BranchStatus.ABSENT
    assert all(st.ack is None for st in client.get(plan.key).branches.values())
    # re-drive: the same replay as voted (any row order) finishes the batch
    outs = []
    for p in range(2):
        [b] = _batch(p)
        outs.append(run_partition(pickle.loads(pickle.dumps(finish)), p, SCHEMA,
                                  [b.take(pa.array(list(reversed(range(b.num_rows)))))]))
    assert sum(o.redone for o in outs) == 1
    assert _drive(setup[2], finish.epoch, finish, parts, outs) == State.COMMITTED
    want = [p * 1000 + i for p in range(2) for i in range(5)]
    report = verify(parts, want, sink=sink)
    assert report.ok, report.lines()


def test_redo_mismatch_settled_by_accepting_the_loss(setup) -> None:  # type: ignore[no-untyped-def]
    """The other way out: the operator force-acks the lost branch (its rows are given
    up); the next finish commits the rest and nothing of the refused replay was
    written."""
    sink, parts, client, plan, finish = _lost_after_commit(setup)
    with pytest.raises(RedoMismatch):
        run_partition(finish, 0, SCHEMA, _same_count_other_value(0))
    # the job failed: the driver applies nothing (the lost branch's vote names rows
    # that are gone), so every branch waits, unacknowledged
    assert all(st.ack is None for st in client.get(plan.key).branches.values())
    # what the refusal told the operator to run (here through the operator's client)
    operator = setup[2].client(operator=True)
    operator.force_ack(plan.key, f"{parts[1].name}/0", Decision.COMMIT)
    # the next finish: the given-up branch is acknowledged, so nothing is redone and
    # the driver commits the others from their votes
    again, kind = _plan(sink, parts, setup[2], client.register(sink))
    assert kind == BeginKind.IN_DOUBT
    outs = _run_all(again)
    assert sum(o.redone for o in outs) == 0
    assert _drive(setup[2], again.epoch, again, parts, outs) == State.COMMITTED
    report = verify(parts, [p * 1000 + i for p in range(2) for i in range(5)], sink=sink)
    [pg, fl] = report.systems
    assert pg.ok and fl.missing == 5 and fl.duplicates == fl.unexpected == 0


def test_a_vote_of_an_older_version_is_checked_with_its_own_digest(setup) -> None:  # type: ignore[no-untyped-def]
    """Votes stored by an older version carry a ``b2s1`` digest: the redo computes that
    kind for the replay, so a changed value is still refused and the voted rows (in
    another order) are redone."""
    sink, parts, client, plan, finish = _lost_after_commit(setup, "b2s1")
    assert all(d.startswith("b2s1:") for d in finish.digests.values())
    with pytest.raises(RedoMismatch, match="not deterministic"):
        run_partition(finish, 0, SCHEMA, _same_count_other_value(0))
    assert parts[1].status(finish.ref(parts[1], 0)) == BranchStatus.ABSENT
    assert all(st.ack is None for st in client.get(plan.key).branches.values())
    outs = []
    for p in range(2):
        [b] = _batch(p)
        outs.append(run_partition(pickle.loads(pickle.dumps(finish)), p, SCHEMA,
                                  [b.take(pa.array(list(reversed(range(b.num_rows)))))]))
    assert sum(o.redone for o in outs) == 1
    assert _drive(setup[2], finish.epoch, finish, parts, outs) == State.COMMITTED
    report = verify(parts, [p * 1000 + i for p in range(2) for i in range(5)], sink=sink)
    assert report.ok, report.lines()


def test_a_digest_of_an_unknown_kind_refuses_the_redo(setup) -> None:  # type: ignore[no-untyped-def]
    """A vote whose digest this version cannot compute (a newer version voted) is not
    redone unchecked: the refusal names the kind and what to run; nothing is written."""
    sink, parts, client, plan, finish = _lost_after_commit(setup)
    digests = {b: "v9:" + d.split(":", 1)[1] for b, d in finish.digests.items()}
    future = pickle.loads(pickle.dumps(finish))
    object.__setattr__(future, "digests", digests)
    with pytest.raises(RedoMismatch) as err:
        run_partition(future, 0, SCHEMA, _batch(0))
    msg = str(err.value)
    assert "'v9'" in msg and "v2, b2s1" in msg and "twophase version that voted" in msg
    assert parts[1].status(finish.ref(parts[1], 0)) == BranchStatus.ABSENT
    assert all(st.ack is None for st in client.get(plan.key).branches.values())
    # the version that voted finishes it (and leaves nothing prepared on the server)
    outs = [run_partition(pickle.loads(pickle.dumps(finish)), p, SCHEMA, _batch(p))
            for p in range(2)]
    assert _drive(setup[2], finish.epoch, finish, parts, outs) == State.COMMITTED
    report = verify(parts, [p * 1000 + i for p in range(2) for i in range(5)], sink=sink)
    assert report.ok, report.lines()


def test_two_sinks_share_a_files_folder_without_dropping_rows(tmp_path: Path) -> None:
    """Final names carry the sink: a second sink's branch with the same lineage,
    checkpoint, participant and partition is its own file, not "already committed"."""
    from twophase.participant import BranchRef

    part = StagedFileParticipant(path=str(tmp_path / "shared"))
    part.check(SCHEMA)
    for sink in ("sink_one", "sink_two"):
        ref = BranchRef(sink, "lin-1", 0, 1, part.name, 0)
        handle = part.prepare(ref, SCHEMA, _batch(0))
        assert handle["state"] == "prepared"
        part.commit(ref, handle)
    [report] = verify([part], range(5)).systems
    assert report.rows == 10 and report.missing == 0 and report.unexpected == 0


def test_torn_temp_files_of_a_killed_prepare_are_removed(tmp_path: Path) -> None:
    """A prepare killed mid-write leaves ``.<staged>.<uuid>.tmp``; a later attempt's
    prepare of the same branch, or an abort, deletes it."""
    from twophase.participant import BranchRef

    part = StagedFileParticipant(path=str(tmp_path / "out"))
    part.check(SCHEMA)
    first = BranchRef("s", "lin-1", 3, 1, part.name, 0)
    torn = part.staging / f".{part.staged_path(first).name}.0123abcd.tmp"
    torn.write_bytes(b"half a parquet file")
    assert part.status(first) == BranchStatus.ABSENT
    second = BranchRef("s", "lin-1", 3, 2, part.name, 0)
    part.commit(second, part.prepare(second, SCHEMA, _batch(0)))
    assert not torn.exists()
    torn.write_bytes(b"again")
    part.abort(first, None)
    assert not torn.exists()


def test_a_driver_killed_before_its_acks_after_a_redo_is_finished_without_a_second_redo(  # type: ignore[no-untyped-def]
    setup, tmp_path: Path
) -> None:
    """``before_ack`` in a finish: the task redoes the lost branch under COMMIT, the
    driver commits every branch (the lost one from its redone handle) and is SIGKILLed
    before it acknowledges. The next finish finds the branch committed by its marker (no
    second redo) and the driver acknowledges it; every row once."""
    import os
    import subprocess
    import sys

    from twophase import failpoints

    sink, parts, client, plan, finish = _lost_after_commit(setup)
    files = parts[1]
    plan_file, rows_file = tmp_path / "plan.pkl", tmp_path / "rows.arrow"
    plan_file.write_bytes(pickle.dumps(finish))
    with pa.OSFile(str(rows_file), "wb") as sink_file, \
            pa.ipc.new_stream(sink_file, SCHEMA) as writer:
        for b in _batch(0):
            writer.write_batch(b)
    env = {**os.environ, failpoints.ENV: "before_ack=kill"}
    env.pop(failpoints.ONCE_DIR_ENV, None)
    child = subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "support" / "run_partition.py"),
         str(plan_file), "0", str(rows_file), "--apply"], env=env, capture_output=True,
        text=True, timeout=120, check=False)
    assert child.returncode == -9, (child.returncode, child.stderr[-2000:])
    assert files.status(finish.ref(files, 0)) == BranchStatus.COMMITTED  # redone, applied
    assert all(st.ack is None for st in client.get(plan.key).branches.values())  # no ack
    again, kind = _plan(sink, parts, setup[2], client.register(sink))
    assert kind == BeginKind.IN_DOUBT and again.mode == FINISH
    outs = _run_all(again)
    assert sum(o.redone for o in outs) == 0
    assert _drive(setup[2], again.epoch, again, parts, outs) == State.COMMITTED
    want = [p * 1000 + i for p in range(2) for i in range(5)]
    report = verify(parts, want, sink=sink)
    assert report.ok, report.lines()
