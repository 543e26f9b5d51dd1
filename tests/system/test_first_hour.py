"""Issue 10, the first hour: each friction a new user met, shown gone.

Fast tests here (no Spark); the user-style job and the executors' check are in
``tests/spark/test_user_job.py``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from twophase.cli.demo import MARKER, WorkdirRefused, prepare_workdir
from twophase.client.api import CoordinatorClient
from twophase.client.connection import connect
from twophase.coordinator.db import lock_sqlite
from twophase.coordinator.store import Store
from twophase.engine.resolve import resolve_sink
from twophase.errors import CoordinatorUnavailable, StoreError
from twophase.participant import BranchRef
from twophase.protocol import TxnKey
from twophase.sinks.files import StagedFileParticipant
from twophase.testing.servers import LocalDaemon, clean_env, free_port

CLI = [sys.executable, "-m", "twophase.cli"]


# --------------------------------------------------------------------- fail fast, speak early


def test_register_at_a_closed_port_fails_within_seconds_naming_url_and_cause() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with CoordinatorClient(url) as client, pytest.raises(CoordinatorUnavailable) as err:
        client.register("orders")
    assert time.monotonic() - started < 10
    msg = str(err.value)
    assert url in msg and "Connection refused" in msg and "coordinator= URL" in msg


def test_first_transient_failure_warns_once_with_the_retry_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    key = TxnKey("orders", "lin", 0, 1)
    caplog.set_level(logging.WARNING, logger="twophase.client")
    started = time.monotonic()
    with CoordinatorClient(url, retry_budget=2.0) as client, \
            pytest.raises(CoordinatorUnavailable, match="retry budget 2s"):
        client.get(key)
    assert 2.0 <= time.monotonic() - started < 6
    warnings = [r.getMessage() for r in caplog.records if r.name == "twophase.client"]
    assert len(warnings) == 1, warnings
    assert url in warnings[0] and "retrying for up to 2s" in warnings[0]


# --------------------------------------------------------------------- paths and stores


def test_sqlite_store_in_a_missing_folder_is_created(tmp_path: Path) -> None:
    db = tmp_path / "var" / "lib" / "twophase" / "orders.db"
    with connect(f"sqlite:///{db}") as conn:
        assert conn.client().register("orders") == 1
    assert db.is_file()


def test_sqlite_store_under_a_file_names_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    with pytest.raises(StoreError) as err:
        Store(f"sqlite:///{blocker / 'sub' / 'orders.db'}")
    msg = str(err.value)
    assert str(blocker / "sub") in msg and "choose another path" in msg


def test_a_second_daemon_on_one_sqlite_file_is_refused(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'log' / 'coord.db'}"
    with LocalDaemon(store, "t0ken-0123456789abcdef") as first:
        out = subprocess.run(
            [*CLI, "serve", "--store", store, "--port", str(free_port()),
             "--token", "0123456789abcdef-t"],
            capture_output=True, text=True, timeout=60, check=False, env=clean_env(),
        )
        assert out.returncode == 2, out.stderr
        assert "another coordinator already serves the SQLite store" in out.stderr
        assert str(tmp_path / "log" / "coord.db") in out.stderr
        assert first.proc is not None and str(first.proc.pid) in out.stderr
        assert first.alive
    # the lock dies with its daemon: the file can be served again
    lock = lock_sqlite(store)
    assert lock is not None
    lock.close()


# --------------------------------------------------------------------- the demo's folder


def test_demo_refuses_a_folder_it_did_not_create(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("do not lose me")
    out = subprocess.run([*CLI, "demo", "--workdir", str(mine), "--no-postgres"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "not created by twophase demo" in out.stdout and "nothing was deleted" in out.stdout
    assert (mine / "thesis.txt").read_text() == "do not lose me"


def test_demo_workdir_is_created_and_only_its_own_is_emptied(tmp_path: Path) -> None:
    work = prepare_workdir(tmp_path / "demo")
    assert (work / MARKER).is_file()
    (work / "output").mkdir()
    (work / "output" / "old.parquet").write_text("x")
    again = prepare_workdir(work)  # made by the demo: emptied, marked again
    assert sorted(p.name for p in again.iterdir()) == [MARKER]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (prepare_workdir(empty) / MARKER).is_file()  # an empty folder of yours is fine
    (tmp_path / "f").write_text("x")
    with pytest.raises(WorkdirRefused, match="is a file"):
        prepare_workdir(tmp_path / "f")


# --------------------------------------------------------------------- small edges


def test_resolve_dry_run_lists_each_branch_once(tmp_path: Path) -> None:
    files = StagedFileParticipant(path=str(tmp_path / "out"))
    with connect(f"sqlite:///{tmp_path / 'coord.db'}") as conn:
        client = conn.client()
        epoch = client.register("orders")
        res = client.begin("orders", "lin", 0, epoch, [files.name], 1)
        assert res.txn is not None
        ref = BranchRef(*res.txn.key, participant=files.name, partition=0)
        files.prepare(ref, pa.schema([("id", pa.int64())]),
                      [pa.record_batch([pa.array([1, 2])], names=["id"])])
        # the writer died before voting: one open transaction, one prepared branch
        for dry_run in (True, False):
            report = resolve_sink(conn.client(operator=True), "orders", [files],
                                  dry_run=dry_run)
            branches = [a for a in report.actions if a.branch != "*"]
            assert [(a.branch, a.action) for a in branches] == [(ref.branch_id, "abort")]
        assert files.in_doubt("orders") == []


def test_api_docs_page_loads_nothing_from_elsewhere(tmp_path: Path) -> None:
    import httpx

    with LocalDaemon(f"sqlite:///{tmp_path / 'c.db'}", "t0ken-0123456789abcdef") as daemon:
        page = httpx.get(f"{daemon.url}/docs", timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/openapi.json" in page.text and "/v1/sinks/{sink}/begin" in page.text
        assert "<script" not in page.text and "http" not in page.text.replace("/openapi", "")
        assert httpx.get(f"{daemon.url}/openapi.json", timeout=10).status_code == 200


def test_the_chaos_job_config_example_is_a_valid_config_and_every_field_is_documented(
    tmp_path: Path,
) -> None:
    import dataclasses
    import json

    from twophase.testing.job import JobConfig

    doc = (Path(__file__).resolve().parents[2] / "docs" / "chaos.md").read_text()
    section = doc.split("### The `--job CONFIG.json` format", 1)[1]
    example = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])
    (tmp_path / "job.json").write_text(json.dumps(example))
    cfg = JobConfig.load(tmp_path / "job.json")
    assert cfg.pg_dsn and cfg.files_path and cfg.partitions == 2
    fields = {f.name for f in dataclasses.fields(JobConfig)}
    assert set(example) == fields
    table = section.split("| field |", 1)[1].split("\n\n", 1)[0]
    assert all(f"`{f}`" in table for f in fields), fields


def test_the_retry_budget_is_a_sink_option(tmp_path: Path) -> None:
    from twophase import TransactionalSink
    from twophase.errors import InvalidRequest

    files = StagedFileParticipant(path=str(tmp_path / "out"))
    with pytest.raises(InvalidRequest, match="retry_budget_s must be > 0"):
        TransactionalSink("orders", [files], coordinator="sqlite:///x.db", retry_budget_s=0)
    sink = TransactionalSink("orders", [files], coordinator=f"sqlite:///{tmp_path / 'c.db'}",
                             retry_budget_s=7.5)
    try:
        assert sink._engine.connect().retry_budget == 7.5  # the driver's client
    finally:
        sink.close()
