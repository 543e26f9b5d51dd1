"""Participants' markers are pruned behind the committed batch (issue 30, item 4): the
driver's ``Committer.prune`` deletes, in the background, the PostgreSQL and SQL marker
rows of batches below the kept window, and only those of its own sink and lineage; what
recovery can still ask about keeps answering COMMITTED."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from twophase.engine.commit import Committer
from twophase.participant import BranchStatus, Participant
from twophase.sinks.postgres import PostgresParticipant
from twophase.sinks.sql import SqlAlchemyParticipant
from twophase.testing.conformance import SCHEMA, batch_for, make_branch


@pytest.fixture(params=["postgres", "sql-mariadb"])
def participant(request: pytest.FixtureRequest) -> Any:
    table = f"prune_{uuid.uuid4().hex[:8]}"
    p: Participant
    if request.param == "postgres":
        p = PostgresParticipant(request.getfixturevalue("pg_dsn"), table)
    else:
        p = SqlAlchemyParticipant(str(request.getfixturevalue("mariadb")), table)
    p.check(SCHEMA)
    yield p
    p.close()


def _commit(p: Participant, sink: str, lineage: str, batch_id: int, partition: int) -> Any:
    ref = make_branch(p, sink=sink, lineage=lineage, batch_id=batch_id, partition=partition)
    p.commit(ref, p.prepare(ref, SCHEMA, [batch_for(ref)]))
    return ref


def test_markers_below_the_kept_window_are_pruned_and_no_others(participant: Any) -> None:
    sink, lineage = "prunesink", uuid.uuid4().hex[:16]
    refs = {(b, q): _commit(participant, sink, lineage, b, q) for b in range(6) for q in (0, 1)}
    other_lineage = _commit(participant, sink, uuid.uuid4().hex[:16], 0, 0)
    other_sink = _commit(participant, "othersink", lineage, 0, 0)
    committer = Committer([participant])
    try:
        assert committer.prune(sink, lineage, 7, keep=2, every=5) is None  # not due
        assert committer.prune(sink, lineage, 1, keep=2, every=1) is None  # nothing below
        job = committer.prune(sink, lineage, 5, keep=2, every=1)
        assert job is not None
        assert job.result(timeout=60) == 6  # batches 0, 1 and 2, two partitions each
        assert committer.prune(sink, lineage, 5, keep=2, every=1).result(timeout=60) == 0
    finally:
        committer.close()
    for (b, _), ref in refs.items():
        want = BranchStatus.ABSENT if b < 3 else BranchStatus.COMMITTED
        assert participant.status(ref) == want, (b, ref)
    assert participant.status(other_lineage) == BranchStatus.COMMITTED
    assert participant.status(other_sink) == BranchStatus.COMMITTED


def test_a_postgres_user_without_delete_keeps_its_markers_and_says_why(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Pruning is housekeeping: a refusal (no DELETE right on the marker table) leaves the
    markers and logs the cause with the grant that fixes it; the batch is not failed."""
    import psycopg

    role = f"noprune_{uuid.uuid4().hex[:6]}"
    table = f"prune_{uuid.uuid4().hex[:8]}"
    owner = PostgresParticipant(pg_dsn, table, marker_table=f"{table}_markers")
    owner.check(SCHEMA)
    lineage = uuid.uuid4().hex[:16]
    ref = _commit(owner, "prunesink", lineage, 0, 0)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN PASSWORD \'pw\'')
        conn.execute(f'GRANT SELECT, INSERT ON "{table}", "{table}_markers" TO "{role}"')
    limited_dsn = psycopg.conninfo.make_conninfo(pg_dsn, user=role, password="pw")
    limited = PostgresParticipant(limited_dsn, table, marker_table=f"{table}_markers")
    committer = Committer([limited])
    try:
        job = committer.prune("prunesink", lineage, 10, keep=2, every=1)
        assert job is not None and job.result(timeout=60) == 0
    finally:
        committer.close()
        owner.close()
    assert owner.status(ref) == BranchStatus.COMMITTED
    assert any("kept its markers of batches below 8" in r.getMessage()
               and "DELETE" in r.getMessage() for r in caplog.records), caplog.text


def test_the_sinks_marker_window_prunes_postgres_markers_below_it(
    pg_dsn: str, tmp_path: Any
) -> None:
    """``TransactionalSink(marker_keep_batches=100)``: the driver's prune after batch 200
    deletes the markers of batches below 100 and keeps the rest; the default window
    (1,000) prunes nothing yet at batch 200."""
    from twophase import TransactionalSink

    part = PostgresParticipant(pg_dsn, f"prune_{uuid.uuid4().hex[:8]}")
    part.check(SCHEMA)
    sink, lineage = "windowsink", uuid.uuid4().hex[:16]
    refs = {b: _commit(part, sink, lineage, b, 0) for b in (0, 99, 100, 150, 200)}
    store = f"sqlite:///{tmp_path}/c.db"
    small = TransactionalSink(sink, [part], store, lineage=lineage, marker_keep_batches=100)
    default = TransactionalSink(sink, [part], store, lineage=lineage)
    try:
        assert default._engine.committer.prune(sink, lineage, 200) is None  # 200 < 1,000 kept
        job = small._engine.committer.prune(sink, lineage, 200)
        assert job is not None and job.result(timeout=60) == 2  # batches 0 and 99
    finally:
        small.close()
        default.close()
    try:
        for b, ref in refs.items():
            want = BranchStatus.ABSENT if b < 100 else BranchStatus.COMMITTED
            assert part.status(ref) == want, b
    finally:
        part.close()
