"""Exactly once through ``writeStream.format("twophase")`` when things die: the
reference job (its own driver process, real Spark, PostgreSQL and files) with the data
source door. The whole driver (its Python, Spark's JVM and every Python worker: the
process group) is SIGKILLed while a failpoint holds it at a protocol step; a Python
worker is SIGKILLed mid-task (Spark retries the task). Each run restarts from its
checkpoint with one more batch; at the end every id is in every system once and nothing
is left prepared."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from twophase import failpoints
from twophase.testing.job import JobConfig, build_participants, expected_ids, write_input
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark

ROWS = 40


def _start(cfg_path: Path, env_extra: dict[str, str], log: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (failpoints.ENV, failpoints.ONCE_DIR_ENV, "PYSPARK_PYTHON")}
    env.update(env_extra)
    with open(log, "a") as err:
        return subprocess.Popen([sys.executable, "-m", "twophase.testing.job", str(cfg_path)],
                                env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)


def _kill_when_held(proc: subprocess.Popen[str], once: Path, log: Path) -> None:
    """SIGKILL the driver's whole process group once the failpoint holds it."""
    deadline = time.monotonic() + 300
    while not failpoints.fired(str(once)):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def _prepared(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT gid FROM pg_prepared_xacts").fetchall()]


# a failpoint that holds the driver (sleep) where the kill lands
DRIVER_KILLS = (
    "after_prepare=sleep(120)*1",  # a task prepared its branch, no vote handed back
    "before_commit=sleep(120)*1",  # the driver's commit: COMMIT decided, nothing applied
    "after_commit=sleep(120)*1",  # one branch committed, none acknowledged
)


@pytest.mark.slow  # a Spark start-up per run: ~20 s each
def test_driver_and_worker_killed_through_the_door(tmp_path: Path, pg_dsn: str) -> None:
    cfg = JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", sink=f"dk{secrets.token_hex(3)}",
        pg_dsn=pg_dsn, pg_table=f"dk_{secrets.token_hex(3)}", files_path=str(tmp_path / "out"),
        partitions=4, vote_timeout=60.0, door=True,
        spark_conf={"spark.master": "local[2,4]"},  # up to 4 tries of a task
    )
    cfg_path, log = tmp_path / "job.json", tmp_path / "job.log"
    cfg.dump(cfg_path)
    write_input(cfg.input_dir, 1, ROWS)
    batches = 1
    for i, spec in enumerate(DRIVER_KILLS):
        once = tmp_path / f"once{i}"
        proc = _start(cfg_path, {failpoints.ENV: spec, failpoints.ONCE_DIR_ENV: str(once)}, log)
        _kill_when_held(proc, once, log)
        write_input(cfg.input_dir, 1, ROWS, first=batches)
        batches += 1
    # a Python worker killed after preparing: Spark runs the task again
    once = tmp_path / "worker"
    last = _start(cfg_path, {failpoints.ENV: "after_prepare=kill*1",
                             failpoints.ONCE_DIR_ENV: str(once)}, log)
    out, _ = last.communicate(timeout=600)
    assert last.returncode == 0, log.read_text()[-3000:]
    assert len(failpoints.fired(str(once))) == 1
    assert [json.loads(x) for x in out.splitlines() if x.startswith("{")][-1] == {"done": True}
    report = verify(build_participants(cfg), expected_ids(batches, ROWS), sink=cfg.sink)
    assert report.ok, report.lines()
    assert [g for g in _prepared(pg_dsn) if cfg.sink in g] == []
