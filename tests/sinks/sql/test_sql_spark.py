"""Spark exactly-once into MariaDB and PostgreSQL through SqlAlchemyParticipant.

The reference job (a separate driver process, real Spark local[2]) writes both databases
in one sink; a failpoint SIGKILLs a Python worker after its branch is prepared (XA
PREPARE done, vote not sent), or the driver after the COMMIT decision (every branch
prepared and decided, none committed). The job is restarted from its checkpoint with one
more batch and run to the end: every id is in each table exactly once, nothing is left in
XA RECOVER or pg_prepared_xacts. Every other driver and worker failpoint runs with
``-m slow``. ``twophase chaos --mariadb-local`` runs the same target
under random kills (``test_chaos_cli_mariadb``).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sinks.sql.sql_support import pg_url
from tests.support.user import run_reference_job
from twophase import failpoints
from twophase.testing.chaos import PER_BRANCH_POINTS, points_for
from twophase.testing.job import JobConfig, build_participants, expected_ids, write_input
from twophase.testing.localmariadb import LocalMariaDB
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark

BATCHES, ROWS = 3, 40


# CI time: one case by default (the driver after the decision: the restart commits XA
# branches that outlived their connections); a worker killed after its XA PREPARE is the
# conformance kit's check_commit_from_another_process_after_sigkill (docs/testing.md)
FAST = {("driver", "after_decision")}


def _cases() -> list[object]:
    """Every driver and worker failpoint (the chaos matrix's points for an embedded
    coordinator); one runs by default, the rest with ``-m slow``."""
    return [pytest.param(v, p, id=f"{v}-{p}",
                         marks=[] if (v, p) in FAST else [pytest.mark.slow])
            for v in ("driver", "worker") for p in points_for(v, "embedded")]


@pytest.mark.parametrize(("victim", "point"), _cases())
def test_spark_kill_then_restart_is_exactly_once(
    tmp_path: Path, mariadb_server: LocalMariaDB, pg_dsn: str, victim: str, point: str
) -> None:
    tag = f"s{secrets.token_hex(3)}"
    cfg = JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", sink=f"sq_{tag}", partitions=2,
        vote_timeout=60.0, max_attempts=4,
        sql_urls=[mariadb_server.url, pg_url(pg_dsn)], sql_table=f"sq_{tag}",
    )
    maria, pg = build_participants(cfg)
    spec = f"{point}=kill*1"
    if point in PER_BRANCH_POINTS:
        spec = f"{point}@{maria.name}/1=kill*1"
    once = tmp_path / "once"
    cfg_path, log = tmp_path / "job.json", tmp_path / "job.log"
    cfg.dump(cfg_path)
    write_input(cfg.input_dir, BATCHES, ROWS)

    first = run_reference_job(
        cfg_path, {failpoints.ENV: spec, failpoints.ONCE_DIR_ENV: str(once)}, log, drop=())
    fired = failpoints.fired(str(once))
    assert len(fired) == 1, (fired, first.returncode, log.read_text()[-3000:])
    if victim == "driver":
        assert first.returncode == -9, log.read_text()[-3000:]
        if point == "after_decision":  # COMMIT decided, nothing committed: XA branches wait
            assert mariadb_server.sql("XA RECOVER"), "no XA branch prepared at the kill"
    else:
        assert first.returncode != -9, log.read_text()[-3000:]

    write_input(cfg.input_dir, 1, ROWS, first=BATCHES)
    second = run_reference_job(cfg_path, {}, log, drop=())
    assert second.returncode == 0, log.read_text()[-3000:]
    lines = [json.loads(x) for x in second.stdout.splitlines() if x.startswith("{")]
    assert lines[-1] == {"done": True}

    report = verify([maria, pg], expected_ids(BATCHES + 1, ROWS), sink=cfg.sink)
    assert len(report.systems) == 2
    for system in report.systems:
        assert system.missing == 0 and system.unexpected == 0, report.lines()
        assert system.duplicates == 0 and system.prepared_leftovers == 0, report.lines()
    assert report.ok, report.lines()
    assert mariadb_server.sql("XA RECOVER") == []


@pytest.mark.slow  # CI time (45 s alone): the SQL kill tests above run MariaDB under kills
def test_chaos_cli_mariadb(tmp_path: Path) -> None:
    """``twophase chaos --mariadb-local``: random driver and worker kills, then verified."""
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "twophase.cli", "chaos", "--mariadb-local", "--no-postgres",
         "--no-files", "--kills", "2", "--seed", "7", "--batches", "2",
         "--rows-per-batch", "30", "--workdir", str(tmp_path / "w"), "--json-out", str(out),
         "--quiet"],
        capture_output=True, text=True, timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True, report["verify_lines"]
    assert report["kills"] >= 2, report["events"]
    [system] = report["verify"]["systems"]
    assert system["kind"] == "sql", system
    assert system["duplicates"] == 0 and system["missing"] == 0, report["verify_lines"]
    assert system["prepared_leftovers"] == 0, report["verify_lines"]
