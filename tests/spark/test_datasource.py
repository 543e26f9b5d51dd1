"""``writeStream.format("twophase")`` end to end: real Spark (local[2]), real PostgreSQL,
real files, through the data source door instead of foreachBatch."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import psycopg
import pytest

from twophase.testing.job import JobConfig, build_participants, expected_ids, run, write_input
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark

_ids = itertools.count()


@pytest.fixture
def job(tmp_path: Path, pg_dsn: str) -> JobConfig:
    n = next(_ids)
    return JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", sink=f"door{n}", pg_dsn=pg_dsn,
        pg_table=f"door_{n}", files_path=str(tmp_path / "out"), partitions=4,
        vote_timeout=60.0, door=True,
    )


def _prepared(pg_dsn: str) -> list[str]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT gid FROM pg_prepared_xacts").fetchall()]


def test_door_writes_every_id_exactly_once(spark: Any, job: JobConfig, pg_dsn: str) -> None:
    write_input(job.input_dir, batches=3, rows_per_batch=50)
    run(job, spark)
    report = verify(build_participants(job), expected_ids(3, 50), sink=job.sink)
    assert report.ok, report.lines()
    assert [s.rows for s in report.systems] == [150, 150]
    assert _prepared(pg_dsn) == []
