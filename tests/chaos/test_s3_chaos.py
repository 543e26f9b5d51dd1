"""``twophase chaos`` over PostgreSQL + Parquet on S3 (slow; figures in docs/participants.md).

    PYTHONPATH=. python -m pytest -m slow tests/chaos/test_s3_chaos.py -q -s

Kills drivers and Spark Python workers at failpoints and at random moments, restarts from
the checkpoint, then verifies every id once in PostgreSQL and once in the committed S3
objects (a pyarrow dataset over S3), nothing prepared and no multipart upload left open.
``TWOPHASE_S3_CHAOS_KILLS`` (default 12) and ``TWOPHASE_S3_CHAOS_SEED`` (default 14) vary it;
``TWOPHASE_S3_CHAOS_MAX_SECONDS`` stops killing after that long (then finish and verify).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psycopg
import pytest

from tests.support.s3 import unique_prefix
from twophase.testing.chaos import ChaosOptions, render, run_chaos
from twophase.testing.job import JobConfig
from twophase.testing.locals3 import LocalS3

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(7200)]


def test_chaos_over_postgres_and_s3(tmp_path: Path, pg_dsn: str, s3: LocalS3,
                                    s3_bucket: str) -> None:
    prefix = unique_prefix("chaos")
    job = JobConfig(
        input_dir=str(tmp_path / "input"), checkpoint=str(tmp_path / "checkpoint"),
        coordinator=f"sqlite:///{tmp_path / 'coordinator.db'}", sink="s3chaos",
        pg_dsn=pg_dsn, pg_table=f"s3chaos_{prefix.replace('-', '_')}",
        files_path=f"s3://{s3_bucket}/{prefix}", files_options=s3.storage_options,
        partitions=2, max_attempts=5, vote_timeout=60.0,
    )
    report = run_chaos(ChaosOptions(
        workdir=tmp_path / "chaos", job=job,
        kills=int(os.environ.get("TWOPHASE_S3_CHAOS_KILLS", "12")),
        seed=int(os.environ.get("TWOPHASE_S3_CHAOS_SEED", "14")),
        victims=("driver", "worker"), batches=3, rows_per_batch=200,
        max_seconds=float(os.environ.get("TWOPHASE_S3_CHAOS_MAX_SECONDS", "3600")),
        log=lambda m: print(m, flush=True),
    ))
    print("\n".join(render(report)))
    print(json.dumps({k: report[k] for k in ("kills", "by_victim", "by_method", "runs",
                                              "batches", "rows", "recovery_seconds",
                                              "duration_s")}))
    assert report["ok"], report["verify_lines"]
    assert [s["rows"] for s in report["verify"]["systems"]] == [report["rows"]] * 2
    assert report["verify"]["systems"][1]["temp_leftovers"] == 0
    assert s3.open_uploads(s3_bucket, prefix + "/") == []
    assert "***" in json.dumps(report["job"]["files_options"])  # no secret in the report
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)
