"""Issue 10: a user's own job, run as the user runs it, and the executors' check.

- the README's example job, saved to a file and run by a plain interpreter (no
  ``PYSPARK_PYTHON``, nothing twophase-internal in the environment), lands every row
  exactly once in PostgreSQL and Parquet and logs one line per batch;
- executors whose Python lacks pyarrow are named (host, interpreter, fix) before anything
  is written, and nothing is retried;
- a cause a retry cannot heal (a missing module) fails the batch after one attempt.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import venv
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark import cloudpickle

from tests.support.user import user_env
from twophase import TransactionalSink
from twophase.client.connection import connect
from twophase.errors import BatchFailed, EnvironmentProblem
from twophase.participant import BranchRef, Handle
from twophase.sinks.files import StagedFileParticipant
from twophase.sinks.postgres import PostgresParticipant
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[2]


def _readme_job() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Your own job", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_job_as_a_user_runs_it(tmp_path: Path, pg_dsn: str) -> None:
    incoming = tmp_path / "data" / "incoming" / "orders"
    incoming.mkdir(parents=True)
    for i in range(3):  # one file per micro-batch (maxFilesPerTrigger=1)
        ids = pa.array(range(i * 40, (i + 1) * 40), pa.int64())
        pq.write_table(pa.table({"id": ids, "amount": pa.array([1.5] * 40)}),
                       incoming / f"part-{i}.parquet")
    table = "readme_orders"
    script = (
        _readme_job()
        .replace("postgresql://user@localhost:5432/shop", pg_dsn)
        .replace('table="orders"', f'table="{table}"')
        .replace('"/data/', f'"{tmp_path}/data/')
        .replace("sqlite:////var/lib/", f"sqlite:///{tmp_path}/var/lib/")  # folder missing
    )
    assert script.count(str(tmp_path)) == 4, script
    job = tmp_path / "job.py"
    job.write_text(script)
    out = subprocess.run([sys.executable, str(job)], env=user_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=400, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    committed = re.findall(r"INFO twophase\.sink: sink orders batch (\d+) committed: (\d+) rows",
                           out.stderr)
    assert committed == [("0", "40"), ("1", "40"), ("2", "40")], out.stderr[-4000:]
    assert "the executors use the driver's interpreter" in out.stderr
    assert f"({sys.executable}," in out.stderr  # the preflight's host line names it
    assert "Traceback" not in out.stderr
    assert "twophase.coordinator" not in out.stderr  # the embedded coordinator stays quiet
    parts = [PostgresParticipant(dsn=pg_dsn, table=table),
             StagedFileParticipant(path=str(tmp_path / "data" / "lake" / "orders"))]
    report = verify(parts, list(range(120)), sink="orders")
    assert report.ok, report.lines()
    assert [s.rows for s in report.systems] == [120, 120]


def _bare_python(where: Path) -> str:
    """An interpreter of the same Python version with nothing installed (no pyarrow)."""
    venv.EnvBuilder(with_pip=False).create(where)
    python = where / "bin" / "python"
    check = subprocess.run([str(python), "-c", "import pyarrow"], env=user_env(),
                           capture_output=True, timeout=60, check=False)
    assert check.returncode != 0  # really bare
    return str(python)


def test_executors_without_pyarrow_are_named_before_anything_is_written(
    spark: Any, tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare = _bare_python(tmp_path / "bare")
    sc = spark.sparkContext
    # what PYSPARK_PYTHON=<bare>/bin/python at start-up does to the SparkContext
    monkeypatch.setenv("PYSPARK_PYTHON", bare)
    monkeypatch.setattr(sc, "pythonExec", bare)
    coordinator = f"sqlite:///{tmp_path / 'coord.db'}"
    out = tmp_path / "out"
    sink = TransactionalSink(
        "nopyarrow", [PostgresParticipant(dsn=pg_dsn, table="nopyarrow"),
                      StagedFileParticipant(path=str(out))],
        coordinator=coordinator, lineage="lin", partitions=2,
    )
    df = spark.range(10)
    try:
        with pytest.raises(EnvironmentProblem) as err:
            sink(df, 0)
    finally:
        sink.close()
    msg = str(err.value)
    assert "cannot import pyarrow: ModuleNotFoundError" in msg
    assert f"on host {socket.gethostname()}, interpreter {bare}" in msg
    assert "PYSPARK_PYTHON" in msg and "spark.pyspark.python" in msg and "--archives" in msg
    # nothing begun (so nothing retried), nothing written anywhere
    with connect(coordinator) as conn:
        assert conn.client(operator=True).list(sink="nopyarrow") == []
    with psycopg.connect(pg_dsn, autocommit=True) as pg:
        assert pg.execute("SELECT to_regclass('public.nopyarrow')").fetchone() == (None,)
    assert not out.exists() or not any(out.rglob("*.parquet"))


class _NeedsAModule(StagedFileParticipant):
    """Its prepare needs a module the executors do not have."""

    def prepare(self, branch: BranchRef, schema: pa.Schema,
                batches: Iterable[pa.RecordBatch]) -> Handle:
        import twophase_no_such_module  # type: ignore[import-not-found]  # noqa: F401

        return super().prepare(branch, schema, batches)


def test_a_missing_module_in_prepare_is_not_retried(spark: Any, tmp_path: Path) -> None:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors lack tests/
    try:
        coordinator = f"sqlite:///{tmp_path / 'coord.db'}"
        sink = TransactionalSink(
            "nomodule", [_NeedsAModule(path=str(tmp_path / "out"))], coordinator=coordinator,
            lineage="lin", partitions=2, max_attempts=3, backoff=0.1, preflight=False,
        )
        try:
            with pytest.raises(BatchFailed) as err:
                sink(spark.range(10), 0)
        finally:
            sink.close()
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert "not retried" in str(err.value)
    assert "No module named 'twophase_no_such_module'" in str(err.value)
    with connect(coordinator) as conn:
        attempts = [t.attempt for t in conn.client(operator=True).list(sink="nomodule")]
    assert attempts == [1]


def test_executors_that_cannot_reach_the_coordinator_are_named(spark: Any,
                                                               tmp_path: Path) -> None:
    from twophase.spark.preflight import check_executors
    from twophase.testing.servers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EnvironmentProblem) as err:
        check_executors(spark.sparkContext, "unreachable",
                        [StagedFileParticipant(path=str(tmp_path / "out"))], url)
    msg = str(err.value)
    assert f"cannot reach the coordinator at {url}" in msg and "refused" in msg
    assert "TWOPHASE_EMBEDDED_HOST" in msg and socket.gethostname() in msg


def test_a_coordinator_outage_at_start_is_waited_for_not_blamed_on_executors(
        spark: Any, tmp_path: Path) -> None:
    """Found by `twophase chaos`: the daemon killed while a driver started made the probe
    report the executors' environment as broken and the query failed at once. When the
    driver cannot reach the coordinator either, it is an outage: the probe runs again
    within the budget and passes once the coordinator is back; if it never comes back,
    the error names the coordinator, not the interpreter."""
    import contextlib
    import threading
    import time as _time

    from twophase.spark.preflight import check_executors
    from twophase.testing.servers import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    parts = [StagedFileParticipant(path=str(tmp_path / "out"))]
    stop = threading.Event()

    def come_back_later() -> None:  # a coordinator that listens from 4 s on
        _time.sleep(4)
        with socket.create_server(("127.0.0.1", port)) as srv:
            srv.settimeout(0.2)
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    srv.accept()[0].close()

    t = threading.Thread(target=come_back_later, daemon=True)
    t.start()
    try:
        started = _time.monotonic()
        report = check_executors(spark.sparkContext, "outage", parts, url, wait_s=60)
        assert report.ok and _time.monotonic() - started >= 3
    finally:
        stop.set()
        t.join(10)
    gone = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EnvironmentProblem) as err:
        check_executors(spark.sparkContext, "outage2", parts, gone, wait_s=3)
    assert f"cannot reach the coordinator at {gone}" in str(err.value)
    assert "PYSPARK_PYTHON" not in str(err.value)  # not an interpreter problem


def test_the_probe_runs_in_the_python_workers_the_batch_reuses(spark: Any,
                                                              tmp_path: Path) -> None:
    """An RDD job's Python workers are not the pool SQL's Arrow runner uses: a probe run as
    an RDD job made every (re)started sink start two pools before its first batch (bench/
    restart.py: +2.2 s against a plain job). Given the session, the probe is a mapInArrow
    job, and the batch's barrier mapInArrow tasks then run in the same worker processes."""
    from twophase.spark.preflight import check_executors

    n = int(spark.sparkContext.defaultParallelism)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        report = check_executors(spark.sparkContext, "samepool",
                                 [StagedFileParticipant(path=str(tmp_path / "out"))], url,
                                 session=spark)
    assert report.ok
    probed = {pid for h in report.hosts for pid in h.pids}
    assert len(probed) == n and 0 not in probed

    def pids(batches: Any) -> Any:
        import os

        import pyarrow as pa

        for _ in batches:
            pass
        yield pa.RecordBatch.from_pydict({"pid": [os.getpid()]})

    batch = {r["pid"] for r in spark.range(0, n, 1, n)
             .mapInArrow(pids, "pid long", barrier=True).collect()}
    # an RDD probe's workers are never these (another pool); an idle worker left by an
    # earlier test may take one of the tasks, so: shared, not necessarily all
    assert batch & probed, (batch, probed)
