"""The daemon as a real process: SIGKILL at the decision, two replicas on one PostgreSQL
store, 50+ concurrent sinks, and the CLI (`serve`, `txns`)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.pg import fresh_pg_db
from twophase import protocol as p
from twophase.client.api import CoordinatorClient
from twophase.client.wire import VoteIn
from twophase.coordinator.store import Store
from twophase.testing.servers import LocalDaemon, free_port

TOKEN = "test-token-123-0123456789"


@pytest.fixture(scope="module")
def pg_url(pg_dsn: str) -> str:
    return fresh_pg_db(pg_dsn, "tp_daemon")


def start_daemon(store: str, port: int | None = None, failpoints: str = "",
                 log: Path | None = None) -> LocalDaemon:
    """``twophase serve`` in a subprocess, started and healthy, with the tests' token."""
    return LocalDaemon(store, TOKEN, log, port=port).start(failpoints)


@pytest.fixture
def daemons() -> Iterator[list[LocalDaemon]]:
    started: list[LocalDaemon] = []
    yield started
    for d in started:
        d.stop()


def _decisions(history: list[dict[str, object]]) -> int:
    undecided = {"OPEN", "PREPARING"}
    prev, n = "OPEN", 0
    for ev in history:
        if prev in undecided and ev["state"] not in undecided:
            n += 1
        prev = str(ev["state"])
    return n


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
@pytest.mark.parametrize("point", ["coordinator_before_decision", "after_decision"])
def test_sigkill_at_the_decision(kind: str, point: str, tmp_path: Path, daemons: list[LocalDaemon],
                                 request: pytest.FixtureRequest) -> None:
    store_url = (f"sqlite:///{tmp_path}/log.db" if kind == "sqlite"
                 else request.getfixturevalue("pg_url"))
    first = start_daemon(store_url, failpoints=f"{point}=kill*1")
    daemons.append(first)
    client = CoordinatorClient(first.url, TOKEN, retry_budget=60.0)
    sink = f"k{uuid.uuid4().hex[:8]}"
    epoch = client.register(sink)
    res = client.begin(sink, "lin", 0, epoch, ["pg", "files"], 1)
    assert res.txn is not None
    key = res.txn.key
    client.vote(key, epoch, [VoteIn("pg/0", True, {"gid": "g0"})])
    waited: dict[str, p.Transaction] = {}
    voted: dict[str, p.Transaction] = {}
    # a waiting executor and the last voter, both riding through the restart
    waiter = threading.Thread(
        target=lambda: waited.setdefault("t", CoordinatorClient(
            first.url, TOKEN, retry_budget=60.0).await_decision(key, 60)))
    waiter.start()
    voter = threading.Thread(
        target=lambda: voted.setdefault("t", client.vote(key, epoch, [VoteIn("files/0", True)])))
    voter.start()
    assert first.wait_dead() == -9  # SIGKILLed by the failpoint
    # what the log says while no coordinator runs
    st = Store(store_url)
    logged = st.get(key)
    assert logged is not None
    if point == "coordinator_before_decision":
        assert logged.state == p.State.PREPARING and logged.decision is None
    else:
        assert logged.state == p.State.COMMITTING
    st.close()
    second = start_daemon(store_url, port=first.port)
    daemons.append(second)
    voter.join(60)
    waiter.join(60)
    assert voted["t"].state == p.State.COMMITTING
    assert waited["t"].state == p.State.COMMITTING
    raw = client.get_raw(key, history=True)
    assert _decisions(raw["history"]) == 1
    assert raw["decided_at"] is not None
    done = client.ack(key, epoch, [("pg/0", p.Decision.COMMIT), ("files/0", p.Decision.COMMIT)])
    assert done.state == p.State.COMMITTED and done.decided_at == raw["decided_at"]
    client.close()


def test_two_replicas_racing_voters(pg_url: str, daemons: list[LocalDaemon]) -> None:
    a, b = start_daemon(pg_url), start_daemon(pg_url)
    daemons += [a, b]
    ca = CoordinatorClient(a.url, TOKEN)
    cb = CoordinatorClient(b.url, TOKEN)
    sink = f"r{uuid.uuid4().hex[:8]}"
    epoch = ca.register(sink)
    keys = []
    for ckpt in range(10):
        res = (ca if ckpt % 2 else cb).begin(sink, "lin", ckpt, epoch, ["pg", "kafka"], 3)
        assert res.txn is not None
        keys.append(res.txn.key)
    rng = random.Random(7)
    jobs = []
    for i, key in enumerate(keys):
        for bid in ("pg/0", "pg/1", "pg/2", "kafka/0", "kafka/1", "kafka/2"):
            yes = not (i % 4 == 0 and bid == "kafka/2")
            # every vote is sent to both replicas at once: the race is on purpose
            jobs.append((ca, key, bid, yes))
            jobs.append((cb, key, bid, yes))
    rng.shuffle(jobs)
    errors: list[BaseException] = []

    def run(chunk: list[tuple[CoordinatorClient, tuple[str, str, int, int], str, bool]]) -> None:
        try:
            for c, key, bid, yes in chunk:
                c.vote(key, epoch, [VoteIn(bid, yes, reason=None if yes else "no")])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(jobs[k::12],)) for k in range(12)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors[:3]
    for i, key in enumerate(keys):
        raw = ca.get_raw(key, history=True)
        assert _decisions(raw["history"]) == 1, raw["history"]
        assert raw["decision"] == ("ABORT" if i % 4 == 0 else "COMMIT")
        assert cb.await_decision(key, 5).state.value == raw["state"]
    ca.close()
    cb.close()


def test_fifty_concurrent_sinks(tmp_path: Path, daemons: list[LocalDaemon]) -> None:
    d = start_daemon(f"sqlite:///{tmp_path}/many.db")
    daemons.append(d)
    n_sinks, rounds = 55, 3
    errors: list[BaseException] = []
    seen: list[tuple[str, str, int, int]] = []
    lock = threading.Lock()

    def driver(i: int) -> None:
        try:
            with CoordinatorClient(d.url, TOKEN) as c:
                sink = f"many-{i}"
                epoch = c.register(sink)
                for ckpt in range(rounds):
                    res = c.begin(sink, "lin", ckpt, epoch, ["a", "b"], 2)
                    assert res.txn is not None
                    key = res.txn.key
                    for bid in res.txn.branches:  # one call per branch, like executor tasks
                        c.vote(key, epoch, [VoteIn(bid, True, {"h": bid})])
                    t = c.await_decision(key, 30)
                    assert t.state == p.State.COMMITTING
                    c.ack(key, epoch, [(b, p.Decision.COMMIT) for b in res.txn.branches])
                    with lock:
                        seen.append(key)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=driver, args=(i,)) for i in range(n_sinks)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(180)
    assert not errors, errors[:3]
    assert len(seen) == n_sinks * rounds
    with CoordinatorClient(d.url, TOKEN) as c:
        listed = c.list_raw(state="COMMITTED", limit=1000)
        assert {(t["sink"], t["lineage"], t["checkpoint"], t["attempt"]) for t in listed} == set(
            seen)
        metrics = httpx.get(f"{d.url}/metrics").text
        assert f'twophase_transactions{{state="COMMITTED"}} {float(n_sinks * rounds)}' in metrics


def test_cli_serve_and_txns(tmp_path: Path, daemons: list[LocalDaemon]) -> None:
    store = f"sqlite:///{tmp_path}/cli.db"
    cli = [sys.executable, "-m", "twophase.cli"]
    env = {k: v for k, v in os.environ.items() if k != "TWOPHASE_TOKEN"}
    out = subprocess.run([*cli, "serve", "--store", store], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--insecure" in out.stderr
    d = start_daemon(store)
    daemons.append(d)
    with CoordinatorClient(d.url, TOKEN) as c:
        epoch = c.register("orders")
        res = c.begin("orders", "lin", 4, epoch, ["pg"], 2)
        assert res.txn is not None
        c.vote(res.txn.key, epoch, [VoteIn("pg/0", True), VoteIn("pg/1", True)])
    table = subprocess.run([*cli, "txns", "--coordinator", store], capture_output=True,
                           text=True, timeout=60, env=env)
    assert table.returncode == 0, table.stderr
    assert "orders" in table.stdout and "COMMITTING" in table.stdout and "2/2" in table.stdout
    js = subprocess.run([*cli, "txns", "--coordinator", d.url, "--token", TOKEN, "--json",
                         "--state", "committing"], capture_output=True, text=True, timeout=60)
    assert js.returncode == 0, js.stderr
    rows = json.loads(js.stdout)
    assert [(r["sink"], r["checkpoint"], r["state"]) for r in rows] == [("orders", 4,
                                                                        "COMMITTING")]
    noauth = subprocess.run([*cli, "txns", "--coordinator", d.url], capture_output=True,
                            text=True, timeout=60, env=env)
    assert noauth.returncode == 1 and "401" in noauth.stderr
    bad = subprocess.run([*cli, "txns", "--coordinator", store, "--state", "DONE"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown state" in bad.stderr
    port = free_port()
    proc = subprocess.Popen([*cli, "serve", "--store", f"sqlite:///{tmp_path}/i.db", "--port",
                             str(port), "--insecure"], env=env, stderr=subprocess.PIPE)
    try:
        line = proc.stderr.readline().decode()  # type: ignore[union-attr]
        assert "WITHOUT authentication" in line
    finally:
        proc.terminate()
        proc.wait(10)
