"""What exactly-once costs per micro-batch: the same streaming query, written at-least-once
by a careful ``foreachBatch`` (A) and by ``TransactionalSink`` (B), side by side in one run.

Reproduce (from the repository root, in the README's venv, ``bash scripts/test.sh`` made it)::

    .venv/bin/python bench/e2e.py                               # full: 7 pairs, 10k/100k/1M + empty
    .venv/bin/python bench/e2e.py --pairs 2 --sizes 10000,100000 --batches 3   # quick look

A private PostgreSQL server (``twophase.testing.localpg``, fsync on) and one Spark session
(local[2], 2 shuffle partitions, as the reference job) are started here and stopped at the
end; files and checkpoints go to a temporary folder (``--dir`` to choose the disk).

The query: a file source (one Parquet file per micro-batch, ``maxFilesPerTrigger=1``,
``availableNow``) of the reference job's events. Each run is a new query on a fresh
checkpoint, a fresh table and a fresh output folder; its first batch warms up and is not
measured, the next ``--batches`` are.

- A, at-least-once: ``foreachBatch`` runs ``mapInArrow`` over the batch as Spark gives
  it (no repartition); each task streams its Arrow batches into psycopg ``COPY ... FROM
  STDIN (FORMAT csv)`` (pyarrow-built CSV, the participant's own encoder) and into one
  pyarrow Parquet file (fsync, rename, directory fsync), commits, reports its row count.
- B, exactly-once: ``TransactionalSink`` with ``PostgresParticipant`` and
  ``StagedFileParticipant`` (Parquet) and an embedded SQLite coordinator.

Pairs alternate (A,B then B,A ...). Printed per size: rows/s ratio B/A per pair and its
median; added latency per batch (p50, p99 of B's batch time minus A's, batch for batch
within a pair; p99 is the maximum below 100 samples); peak RSS of the Python workers
during each run (median over pairs); and, once, the restart cost: query ``start()`` to the
end of the first batch, B minus A (the sink's coordinator start, register and checks).
The last line sums it up for the project's goals (ratio >= 0.8 at 100k, >= 0.9 at 1M,
added p50 at 100k <= 150 ms, empty batch p50 <= 100 ms).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402

from twophase.testing.job import EVENT_DDL, place_batch, spark_session, write_input  # noqa: E402
from twophase.testing.localpg import LocalPostgres  # noqa: E402

# --------------------------------------------------------------------------- A's task


def _at_least_once_writer(dsn: str, table: str, out_dir: str) -> Callable[..., Any]:
    """A's ``mapInArrow`` function: stream the partition into COPY and one Parquet file."""

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import itertools

        import psycopg
        import pyarrow.parquet as pq
        from psycopg import sql
        from pyspark import TaskContext

        from twophase.sinks.postgres.arrow import csv_chunks

        ctx = TaskContext.get()
        part = ctx.partitionId() if ctx else 0
        report = pa.schema([("rows", pa.int64())])
        it = iter(batches)
        first = next(it, None)
        rows = 0
        if first is not None:
            final = Path(out_dir) / f"part-{uuid.uuid4().hex}-{part:05d}.parquet"
            tmp = final.with_name("." + final.name + ".tmp")
            stmt = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
                sql.Identifier(table),
                sql.SQL(", ").join(sql.Identifier(n) for n in first.schema.names))
            with psycopg.connect(dsn) as conn, conn.cursor() as cur:
                with cur.copy(stmt) as copy, open(tmp, "wb") as raw:
                    writer = pq.ParquetWriter(raw, first.schema)
                    for b in itertools.chain([first], it):  # streamed: nothing held
                        for chunk in csv_chunks(b):
                            copy.write(memoryview(chunk))
                        writer.write_batch(b)
                        rows += b.num_rows
                    writer.close()
                    raw.flush()
                    os.fsync(raw.fileno())
                if rows:
                    os.replace(tmp, final)
                    fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
                    os.fsync(fd)
                    os.close(fd)
                else:
                    tmp.unlink()
                conn.commit()
        yield pa.RecordBatch.from_pylist([{"rows": rows}], schema=report)

    return write


# --------------------------------------------------------------------------- RSS sampler


class WorkerRss:
    """Peak resident memory of this process's Python worker descendants (pyspark.daemon
    and its forks), sampled every 20 ms while armed; other users' Spark is not counted."""

    def __init__(self) -> None:
        self.peak = 0
        self._pids: list[int] = []
        self._armed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _descendants(self) -> list[int]:
        parent: dict[int, int] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    parent[int(d)] = int(fields[1])
                except (OSError, IndexError, ValueError):
                    continue
        me, out = os.getpid(), []
        for pid in parent:
            p, seen = pid, 0
            while p in parent and p != me and seen < 50:
                p, seen = parent[p], seen + 1
            if p == me and pid != me:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read()
                except OSError:
                    continue
                if b"pyspark.daemon" in cmd:  # the daemon and its forked workers
                    out.append(pid)
        return out

    def _loop(self) -> None:
        last_scan = 0.0
        while not self._stop.is_set():
            if not self._armed.wait(0.2):
                continue
            now = time.monotonic()
            if now - last_scan > 0.5:
                self._pids, last_scan = self._descendants(), now
            for pid in self._pids:
                try:
                    with open(f"/proc/{pid}/status") as f:
                        for line in f:
                            if line.startswith("VmRSS:"):
                                self.peak = max(self.peak, int(line.split()[1]) * 1024)
                                break
                except OSError:
                    continue
            time.sleep(0.02)

    def arm(self) -> None:
        self.peak = 0
        self._armed.set()

    def disarm(self) -> int:
        self._armed.clear()
        time.sleep(0.05)
        return self.peak


# --------------------------------------------------------------------------- one run


class Run:
    """One query over one input folder with one writer; batch times from inside
    ``foreachBatch``."""

    def __init__(self) -> None:
        self.times: list[float] = []  # per batch, seconds (warm-up first)
        self.rows: list[int] = []
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.started = 0.0
        self.rss = 0


def run_query(spark: Any, input_dir: str, work: Path, variant: str, dsn: str,
              rss: WorkerRss) -> Run:
    from twophase.driver import TransactionalSink
    from twophase.sinks.files import StagedFileParticipant
    from twophase.sinks.postgres import PostgresParticipant

    tag = uuid.uuid4().hex[:10]
    table, out_dir, ckpt = f"e2e_{variant.lower()}_{tag}", work / f"out-{tag}", work / f"ck-{tag}"
    out_dir.mkdir()
    pg = PostgresParticipant(dsn=dsn, table=table)
    result = Run()
    sink: TransactionalSink | None = None
    if variant == "A":
        from twophase.driver import _arrow_schema

        writer = _at_least_once_writer(dsn, table, str(out_dir))
        checked: list[bool] = []

        def write(df: Any, batch_id: int) -> None:
            t0 = time.perf_counter()
            if not checked:  # the same table as B's participant creates
                pg.check(_arrow_schema(df))
                pg.close()
                checked.append(True)
            rows = df.mapInArrow(writer, "rows long").collect()
            result.rows.append(sum(int(r["rows"]) for r in rows))
            t1 = time.perf_counter()
            result.starts.append(t0)
            result.ends.append(t1)
            result.times.append(t1 - t0)
    else:
        sink = TransactionalSink(
            f"e2e{tag}", [pg, StagedFileParticipant(str(out_dir), "parquet")],
            coordinator=f"sqlite:///{work / f'coord-{tag}.db'}", vote_timeout=120.0,
        )

        def write(df: Any, batch_id: int) -> None:
            t0 = time.perf_counter()
            assert sink is not None
            sink(df, batch_id)
            t1 = time.perf_counter()
            result.rows.append(sink.history[-1].rows)
            result.starts.append(t0)
            result.ends.append(t1)
            result.times.append(t1 - t0)

    rss.arm()
    result.started = time.perf_counter()
    try:
        q = (spark.readStream.schema(EVENT_DDL).option("maxFilesPerTrigger", 1)
             .parquet(input_dir).writeStream.foreachBatch(write)
             .option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start())
        q.awaitTermination()
    finally:
        result.rss = rss.disarm()
        if sink is not None:
            sink.close()
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(ckpt, ignore_errors=True)
        try:
            import psycopg
            from psycopg import sql

            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
        except Exception:  # cleanup only
            pass
    return result


def rate(r: Run) -> float:
    """Rows/s over the measured batches (first measured start to last end)."""
    rows = sum(r.rows[1:])
    return rows / max(1e-9, r.ends[-1] - r.starts[1]) if rows else 0.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[i]


def label(n: int) -> str:
    return "empty" if n == 0 else f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000",
                    help="rows per batch, comma separated; 0 = the empty batch")
    ap.add_argument("--pairs", type=int, default=7, help="A/B pairs per size")
    ap.add_argument("--batches", type=int, default=5, help="measured batches per run")
    ap.add_argument("--empty-batches", type=int, default=10,
                    help="measured empty batches per run of the empty-batch section")
    ap.add_argument("--no-empty", action="store_true", help="skip the empty-batch section")
    ap.add_argument("--dir", default=None, help="work folder (default: a temp folder)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not args.no_empty and 0 not in sizes:
        sizes.append(0)

    work = Path(tempfile.mkdtemp(prefix="twophase-e2e-", dir=args.dir))
    pg = LocalPostgres(fsync=True).start()
    rss = WorkerRss()
    summary: dict[str, float] = {}
    try:
        # A is a plain foreachBatch job: like any PySpark job using pyarrow on the
        # workers, it must name an interpreter that has it (pip-installed PySpark reads
        # only PYSPARK_PYTHON and otherwise runs `python3`; TransactionalSink chooses the
        # driver's own in local mode by itself).
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        spark = spark_session()
        print(f"e2e: Spark {spark.version} local[2], PostgreSQL + Parquet, {args.pairs} pairs, "
              f"{args.batches} measured batches per run, work dir {work}", flush=True)
        restart: dict[str, list[float]] = {"A": [], "B": []}
        warm = work / "in-warmup"
        write_input(str(warm), batches=2, rows_per_batch=1000)
        for v in ("A", "B"):  # JIT, worker start, imports: not charged to the first pair
            run_query(spark, str(warm), work, v, pg.dsn, rss)
        for size in sizes:
            inp = work / f"in-{label(size)}"
            if size:
                write_input(str(inp), batches=args.batches + 1, rows_per_batch=size)
            else:
                write_input(str(inp), batches=1, rows_per_batch=1000)
                empty = pa.table({"id": pa.array([], pa.int64())})
                for i in range(1, args.empty_batches + 1):
                    place_batch(inp, i, empty)
            ratios, added, times = [], [], {"A": [], "B": []}  # type: ignore[var-annotated]
            peaks: dict[str, list[int]] = {"A": [], "B": []}
            for i in range(args.pairs):
                order = ("A", "B") if i % 2 == 0 else ("B", "A")
                runs = {v: run_query(spark, str(inp), work, v, pg.dsn, rss) for v in order}
                for v, r in runs.items():
                    times[v].extend(r.times[1:])
                    peaks[v].append(r.rss)
                    restart[v].append(r.ends[0] - r.started)
                added.extend(b - a for a, b in zip(runs["A"].times[1:], runs["B"].times[1:],
                                                   strict=True))
                if size:
                    ratios.append(rate(runs["B"]) / rate(runs["A"]))
                    print(f"  {label(size)} pair {i + 1}: A {rate(runs['A']):,.0f} rows/s, "
                          f"B {rate(runs['B']):,.0f} rows/s, B/A {ratios[-1]:.2f}", flush=True)
                else:
                    print(f"  empty pair {i + 1}: A p50 "
                          f"{1000 * statistics.median(runs['A'].times[1:]):.0f} ms, B p50 "
                          f"{1000 * statistics.median(runs['B'].times[1:]):.0f} ms", flush=True)
            mb = 1024 * 1024
            a50, b50 = statistics.median(times["A"]), statistics.median(times["B"])
            line = (f"{label(size)}: A batch p50 {1000 * a50:.0f} ms, B batch p50 "
                    f"{1000 * b50:.0f} ms; added p50 {1000 * pct(added, 0.5):.0f} ms, "
                    f"p99 {1000 * pct(added, 0.99):.0f} ms; peak worker RSS A "
                    f"{statistics.median(peaks['A']) / mb:.0f} MB, B "
                    f"{statistics.median(peaks['B']) / mb:.0f} MB")
            if size:
                line = (f"{label(size)}: B/A rows/s per pair "
                        f"[{', '.join(f'{x:.2f}' for x in ratios)}] median "
                        f"{statistics.median(ratios):.2f}\n" + line)
                summary[f"ratio@{label(size)}"] = statistics.median(ratios)
                summary[f"added_p50@{label(size)}"] = 1000 * pct(added, 0.5)
            else:
                summary["empty_batch_p50"] = 1000 * b50
            print(line, flush=True)
        extra = 1000 * (statistics.median(restart["B"]) - statistics.median(restart["A"]))
        print(f"restart: start() to first batch done, B minus A (median over every run): "
              f"{extra:.0f} ms", flush=True)
        spark.stop()
    finally:
        pg.stop()
        shutil.rmtree(work, ignore_errors=True)

    def fmt(key: str, unit: str = "", digits: int = 2) -> str:
        v = summary.get(key)
        return "n/a" if v is None else f"{v:.{digits}f}{unit}"

    print(f"e2e: ratio@100k={fmt('ratio@100k')} ratio@1M={fmt('ratio@1M')} "
          f"added_p50@100k={fmt('added_p50@100k', digits=0)} ms "
          f"empty_batch_p50={fmt('empty_batch_p50', digits=0)} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
