"""Exactly-once into PostgreSQL + Parquet on S3 under driver kills: real Spark (the job as
its own driver process), real PostgreSQL, the suite's S3-API server (moto) on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from tests.support.s3 import keys, read_rows, unique_prefix
from twophase.sinks.files import STAGING_DIR
from twophase.testing.job import JobConfig, build_participants, expected_ids, write_input
from twophase.testing.locals3 import LocalS3
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark


def _run(cfg: JobConfig, tmp: Path, failpoints: str | None) -> subprocess.CompletedProcess[str]:
    path = tmp / "job.json"
    cfg.dump(path)
    env = {k: v for k, v in os.environ.items()
           if k != "TWOPHASE_FAILPOINTS" and not k.startswith("AWS_")}
    if failpoints:
        env["TWOPHASE_FAILPOINTS"] = failpoints
    return subprocess.run([sys.executable, "-m", "twophase.testing.job", str(path)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)


def test_driver_kills_then_restart_exactly_once_into_postgres_and_s3(
    tmp_path: Path, pg_dsn: str, s3: LocalS3, s3_bucket: str
) -> None:
    prefix = unique_prefix("spark")
    cfg = JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", sink="s3orders",
        pg_dsn=pg_dsn, pg_table=f"s3orders_{prefix.replace('-', '_')}",
        files_path=f"s3://{s3_bucket}/{prefix}", files_options=s3.storage_options,
        partitions=2, vote_timeout=60.0,
    )
    write_input(cfg.input_dir, batches=3, rows_per_batch=30)
    # killed after the coordinator decided COMMIT (branches prepared, not committed) ...
    first = _run(cfg, tmp_path, "after_decision=kill*1")
    assert first.returncode == -9, first.stderr[-3000:]
    # ... and after committing a batch, before Spark recorded it (the batch is replayed)
    second = _run(cfg, tmp_path, "before_return=kill*1")
    assert second.returncode == -9, second.stderr[-3000:]
    done = _run(cfg, tmp_path, None)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"done": True}

    report = verify(build_participants(cfg), expected_ids(3, 30), sink=cfg.sink)
    assert report.ok, report.lines()
    assert [s.rows for s in report.systems] == [90, 90]
    ids = sorted(r["id"] for r in read_rows(s3, s3_bucket, prefix, "parquet", ["id"]))
    assert ids == expected_ids(3, 30)  # a pyarrow dataset over S3 sees exactly that
    assert [k for k in keys(s3, s3_bucket, prefix) if k.startswith(STAGING_DIR)] == []
    assert s3.open_uploads(s3_bucket) == []  # nothing stays open in the whole bucket
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)
