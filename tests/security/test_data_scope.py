"""A job's data token acts on its own sinks only: begin, vote, ack, abandon, register
another job's sink are refused (403) and change nothing; a data token that names no
sink is refused when the daemon starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.security.conftest import EVIL, OPERATOR, ORDERS, Daemon
from twophase.testing.servers import clean_env, free_port

_batches = iter(range(1000))


def _orders_batch(daemon: Daemon) -> tuple[int, str]:
    """Sink ``orders`` registered by its job, a new batch begun: (epoch, its path)."""
    r = daemon.call("POST", "/v1/sinks/orders/register", ORDERS)
    assert r.status_code == 200, r.text
    epoch = int(r.json()["epoch"])
    r = daemon.call("POST", "/v1/sinks/orders/begin", ORDERS, json={
        "lineage": "lin", "checkpoint": next(_batches), "epoch": epoch,
        "participants": ["pg"], "partitions": 1})
    assert r.status_code == 200, r.text
    t = r.json()["txn"]
    return epoch, f"/v1/txns/orders/lin/{t['checkpoint']}/{t['attempt']}"


def test_data_token_cannot_abandon_another_jobs_batch(daemon: Daemon) -> None:
    epoch, txn = _orders_batch(daemon)
    r = daemon.call("POST", txn + "/abandon", EVIL, json={"epoch": epoch, "reason": "x"})
    assert r.status_code == 403, r.text
    state = daemon.call("GET", txn, ORDERS).json()["state"]
    assert state not in ("ABORTED", "ABORTING"), state


def test_data_token_cannot_reregister_a_live_sink(daemon: Daemon) -> None:
    """Re-registering bumps the writer epoch and fences the live writer: only the
    sink's own token may."""
    epoch, _ = _orders_batch(daemon)
    r = daemon.call("POST", "/v1/sinks/orders/register", EVIL)
    assert r.status_code == 403, r.text
    assert daemon.call("GET", "/v1/sinks/orders", OPERATOR).json()["epoch"] == epoch


def test_data_token_cannot_begin_vote_or_ack_another_sink(daemon: Daemon) -> None:
    epoch, txn = _orders_batch(daemon)
    calls = [
        ("POST", "/v1/sinks/orders/begin", {"lineage": "lin", "checkpoint": 999,
                                            "epoch": epoch, "participants": ["pg"],
                                            "partitions": 1}),
        ("POST", txn + "/votes", {"epoch": epoch, "votes": [
            {"branch": "pg/0", "yes": False, "reason": "sabotage"}]}),
        ("POST", txn + "/acks", {"epoch": epoch, "acks": [
            {"branch": "pg/0", "outcome": "ABORT"}]}),
        ("GET", txn + "/decision?timeout=0", None),
        ("GET", "/v1/sinks/orders/committing", None),
    ]
    for method, path, body in calls:
        r = daemon.call(method, path, EVIL, json=body)
        assert r.status_code == 403, (path, r.text)
    got = daemon.call("GET", txn, ORDERS).json()
    assert got["state"] == "OPEN" and not any(
        b.get("vote") for b in got["branches"].values()), got


def test_unscoped_data_token_is_refused_at_start(tmp_path: Path) -> None:
    """A data line naming no sink would act on every job's batches: the daemon refuses
    to start and says how to scope it (or to write '*' on purpose)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"operator {OPERATOR}\ndata {EVIL}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "twophase.cli", "serve", "--store",
         f"sqlite:///{tmp_path}/log.db", "--port", str(free_port()), "--token-file",
         str(tokens)], env=clean_env(), capture_output=True, text=True, timeout=20)
    assert proc.returncode == 2, proc.stderr
    assert "line 2" in proc.stderr and "'*'" in proc.stderr, proc.stderr
    assert not (tmp_path / "log.db").exists()


def test_all_sinks_data_token_is_written_so(tmp_path: Path) -> None:
    """'data TOKEN *' is the explicit all-sinks form; the daemon names it at start."""
    from twophase.coordinator.roles import parse_token_file

    tokens = tmp_path / "tokens"
    tokens.write_text(f"data {EVIL} *\n")
    assert parse_token_file(str(tokens))[EVIL].sinks == ("*",)
