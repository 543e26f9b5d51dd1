"""The batch's own report tells what was done: its phases are the tasks' and the
driver's work (on the default staged path no task commits, the driver does), its rows
are the batch's (every partition's), and a batch finished after a failed commit reports
the batch's rows, not one partition's. Checked against what the test made happen: a
failpoint that sleeps in each branch's commit, and one that fails a commit once."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from twophase import TransactionalSink, failpoints
from twophase.engine.report import BATCH_PHASES
from twophase.sinks.files import StagedFileParticipant
from twophase.sinks.postgres import PostgresParticipant
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark

SLEEP_S = 0.3  # each branch's commit sleeps this long, in the driver's commit lanes
LINE = re.compile(r"batch (\d+) (\w+): (\d+) rows, .* prepare (\d+) ms, wait (\d+) ms, "
                  r"commit (\d+) ms, total (\d+) ms")


def test_the_report_counts_the_drivers_commit_and_the_whole_batchs_rows(
    spark: Any, tmp_path: Path, pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    lake = StagedFileParticipant(str(tmp_path / "out"), format="parquet", name="lake")
    pg = PostgresParticipant(dsn=pg_dsn, table="batch_report_rows")
    sink = TransactionalSink("reported", [pg, lake], f"sqlite:///{tmp_path / 'c.db'}",
                             lineage="reported-1", partitions=4, preflight=False)
    sizes = (400, 1664)
    try:
        with caplog.at_level(logging.INFO, logger="twophase.sink"):
            failpoints.reload(f"before_commit@lake=sleep({SLEEP_S})")
            sink(spark.range(0, sizes[0]).selectExpr("id", "'a' as label"), 0)
            # batch 1: one branch's commit fails once; the batch is finished again
            # from the coordinator's record (outcome "recovered")
            failpoints.reload("before_commit@lake/2=raise*1")
            sink(spark.range(1000, 1000 + sizes[1]).selectExpr("id", "'b' as label"), 1)
        conn = sink._engine.conn
        assert conn is not None
        metrics = httpx.get(f"{conn.url}/metrics", timeout=10,
                            headers={"Authorization": "Bearer "
                                     + str(conn.operator_token or conn.token)}).text
    finally:
        failpoints.reload("")
        sink.close()
    first, second = sink.history
    assert (first.outcome, first.rows, first.partitions) == ("committed", sizes[0], 4)
    assert (second.outcome, second.rows) == ("recovered", sizes[1]), second
    # no task committed (the staged path): the driver's commit is the batch's commit
    assert "commit_s" not in first.phases and first.phases["driver_commit_s"] > 0
    assert first.commit_s >= SLEEP_S, first.phases
    for r in sink.history:
        for name, parts in BATCH_PHASES.items():
            assert getattr(r, name) == pytest.approx(sum(r.phases.get(k, 0.0) for k in parts))
        assert r.prepare_s + r.wait_s + r.commit_s <= r.seconds
    lines = [LINE.search(rec.getMessage()) for rec in caplog.records]
    logged = {int(m[1]): m for m in lines if m}
    assert sorted(logged) == [0, 1], caplog.text
    assert (logged[0][2], int(logged[0][3])) == ("committed", sizes[0])
    assert (logged[1][2], int(logged[1][3])) == ("recovered", sizes[1])
    assert int(logged[0][6]) >= SLEEP_S * 1000 and int(logged[0][6]) == round(first.commit_s * 1000)
    # the coordinator's histogram of branch commits has the driver's commits
    count = re.search(r'twophase_branch_commit_seconds_count\{participant="lake",'
                      r'sink="reported"\} (\S+)', metrics)
    assert count is not None and float(count[1]) >= 4, metrics[:3000]
    total = re.search(r'twophase_branch_commit_seconds_sum\{participant="lake",'
                      r'sink="reported"\} (\S+)', metrics)
    assert total is not None and float(total[1]) >= 4 * SLEEP_S
    report = verify([pg, lake], [*range(sizes[0]), *range(1000, 1000 + sizes[1])],
                    sink="reported")
    assert report.ok, report
