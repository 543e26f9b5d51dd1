"""A new attempt streams its partition into every participant (no Spark: real
PostgreSQL, real files, a real embedded coordinator, a partition as a generator)."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from twophase.client.connection import Connection, connect
from twophase.engine.commit import Committer
from twophase.engine.decide import decide, votes_of
from twophase.engine.plan import PREPARE, BatchPlan
from twophase.engine.task import run_partition
from twophase.participant import Participant
from twophase.sinks.files import StagedFileParticipant
from twophase.sinks.postgres import PostgresParticipant

SCHEMA = pa.schema([("id", pa.int64()), ("label", pa.string())])
_n = itertools.count()


class _Live:
    """Counts the Arrow batches of a partition still alive (referenced anywhere)."""

    def __init__(self) -> None:
        self.now = self.peak = 0
        self._lock = threading.Lock()

    def _gone(self) -> None:
        with self._lock:
            self.now -= 1

    def batches(self, n: int, rows: int, fail_after: int | None = None
                ) -> Iterator[pa.RecordBatch]:
        for i in range(n):
            if fail_after is not None and i == fail_after:
                raise OSError("the executor lost its input stream")
            ids = list(range(i * rows, (i + 1) * rows))
            b = pa.RecordBatch.from_pydict({"id": ids, "label": [f"x{j}" for j in ids]},
                                           schema=SCHEMA)
            with self._lock:
                self.now += 1
                self.peak = max(self.peak, self.now)
            weakref.finalize(b, self._gone)
            yield b


def _plan(tmp_path: Path, pg_dsn: str) -> tuple[BatchPlan, str, Connection]:
    k = next(_n)
    parts: list[Participant] = [
        PostgresParticipant(dsn=pg_dsn, table=f"stream_{k}"),
        StagedFileParticipant(path=str(tmp_path / "out")),
    ]
    for p in parts:
        p.check(SCHEMA)
    conn = connect(f"sqlite:///{tmp_path / 'c.db'}")
    client = conn.client()
    sink = f"stream{k}"
    epoch = client.register(sink)
    res = client.begin(sink, "lin-1", 0, epoch, [p.name for p in parts], 1, 30.0)
    assert res.txn is not None
    plan = BatchPlan(key=res.txn.key, epoch=epoch, partitions=1, mode=PREPARE,
                     coordinator_url=conn.url, token=conn.token, participants=tuple(parts))
    return plan, f"stream_{k}", conn


def test_a_partition_is_never_held_whole(tmp_path: Path, pg_dsn: str) -> None:
    plan, table, conn = _plan(tmp_path, pg_dsn)
    live = _Live()
    committer = Committer(plan.participants)
    try:
        out = run_partition(plan, 0, SCHEMA, live.batches(60, 500))
        client = conn.client()  # the driver's steps: the votes, then the commit
        final = decide(client, client.get(plan.key), plan.epoch, votes_of([out.as_dict()]), "")
        final, error = committer.apply(client, plan.epoch, final)
    finally:
        committer.close()
        conn.close()
    assert (final.state.value, error, out.rows) == ("COMMITTED", "", 30_000)
    assert live.peak <= 8, live.peak  # 60 batches went through, a handful at a time
    with psycopg.connect(pg_dsn) as c:
        assert c.execute(f"SELECT count(*) FROM {table}").fetchone() == (30_000,)
    files = list((tmp_path / "out").glob("part-*"))
    assert len(files) == 1


def test_rows_failing_midway_leave_nothing_prepared(tmp_path: Path, pg_dsn: str) -> None:
    plan, _, conn = _plan(tmp_path, pg_dsn)
    try:
        with pytest.raises(OSError, match="lost its input stream"):
            run_partition(plan, 0, SCHEMA, _Live().batches(10, 100, fail_after=4))
    finally:
        conn.close()
    with psycopg.connect(pg_dsn) as c:
        gids = [r[0] for r in c.execute("SELECT gid FROM pg_prepared_xacts").fetchall()]
    assert not [g for g in gids if plan.key.sink in g]
    staging = tmp_path / "out" / "_twophase_staging"
    assert not [f for f in staging.iterdir() if f.is_file()]
    assert not list((tmp_path / "out").glob("part-*"))
