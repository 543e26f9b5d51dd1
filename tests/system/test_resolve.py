"""``twophase resolve`` settles what a dead job left prepared, by the recovery rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from twophase.coordinator.store import Store
from twophase.protocol import State
from twophase.testing.job import JobConfig, build_participants, write_input
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark


def _prepared(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()
    return int(row[0]) if row else 0


def _staged(path: str) -> int:
    staging = Path(path) / "_twophase_staging"
    return sum(1 for f in staging.iterdir() if f.is_file()) if staging.exists() else 0


@pytest.mark.parametrize(
    "point, decision",
    [("after_decision", State.COMMITTED), ("coordinator_before_decision", State.ABORTED)],
)
def test_resolve_settles_a_dead_jobs_leftovers(
    tmp_path: Path, pg_dsn: str, point: str, decision: State
) -> None:
    table = f"resolve_{point}"
    cfg = JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", sink=f"res_{point}"[:60],
        pg_dsn=pg_dsn, pg_table=table, files_path=str(tmp_path / "out"), partitions=2,
    )
    write_input(cfg.input_dir, batches=1, rows_per_batch=20)
    cfg.dump(tmp_path / "job.json")
    env = dict(os.environ, TWOPHASE_FAILPOINTS=f"{point}=kill*1")
    job = subprocess.run([sys.executable, "-m", "twophase.testing.job", str(tmp_path / "job.json")],
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert job.returncode == -9, job.stderr[-2000:]
    # the dead job's leftovers: 2 partitions x (postgres, files)
    assert _prepared(pg_dsn) == 2 and _staged(cfg.files_path) == 2

    out = subprocess.run(
        [sys.executable, "-m", "twophase.cli", "resolve", "--coordinator", cfg.coordinator,
         "--sink", cfg.sink, "--job", str(tmp_path / "job.json"), "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:] + out.stdout[-2000:]
    actions = json.loads(out.stdout)["actions"]
    want = "commit" if decision == State.COMMITTED else "abort"
    branch_actions = [a for a in actions if a["branch"] != "*"]
    assert sum(a["action"] == want for a in branch_actions) == 4, actions
    assert _prepared(pg_dsn) == 0 and _staged(cfg.files_path) == 0
    store = Store(cfg.coordinator)
    try:
        [row] = store.list(sink=cfg.sink)
    finally:
        store.close()
    assert row.txn.state == decision
    expected = list(range(20)) if decision == State.COMMITTED else []
    report = verify(build_participants(cfg), expected, sink=cfg.sink)
    assert report.ok, report.lines()
