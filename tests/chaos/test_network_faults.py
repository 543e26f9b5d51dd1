"""Network faults, in a network namespace this test creates: the coordinator (or
PostgreSQL) runs inside it, reached over a veth pair with private addresses; the link is
cut for a few seconds at a protocol step (``tc netem loss 100%`` on the host's end where the
kernel has netem; else that end is set down, which this development container needs).

- the coordinator unreachable while a task sends its vote, and while it sends its ack;
- PostgreSQL unreachable while the task runs ``COMMIT PREPARED``.

Each batch must end COMMITTED with 0 duplicates, 0 missing and nothing left prepared:
the clients ride out the cut (TCP retransmits, the coordinator client's retries), and
nothing is decided twice. Needs root and iproute2 (``ip``, ``tc``), as CI has.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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
from twophase.sinks.postgres.participant import PostgresParticipant
from twophase.testing.localpg import LocalPostgres
from twophase.testing.servers import LocalDaemon

CUT_SECONDS = 6.0


@dataclass
class Netns:
    name: str
    host_dev: str
    host_ip: str
    ns_ip: str

    def cut(self) -> None:
        """Every packet between the host and the namespace is lost: ``tc netem loss
        100%`` where the kernel has netem, else the host's end of the link goes down."""
        if _has_netem(self.host_dev):
            _ip("tc", "qdisc", "replace", "dev", self.host_dev, "root", "netem", "loss", "100%")
        else:
            _ip("ip", "link", "set", "dev", self.host_dev, "down")

    def heal(self) -> None:
        if _has_netem(self.host_dev):
            _ip("tc", "qdisc", "del", "dev", self.host_dev, "root")
        else:
            _ip("ip", "link", "set", "dev", self.host_dev, "up")


_NETEM: list[bool] = []


def _has_netem(dev: str) -> bool:
    """Whether this kernel has sch_netem (containers often lack it), probed on our own
    link ``dev``."""
    if not _NETEM:
        probe = subprocess.run(["tc", "qdisc", "add", "dev", dev, "root", "netem", "delay",
                                "0ms"], capture_output=True, check=False)
        if probe.returncode == 0:
            subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], check=False)
        _NETEM.append(probe.returncode == 0)
    return _NETEM[0]


def _ip(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, timeout=30)


@pytest.fixture
def netns() -> Iterator[Netns]:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        pytest.fail("network fault tests need root and iproute2 (apt-get install iproute2)")
    tag = f"{os.getpid() % 10000}{random.randrange(100, 999)}"
    name, host_dev, ns_dev = f"tpns{tag}", f"tph{tag}", f"tpn{tag}"
    net = random.randrange(1, 250)
    ns = Netns(name, host_dev, f"10.213.{net}.1", f"10.213.{net}.2")
    try:
        _ip("ip", "netns", "add", name)
        _ip("ip", "link", "add", host_dev, "type", "veth", "peer", "name", ns_dev)
        _ip("ip", "link", "set", ns_dev, "netns", name)
        _ip("ip", "addr", "add", f"{ns.host_ip}/30", "dev", host_dev)
        _ip("ip", "link", "set", host_dev, "up")
        _ip("ip", "netns", "exec", name, "ip", "addr", "add", f"{ns.ns_ip}/30", "dev", ns_dev)
        _ip("ip", "netns", "exec", name, "ip", "link", "set", ns_dev, "up")
        _ip("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", host_dev], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        failpoints.reload("", "")


def _cut_at(ns: Netns, once: Path, seconds: float = CUT_SECONDS) -> float:
    """When the failpoint fires, cut the link for ``seconds``; returns when it healed."""
    wait_fired(once)
    ns.cut()
    try:
        time.sleep(seconds)
    finally:
        ns.heal()
    return time.monotonic()


@pytest.mark.parametrize("point", ["after_prepare", "after_commit"])
def test_coordinator_unreachable_during_vote_and_ack(
        point: str, netns: Netns, pg_dsn: str, tmp_path: Path) -> None:
    """``after_prepare``: the link is cut while the driver sends the task's vote;
    ``after_commit``: while it sends the branch's ack."""
    daemon = LocalDaemon(f"sqlite:///{tmp_path}/log.db", TOKEN, tmp_path / "d.log",
                         host=netns.ns_ip, netns=netns.name).start()
    try:
        table = f"net_{point}_{os.getpid()}"
        pg = PostgresParticipant(pg_dsn, table, name="pg")
        pg.check(SCHEMA)
        client = CoordinatorClient(daemon.url, TOKEN, retry_budget=120.0)
        sink = f"net-{point.replace('_', '-')}-{os.getpid()}"
        epoch = client.register(sink)
        # hold the task just before it talks to the coordinator; cut while it does
        where = f"{point}@pg/0"
        failpoints.reload(f"{where}=sleep(1)*1", str(tmp_path / "once"))
        rows = rows_for(7, 300)
        result: dict[str, str] = {}
        errors: list[str] = []
        t = threading.Thread(target=lambda: result.setdefault("state", write_batch(
            client, daemon.url, sink, epoch, 0, (pg,), rows, errors=errors)))
        started = time.monotonic()
        t.start()
        healed = _cut_at(netns, tmp_path / "once")
        t.join(timeout=300)
        assert not t.is_alive()
        assert result["state"] == "COMMITTED", (result, errors)
        assert healed - started >= CUT_SECONDS
        ids = table_ids(pg_dsn, table)
        assert ids == rows.column("id").to_pylist()  # no duplicate, none missing
        assert pg.in_doubt(sink) == []
        txn = client.get((sink, "lin", 0, 1))
        assert txn.state.value == "COMMITTED"
        assert all(b.ack is not None for b in txn.branches.values())
    finally:
        daemon.stop()


def test_postgres_unreachable_during_commit_prepared(netns: Netns, tmp_path: Path) -> None:
    """PostgreSQL runs in the namespace; the link is cut right before the task's
    ``COMMIT PREPARED`` and healed after a few seconds: the commit lands once."""
    server = LocalPostgres(max_prepared_transactions=10, fsync=False, host=netns.ns_ip,
                           netns=netns.name).start()
    daemon = LocalDaemon(f"sqlite:///{tmp_path}/log.db", TOKEN, tmp_path / "d.log").start()
    try:
        pg = PostgresParticipant(server.dsn, "orders", name="pg")
        pg.check(SCHEMA)
        client = CoordinatorClient(daemon.url, TOKEN, retry_budget=120.0)
        epoch = client.register("net-commit")
        failpoints.reload("before_commit@pg/0=sleep(1)*1", str(tmp_path / "once"))
        rows = rows_for(3, 300)
        result: dict[str, str] = {}
        errors: list[str] = []
        t = threading.Thread(target=lambda: result.setdefault("state", write_batch(
            client, daemon.url, "net-commit", epoch, 0, (pg,), rows, errors=errors)))
        t.start()
        _cut_at(netns, tmp_path / "once")
        t.join(timeout=300)
        assert not t.is_alive()
        assert result["state"] == "COMMITTED", (result, errors)
        assert table_ids(server.dsn, "orders") == rows.column("id").to_pylist()
        assert prepared_gids(server.dsn) == []
        assert pg.in_doubt("net-commit") == []
    finally:
        daemon.stop()
        server.stop()
