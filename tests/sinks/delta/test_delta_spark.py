"""Spark exactly-once into a Delta table and PostgreSQL through one TransactionalSink:
real Spark (local[2], 2 partitions), real PostgreSQL, a real Delta table. The tasks
prepare Delta data files, the driver commits each batch as one Delta version carrying
Delta's app transaction (txnAppId = twophase-<sink>-<query id>, txnVersion = batch id);
a replayed batch adds no version; a driver SIGKILLed just before or just after the Delta
commit is restarted and finishes the batch once. Read back by deltalake, DuckDB and the
verifier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from twophase import failpoints
from twophase.participant import Participant
from twophase.sinks.delta import DeltaParticipant, app_id
from twophase.sinks.postgres import PostgresParticipant
from twophase.testing.job import JobConfig, expected_ids, run, write_input
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark

BATCHES, ROWS = 3, 40


def test_delta_and_postgres_exactly_once(spark: Any, tmp_path: Path, pg_dsn: str) -> None:
    job = JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", sink="dlorders",
        partitions=2, vote_timeout=60.0,
    )
    table = str(tmp_path / "lake" / "orders")

    def parts() -> list[Participant]:
        return [PostgresParticipant(dsn=pg_dsn, table="dl_orders"),
                DeltaParticipant(table, name="dl")]

    write_input(job.input_dir, batches=BATCHES, rows_per_batch=ROWS)
    sink = run(job, spark, participants=parts())
    assert [r.outcome for r in sink.history] == ["committed"] * BATCHES
    want = expected_ids(BATCHES, ROWS)

    dt = DeltaTable(table)
    # version 0 created the table (check, before the first batch); then one per batch
    assert dt.version() == BATCHES
    infos = sorted(dt.history(), key=lambda i: int(i["version"]))
    ours = [i for i in infos if "twophase.batch" in i]
    assert [int(i["twophase.batch"]) for i in ours] == list(range(BATCHES))
    assert {i["twophase.partitions"] for i in ours} == {"0-1"}  # both branches in each
    lineage = ours[0]["twophase.lineage"]
    assert dt.transaction_version(app_id("dlorders", lineage)) == BATCHES - 1
    assert sorted(dt.to_pyarrow_table(columns=["id"]).column("id").to_pylist()) == want
    files = dt.file_uris()
    got = duckdb.sql(f"SELECT id FROM read_parquet({files!r})").fetchall()
    assert sorted(r[0] for r in got) == want
    assert sum(pa.table(dt.get_add_actions(flatten=True)).column("num_records").to_pylist()
               ) == len(want)  # each file's row count is in the log (stats)
    report = verify(parts(), want, sink="dlorders")
    assert report.ok, report.lines()
    assert [s.rows for s in report.systems] == [len(want)] * 2

    # Spark forgets it finished the last batch: the replay adds no Delta version
    for name in (str(BATCHES - 1), f".{BATCHES - 1}.crc"):
        (Path(job.checkpoint) / "commits" / name).unlink(missing_ok=True)
    again = run(job, spark, participants=parts())
    assert [(r.batch_id, r.outcome) for r in again.history] == [(BATCHES - 1, "replay")]
    assert DeltaTable(table).version() == BATCHES
    assert verify(parts(), want, sink="dlorders").ok


JOB = """
import json, sys
from twophase.sinks.delta import DeltaParticipant
from twophase.sinks.postgres import PostgresParticipant
from twophase.testing.job import JobConfig, run

cfg = JobConfig.load(sys.argv[1])
sink = run(cfg, participants=[PostgresParticipant(dsn=cfg.pg_dsn, table=cfg.pg_table),
                              DeltaParticipant(sys.argv[2], name="dl")])
print(json.dumps({"done": [r.outcome for r in sink.history]}), flush=True)
"""


@pytest.mark.parametrize("point", ["before_batch_commit", "after_batch_commit"])
def test_driver_killed_around_the_delta_commit(tmp_path: Path, pg_dsn: str, point: str) -> None:
    """A driver process SIGKILLed after the COMMIT decision, just before (nothing in the
    table) or just after (committed, not acknowledged) the Delta commit; its restart
    finishes the batch from the coordinator's record: one version per batch."""
    table = str(tmp_path / "lake" / "orders")
    job = JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", sink="dlkill",
        pg_dsn=pg_dsn, pg_table=f"dl_kill_{point}", partitions=2, vote_timeout=60.0,
    )
    cfg, script = tmp_path / "job.json", tmp_path / "job.py"
    job.dump(cfg)
    script.write_text(JOB)
    write_input(job.input_dir, batches=BATCHES, rows_per_batch=ROWS)
    env = {k: v for k, v in os.environ.items()
           if k not in (failpoints.ENV, failpoints.ONCE_DIR_ENV)}

    def child(extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), str(cfg), table],
                              env={**env, **extra}, capture_output=True, text=True,
                              timeout=300, check=False)

    first = child({failpoints.ENV: f"{point}@dl=kill*1",
                   failpoints.ONCE_DIR_ENV: str(tmp_path / "once")})
    assert first.returncode == -9, first.stderr[-3000:]
    killed_at = DeltaTable(table).version()
    assert killed_at == (0 if point == "before_batch_commit" else 1)  # batch 0's commit
    done = child({})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1])["done"][-1] == "committed"
    dt = DeltaTable(table)
    assert dt.version() == BATCHES
    ours = [i for i in dt.history() if "twophase.batch" in i]
    assert sorted(int(i["twophase.batch"]) for i in ours) == list(range(BATCHES))
    want = expected_ids(BATCHES, ROWS)
    got = duckdb.sql(f"SELECT id FROM read_parquet({dt.file_uris()!r})").fetchall()
    assert sorted(r[0] for r in got) == want
    parts: list[Participant] = [PostgresParticipant(dsn=pg_dsn, table=job.pg_table),
                                DeltaParticipant(table, name="dl")]
    report = verify(parts, want, sink="dlkill")
    assert report.ok, report.lines()
