"""Server faults: the servers the data lands in crash, fill up or go away, and come back.

- PostgreSQL's postmaster SIGKILLed at each protocol step and restarted on the same data
  folder (crash recovery: prepared transactions survive) while a batch runs;
- the staging filesystem of the files participant full (ENOSPC) during prepare, on a small
  tmpfs this test mounts;
- the coordinator's PostgreSQL store SIGKILLed and restarted under two daemon replicas.

Each ends with 0 duplicates, 0 missing, nothing left prepared; while a server is down the
errors name it; once it is back, the work proceeds without a hand.

The batches run the tasks' real code (``twophase.engine.task.run_partition``, what each Spark
task runs) driven by the driver's own rule (``protocol.next_step``) in this process, so a
server can be killed at an exact step (a ``sleep`` failpoint holds the task there; the
once-dir says when it got there) without a Spark job around it.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.support.fault import (
    SCHEMA,
    TOKEN,
    prepared_gids,
    rows_for,
    table_ids,
    wait_fired,
    write_batch,
)
from twophase import failpoints
from twophase.client.api import CoordinatorClient
from twophase.errors import ParticipantError
from twophase.sinks.files import StagedFileParticipant
from twophase.sinks.postgres.participant import PostgresParticipant
from twophase.testing.localpg import LocalPostgres
from twophase.testing.servers import LocalDaemon


@pytest.fixture
def armed(tmp_path: Path) -> Iterator[Path]:
    """A once-dir; the failpoints of this process are disarmed afterwards."""
    once = tmp_path / "once"
    try:
        yield once
    finally:
        failpoints.reload("", "")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    tmp = tmp_path_factory.mktemp("faults")
    d = LocalDaemon(f"sqlite:///{tmp}/log.db", TOKEN, tmp / "daemon.log").start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def own_pg() -> Iterator[LocalPostgres]:
    """A PostgreSQL of this module only: it gets killed."""
    server = LocalPostgres(max_prepared_transactions=20, fsync=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


# (step where the task is held while the postmaster is SIGKILLed, how long it stays down)
PG_STEPS = ["before_prepare", "after_prepare", "before_commit", "after_commit"]


@pytest.mark.parametrize("point", PG_STEPS)
def test_postgres_postmaster_killed_at_each_step(point: str, own_pg: LocalPostgres,
                                                 daemon: LocalDaemon, armed: Path) -> None:
    table = f"t_{point}"
    pg = PostgresParticipant(own_pg.dsn, table, name="pg")
    pg.check(SCHEMA)
    client = CoordinatorClient(daemon.url, TOKEN, retry_budget=60.0)
    sink = f"pgkill-{point.replace('_', '-')}"
    epoch = client.register(sink)
    where = f"{point}@pg/0"
    failpoints.reload(f"{where}=sleep(4)*1", str(armed))
    errors: list[str] = []
    result: dict[str, str] = {}
    rows = rows_for(0, 500)
    t = threading.Thread(target=lambda: result.setdefault("state", write_batch(
        client, daemon.url, sink, epoch, 0, (pg,), rows, errors=errors)))
    t.start()
    wait_fired(armed)
    assert own_pg.kill()  # SIGKILL of the postmaster, mid-step
    # while it is down, a participant's call fails with an error naming the server
    probe = PostgresParticipant(own_pg.dsn, table, name="probe", connect_timeout=1)
    with pytest.raises(ParticipantError, match=r"server unreachable after 3 tries"):
        probe.check(SCHEMA)
    time.sleep(1.0)
    own_pg.restart()
    t.join(timeout=300)
    assert not t.is_alive()
    assert result["state"] == "COMMITTED", (result, errors)
    ids = table_ids(own_pg.dsn, table)
    assert len(ids) == len(set(ids)) == 500, f"dup or missing: {len(ids)} rows"
    assert ids == rows.column("id").to_pylist()
    assert prepared_gids(own_pg.dsn) == []
    assert pg.in_doubt(sink) == []
    pg.close()


def test_store_down_is_503_then_recovers(own_pg: LocalPostgres, tmp_path: Path) -> None:
    """The daemon's PostgreSQL store SIGKILLed: /healthz and the API answer 503
    ``store_error`` naming the cause (never 500); once it is back, they answer again
    without a restart of the daemon."""
    with psycopg.connect(own_pg.dsn, autocommit=True) as c:
        c.execute("CREATE DATABASE tp_store_down")
    store = own_pg.dsn.rsplit("/", 1)[0] + "/tp_store_down"
    d = LocalDaemon(store, TOKEN, tmp_path / "d.log").start()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        assert own_pg.kill()
        for r in (httpx.get(f"{d.url}/healthz", timeout=30),
                  httpx.post(f"{d.url}/v1/sinks/s/register", headers=auth, timeout=30)):
            assert r.status_code == 503, r.text
            assert r.json()["error"] == "store_error"
            assert "store is unreachable" in r.json()["message"]
        own_pg.restart()
        deadline = time.monotonic() + 60
        while httpx.get(f"{d.url}/healthz", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the daemon did not reconnect"
            time.sleep(0.2)
        r = httpx.post(f"{d.url}/v1/sinks/s/register", headers=auth, timeout=30)
        assert r.status_code == 200 and r.json()["epoch"] == 1
    finally:
        d.stop()


def test_staging_filesystem_full_during_prepare(tmp_path: Path, daemon: LocalDaemon) -> None:
    """The files participant's folder is a 2 MiB tmpfs: a batch that does not fit fails
    its prepare with ENOSPC (a NO vote naming the cause), leaves nothing staged or
    visible, and commits once there is room."""
    if os.geteuid() != 0:
        pytest.fail("this test mounts a tmpfs: run the suite as root (CI does)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        files = StagedFileParticipant(str(mnt / "out"), "jsonl", name="files")
        files.check(SCHEMA)
        client = CoordinatorClient(daemon.url, TOKEN, retry_budget=60.0)
        sink = f"enospc-{uuid.uuid4().hex[:6]}"
        epoch = client.register(sink)
        big = rows_for(0, 4000, payload=1000)  # ~4 MB of JSON lines
        errors: list[str] = []
        state = write_batch(client, daemon.url, sink, epoch, 0, (files,), big,
                             max_attempts=2, errors=errors)
        assert state.startswith("GAVE_UP"), state
        assert errors and all("No space left on device" in e for e in errors), errors
        assert "files" in errors[0]  # names the participant
        staged = list((mnt / "out").rglob("*"))
        assert [p for p in staged if p.is_file()] == [], staged  # nothing half-written
        assert files.in_doubt(sink) == []
        # the operator makes room: the next run of the batch commits
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        state = write_batch(client, daemon.url, sink, epoch, 0, (files,), big)
        assert state == "COMMITTED"
        got = [r["id"] for r in _read_jsonl(mnt / "out")]
        assert sorted(got) == big.column("id").to_pylist()
        assert files.in_doubt(sink) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _read_jsonl(folder: Path) -> list[dict[str, Any]]:
    import json

    out = []
    for f in sorted(folder.glob("*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line]
    return out


@pytest.mark.slow  # ~1-2 min: two daemons, two private PostgreSQL servers, 16 batches
def test_coordinator_store_killed_under_two_replicas(tmp_path: Path) -> None:
    """Two daemons share one PostgreSQL store; it is SIGKILLed while batches run through
    both. While it is down the daemons answer 503 naming the store (and /healthz says so);
    the clients ride it out; once it is back every batch commits exactly once."""
    store_pg = LocalPostgres(max_prepared_transactions=0, fsync=True).start()
    data_pg = LocalPostgres(max_prepared_transactions=20, fsync=False).start()
    daemons: list[LocalDaemon] = []
    try:
        with psycopg.connect(store_pg.dsn, autocommit=True) as c:
            c.execute("CREATE DATABASE tp")
        store = store_pg.dsn.rsplit("/", 1)[0] + "/tp"
        daemons = [LocalDaemon(store, TOKEN, tmp_path / f"d{i}.log").start() for i in (0, 1)]
        pg = PostgresParticipant(data_pg.dsn, "orders", name="pg")
        pg.check(SCHEMA)
        results: dict[int, str] = {}
        errors: list[str] = []

        def writer(i: int) -> None:
            d = daemons[i % 2]
            client = CoordinatorClient(d.url, TOKEN, retry_budget=120.0)
            sink = f"replica-{i}"
            epoch = client.register(sink)
            for b in range(4):
                results[i * 10 + b] = write_batch(
                    client, d.url, sink, epoch, b, (PostgresParticipant(
                        data_pg.dsn, "orders", name="pg"),), rows_for(i * 100 + b, 50),
                    errors=errors)

        threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        assert store_pg.kill()
        down = httpx.get(f"{daemons[0].url}/healthz", timeout=30)
        assert down.status_code == 503, down.text
        assert down.json()["error"] == "store_error"
        r = httpx.post(f"{daemons[1].url}/v1/sinks/probe/register",
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"] == "store_error", r.text
        time.sleep(3.0)
        store_pg.restart()
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads)
        assert len(results) == 16 and set(results.values()) == {"COMMITTED"}, (results, errors)
        ids = table_ids(data_pg.dsn, "orders")
        expected = sorted(
            (i * 100 + b) * 1_000_000 + k for i in range(4) for b in range(4) for k in range(50))
        assert len(ids) == len(set(ids)), "duplicates"
        assert ids == expected, "missing or unexpected ids"
        assert prepared_gids(data_pg.dsn) == []
        for d in daemons:
            assert httpx.get(f"{d.url}/healthz", timeout=30).status_code == 200
    finally:
        for d in daemons:
            d.stop()
        data_pg.stop()
        store_pg.stop()
