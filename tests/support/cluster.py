"""The ``cluster`` fixture: a Spark standalone master and two workers, each worker in
its own network namespace (``twophase.testing.cluster``), plus a PostgreSQL server that
the workers reach on the bridge. Started once per test run, on first use.

Drivers run as separate processes (``python -m twophase.testing.job CONFIG``, or a
script), exactly as a user's ``spark-submit``-ed driver would, on the host side of the
bridge; so they can be SIGKILLed and restarted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from twophase import failpoints
from twophase.testing.chaosprocs import read_json_lines
from twophase.testing.cluster import SparkStandalone, Worker
from twophase.testing.localpg import LocalPostgres


@dataclass
class Cluster:
    spark: SparkStandalone
    pg: LocalPostgres

    @property
    def host(self) -> str:
        return self.spark.host_address

    @property
    def pg_dsn(self) -> str:
        """PostgreSQL as the workers see it: on the bridge, not loopback."""
        return self.pg.dsn_at(self.host)

    def spark_conf(self, **extra: str) -> dict[str, str]:
        """What a user passes to spark-submit for this cluster: 4 cores in all (two per
        worker), and wait for every executor before the first batch."""
        conf = {
            "spark.master": self.spark.master_url,
            "spark.driver.host": self.host,
            "spark.executor.memory": "512m",
            "spark.cores.max": "4",
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s",
            "spark.sql.shuffle.partitions": "4",
            "spark.ui.enabled": "false",
            "spark.pyspark.python": sys.executable,
        }
        conf.update(extra)
        return conf

    def worker_of(self, pid: int) -> Worker:
        for w in self.spark.workers:
            if pid in w.pids():
                return w
        raise AssertionError(f"pid {pid} runs on no worker of the cluster")


ELASTIC: dict[str, str] = {
    "spark.dynamicAllocation.enabled": "true",
    "spark.dynamicAllocation.shuffleTracking.enabled": "true",
    "spark.dynamicAllocation.minExecutors": "0",
    "spark.dynamicAllocation.maxExecutors": "2",
    "spark.dynamicAllocation.executorIdleTimeout": "30s",
    "spark.executor.cores": "2",
    "spark.speculation": "true", "spark.speculation.multiplier": "1.1",
    "spark.speculation.quantile": "0.5", "spark.speculation.minTaskRuntime": "50ms",
    "spark.speculation.efficiency.enabled": "false",
    "spark.scheduler.minRegisteredResourcesRatio": "0",
}
"""An elastic, eagerly speculating cluster: executors from 0 to 2 (one per worker),
a stalled task copied as soon as half of its stage is done."""


def executor_failpoints(spec: str, once_dir: Path) -> dict[str, str]:
    """Spark conf that arms failpoints in the executors' Python workers only."""
    return {
        f"spark.executorEnv.{failpoints.ENV}": spec,
        f"spark.executorEnv.{failpoints.ONCE_DIR_ENV}": str(once_dir),
    }


_DRIVERS: list[Driver] = []  # killed at the cluster's teardown if a test left one running


class Driver:
    """One driver process in its own process group (its JVM included); its JSON
    stdout lines are collected in :attr:`lines`."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        base = {k: v for k, v in os.environ.items()
                if k not in (failpoints.ENV, failpoints.ONCE_DIR_ENV)
                and not k.startswith(("SPARK_", "PYSPARK_"))}
        base.update(env or {})
        self.lines: list[dict[str, Any]] = []
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *args], env=base, stdout=subprocess.PIPE, stderr=err,
                text=True, start_new_session=True,
            )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        _DRIVERS.append(self)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        read_json_lines(self.proc.stdout, self.lines.append)

    def batches(self) -> list[dict[str, Any]]:
        return [x for x in self.lines if "batch" in x]

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"driver still running after {timeout:.0f}s:\n"
                                 f"{self.tail()}") from None
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        """SIGKILL the driver and its JVM (a driver host that dies)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(60)
        self._reader.join(5)

    def tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        keep = [x for x in lines if "WARN" not in x and not x.startswith("\tat ")]
        return "\n".join(keep[-n:])


def wait_for_claims(once_dir: Path, prefix: str, n: int, driver: Driver,
                    timeout: float = 240.0) -> list[str]:
    """Block until ``n`` firings of the failpoint entry starting with ``prefix`` were
    claimed (each claim file records where and in which pid it fired)."""
    deadline = time.monotonic() + timeout
    while True:
        claims = sorted(p for p in once_dir.glob(f"{prefix}*") if p.is_file())
        if len(claims) >= n:
            return [p.read_text().strip() for p in claims]
        if driver.proc.poll() is not None:
            raise AssertionError(f"driver exited ({driver.proc.returncode}) before "
                                 f"{n} firings of {prefix}:\n{driver.tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{n} firings of {prefix} not seen in {timeout:.0f}s")
        time.sleep(0.1)


def assert_exactly_once_with_a_copy(cluster: Cluster, table: str, files: Path,
                                    once: Path, expected: list[int], batches: int) -> int:
    """The elastic runs' verdict: every id once in PostgreSQL and the files, nothing
    prepared or staged, and partition 7 prepared more often than once a batch (a
    speculative copy ran). Returns how many prepares of partition 7 there were."""
    import psycopg
    import pyarrow.dataset as ds

    with psycopg.connect(cluster.pg_dsn) as conn:
        ids = [r[0] for r in conn.execute(f'select id from "{table}"').fetchall()]
        prepared = conn.execute("select count(*) from pg_prepared_xacts").fetchone()
    assert sorted(ids) == expected
    assert prepared == (0,)
    got = ds.dataset(files, format="parquet").to_table(columns=["id"])
    assert sorted(got.column("id").to_pylist()) == expected
    staged = [f for f in files.rglob("*") if f.is_file() and "/_" in str(f)]
    assert not staged, staged
    copies = len(list(once.glob("before_prepare*")))
    assert copies > batches, f"no speculative copy of partition 7 ran ({copies} prepares)"
    return copies


def claim_pid(claim: str) -> int:
    return int(claim.split("pid=")[1].split()[0])


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    started = time.monotonic()
    spark = SparkStandalone(workers=2, cores=2, memory="1g")
    spark.start(timeout=240)
    pg = LocalPostgres(max_prepared_transactions=100, fsync=False,
                       also_listen=spark.host_address, trust_network=spark.network)
    try:
        pg.start()
        print(f"\ncluster up in {time.monotonic() - started:.1f}s: master "
              f"{spark.master_url}, workers {[w.address for w in spark.workers]}")
        yield Cluster(spark, pg)
    finally:
        for d in _DRIVERS:
            if d.proc.poll() is None:
                d.kill()
        pg.stop()
        spark.stop()
