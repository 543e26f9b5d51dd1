"""The reference job's driver as a process group a test SIGKILLs whole (its Python,
Spark's JVM and every Python worker) while a failpoint holds it at a protocol step
(tests/spark/test_datasource_kill.py, test_kafka_timeout_kill.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg

from twophase import failpoints


def start_driver(cfg_path: Path, env_extra: dict[str, str], log: Path) -> subprocess.Popen[str]:
    """``python -m twophase.testing.job cfg_path`` in a session of its own (so that its
    whole group can be killed), failpoints only from ``env_extra``, stderr appended to
    ``log``, stdout (the job's JSON lines) piped."""
    env = {k: v for k, v in os.environ.items()
           if k not in (failpoints.ENV, failpoints.ONCE_DIR_ENV, "PYSPARK_PYTHON")}
    env.update(env_extra)
    with open(log, "a") as err:
        return subprocess.Popen([sys.executable, "-m", "twophase.testing.job", str(cfg_path)],
                                env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)


def kill_when_held(proc: subprocess.Popen[str], once: Path, log: Path, firings: int = 1) -> None:
    """SIGKILL the driver's whole process group once the failpoint has fired
    ``firings`` times (each a thread or task it holds)."""
    deadline = time.monotonic() + 300
    while len(failpoints.fired(str(once))) < firings:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(0.5)  # the other commit lanes go on while one is held: let them land
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def prepared(dsn: str) -> list[str]:
    """Every PostgreSQL prepared transaction's gid."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT gid FROM pg_prepared_xacts").fetchall()]
