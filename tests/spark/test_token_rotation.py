"""A running streaming query keeps committing while its data token is rotated: the
daemon's token file gains the new token, the job's token file is rewritten, the old
token leaves the daemon's file; neither the query nor the daemon restarts."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from twophase.testing.job import JobConfig, build_participants, expected_ids, write_input
from twophase.testing.servers import LocalDaemon
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark

ROWS = 20


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _wait(what: Any, why: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, why
        time.sleep(0.1)


def test_a_running_query_commits_across_a_data_token_rotation(
    spark: Any, tmp_path: Path
) -> None:
    from twophase import TransactionalSink

    old, new, operator = (secrets.token_urlsafe(18) for _ in range(3))
    tokens, mine = tmp_path / "tokens", tmp_path / "job-token"
    _write(tokens, f"data {old} *\noperator {operator}\n")
    _write(mine, old + "\n")
    daemon = LocalDaemon(f"sqlite:///{tmp_path / 'd.db'}", None, tmp_path / "d.log",
                         token_file=str(tokens)).start()
    cfg = JobConfig(input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
                    coordinator=daemon.url, sink="rotated", files_path=str(tmp_path / "out"),
                    partitions=2)
    sink = TransactionalSink(cfg.sink, build_participants(cfg), daemon.url,
                             token_file=str(mine), partitions=2, preflight=False)
    query = None
    try:
        write_input(cfg.input_dir, batches=1, rows_per_batch=ROWS)
        query = (spark.readStream.schema("id long, customer string, amount decimal(12,2), "
                                         "ts timestamp")
                 .option("maxFilesPerTrigger", 1).parquet(cfg.input_dir)
                 .writeStream.foreachBatch(sink).option("checkpointLocation", cfg.checkpoint)
                 .trigger(processingTime="200 milliseconds").start())

        def committed(n: int) -> None:
            _wait(lambda: len(sink.history) >= n or query.exception() is not None,
                  f"batch {n - 1} did not commit")
            assert query.exception() is None, query.exception()
            assert [r.outcome for r in sink.history] == ["committed"] * n

        committed(1)
        # overlap: the daemon accepts both, the job's file names the new one
        _write(tokens, f"data {old} *\ndata {new} *\noperator {operator}\n")
        _write(mine, new + "\n")
        write_input(cfg.input_dir, batches=1, rows_per_batch=ROWS, first=1)
        committed(2)
        # the old token is removed: the driver, refused once, re-reads its file
        _write(tokens, f"data {new} *\noperator {operator}\n")
        _wait(lambda: httpx.post(f"{daemon.url}/v1/admin/tick", timeout=5,
                                 headers={"Authorization": f"Bearer {old}"}).status_code == 401,
              "the daemon did not drop the old token", timeout=10)  # (403 while known)
        write_input(cfg.input_dir, batches=1, rows_per_batch=ROWS, first=2)
        committed(3)
        write_input(cfg.input_dir, batches=1, rows_per_batch=ROWS, first=3)
        committed(4)
        assert sink._engine.client is not None and sink._engine.client.token == new
        # the tasks of the batches after the rotation carry the new token in their plan
        assert sink._engine.job.template is not None and sink._engine.job.template.token == new
    finally:
        if query is not None:
            query.stop()
        sink.close()
        daemon.stop()
    report = verify(build_participants(cfg), expected_ids(4, ROWS), sink=cfg.sink)
    assert report.ok, report.lines()
