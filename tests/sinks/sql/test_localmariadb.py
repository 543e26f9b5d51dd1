"""The private MariaDB server: its own datadir, socket and port, and it dies with its parent."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from twophase.testing.localmariadb import LocalMariaDB

CHILD = """
import sys, time
from twophase.testing.localmariadb import LocalMariaDB
m = LocalMariaDB().start()
print(m.proc.pid, m.port, m.dir, flush=True)
time.sleep(120)
"""


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_server_dies_with_the_process_that_started_it() -> None:
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=str(root))
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                             env=env)
    assert child.stdout is not None
    pid_s, port, folder = child.stdout.readline().split()
    pid = int(pid_s)
    try:
        assert not _gone(pid, 0.5)
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert _gone(pid, 20), f"mariadbd {pid} (port {port}) outlived its parent"
    finally:
        if not _gone(pid, 0):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


def test_private_server_is_loopback_only_with_its_own_files(mariadb_server: LocalMariaDB) -> None:
    assert mariadb_server.dir is not None and mariadb_server.socket_path.exists()
    rows = dict(mariadb_server.sql(
        "SELECT VARIABLE_NAME, VARIABLE_VALUE FROM information_schema.GLOBAL_VARIABLES "
        "WHERE VARIABLE_NAME IN ('BIND_ADDRESS', 'PORT', 'DATADIR', 'SOCKET')"))
    assert rows["BIND_ADDRESS"] == "127.0.0.1"
    assert int(str(rows["PORT"])) == mariadb_server.port
    assert str(rows["DATADIR"]).startswith(str(mariadb_server.dir))
    assert rows["SOCKET"] == str(mariadb_server.socket_path)
