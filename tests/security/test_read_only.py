"""The commands that only look (``resolve --dry-run``, ``txns``, ``sinks``) leave the
store's bytes as they found them: SQLite opened ``mode=ro``, even when a stopped daemon
left its write-ahead log behind (a read-write open checkpoints it into the database and
removes the ``-wal`` and ``-shm`` files when it closes)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import httpx

from tests.security.conftest import OPERATOR
from twophase.testing.servers import LocalDaemon, clean_env


def _state(db: Path) -> dict[str, str | None]:
    """The database and its log: their SHA-256, or None when absent; the ``-shm``
    index: present or not (readers keep their read marks in it: shared memory, not
    data)."""
    out: dict[str, str | None] = {}
    for suffix in ("", "-wal"):
        f = Path(f"{db}{suffix}")
        out[suffix or "db"] = hashlib.sha256(f.read_bytes()).hexdigest() if f.exists() \
            else None
    out["-shm"] = "present" if Path(f"{db}-shm").exists() else None
    return out


def test_read_only_commands_leave_the_store_bytes_alone(tmp_path: Path) -> None:
    db = tmp_path / "tp.db"
    daemon = LocalDaemon(f"sqlite:///{db}", OPERATOR, tmp_path / "d.log").start()
    try:
        h = {"Authorization": f"Bearer {OPERATOR}"}
        assert httpx.post(f"{daemon.url}/v1/sinks/orders/register", headers=h, json={
            "participants": [{"kind": "files", "name": "files", "target": str(tmp_path),
                              "options": {"path": str(tmp_path / "out"),
                                          "format": "jsonl"}}]}).status_code == 200
        assert httpx.post(f"{daemon.url}/v1/sinks/orders/begin", headers=h, json={
            "lineage": "lin", "checkpoint": 0, "epoch": 1, "participants": ["files"],
            "partitions": 1}).status_code == 200
    finally:
        daemon.kill()  # as a crash (or a stop that never checkpointed) leaves it
    before = _state(db)
    assert before["-wal"] is not None, "the scenario needs a write-ahead log left behind"
    url = f"sqlite:///{db}"
    env = clean_env()
    for args in (["resolve", "orders", "--dry-run", "--coordinator", url],
                 ["txns", "--coordinator", url, "--json"],
                 ["sinks", "--coordinator", url, "--json"],
                 ["sinks", "--coordinator", url, "--grants", "orders"]):
        proc = subprocess.run([sys.executable, "-m", "twophase.cli", *args], env=env,
                              capture_output=True, text=True, timeout=60)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert proc.returncode in (0, 1), (args, proc.stderr)
        assert _state(db) == before, (args, proc.stdout, proc.stderr)
    assert "orders" in proc.stdout  # the grants line: it did read the store
