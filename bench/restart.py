"""What a crash costs at restart: the driver SIGKILLed mid-batch, then the time from the new
driver's start to its first committed batch, at-least-once (A) against TransactionalSink
(B), side by side in one run.

Reproduce (from the repository root, in the README's venv)::

    .venv/bin/python bench/restart.py                     # 3 pairs, 100k rows per batch
    .venv/bin/python bench/restart.py --pairs 5 --rows 10000 --kill-after 0.05

Each run is a real user job in its own process, run as a user runs it (this file with
``--job``, the venv's plain interpreter; no PYSPARK_PYTHON for B, A names it as a plain
PySpark job using pyarrow must): a file source (one Parquet
file per micro-batch) into PostgreSQL + Parquet files, ``local[2]``. A writes at-least-once
from ``foreachBatch`` (``mapInArrow``: COPY + one Parquet file per task, as bench/e2e.py's
A); B through ``TransactionalSink`` with ``PostgresParticipant`` and
``StagedFileParticipant`` and an embedded SQLite coordinator (its file beside the
checkpoint: the coordinator dies with the driver, as in a user's job).

Per run: the job is started, and once batch 1 has begun (the job writes a mark when its
foreachBatch function is entered) and ``--kill-after`` seconds have passed, its whole
process group is SIGKILLed (the driver's Python, its JVM and the Python workers). Then the
same job is started again on the same checkpoint (and the same coordinator file) and timed
from ``Popen`` to the end of its first batch (the mark written when foreachBatch returns):
Spark's start, the checkpoint's replay of batch 1 and, for B, the sink's start and the
recovery of what the killed attempt left (prepared branches, an open attempt). The job
then runs to its end and the rows are counted: B must hold every id once; A's duplicates
are counted and printed (the reason for B).

Pairs alternate (A,B then B,A ...). Printed: per run the restart time and what B's first
batch was (``committed``: the killed attempt had not voted, it was aborted and redone;
``recovered``: an in-doubt attempt was finished), per side the median, and the last line
``restart: added_p50= ms`` (B minus A, pair by pair, median). Issue 24's goal: <= 1 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


# --------------------------------------------------------------------------- the job


def _mark(marks: Path, **fields: Any) -> None:
    """One JSON line, flushed at once: the parent reads it while this process runs."""
    with open(marks, "a") as f:
        f.write(json.dumps({"t": time.time(), **fields}) + "\n")
        f.flush()


def job(args: argparse.Namespace) -> int:
    """The user's job: A or B over ``--input`` into ``--table`` and ``--out``."""
    from e2e import _at_least_once_writer

    from twophase import TransactionalSink
    from twophase.sinks.files import StagedFileParticipant
    from twophase.sinks.postgres import PostgresParticipant
    from twophase.spark.session import arrow_schema as _arrow_schema
    from twophase.testing.job import EVENT_DDL, spark_session

    marks = Path(args.marks)
    spark = spark_session()
    pg = PostgresParticipant(dsn=args.dsn, table=args.table)
    sink: TransactionalSink | None = None
    if args.job == "A":
        writer = _at_least_once_writer(args.dsn, args.table, args.out, None)

        def write(df: Any, batch_id: int) -> tuple[str, dict[str, float]]:
            pg.check(_arrow_schema(df))  # the table B's participant would create
            df.mapInArrow(writer, "rows long, task_s double").collect()
            return "written", {}
    else:
        sink = TransactionalSink(
            args.sink, [pg, StagedFileParticipant(args.out, "parquet")],
            coordinator=f"sqlite:///{args.coordinator}", vote_timeout=120.0,
        )

        def write(df: Any, batch_id: int) -> tuple[str, dict[str, float]]:
            assert sink is not None
            sink(df, batch_id)
            return sink.history[-1].outcome, dict(sink.history[-1].phases)

    def timed(df: Any, batch_id: int) -> None:
        _mark(marks, event="start", batch=batch_id)
        outcome, phases = write(df, batch_id)
        _mark(marks, event="done", batch=batch_id, outcome=outcome, phases=phases)

    q = (spark.readStream.schema(EVENT_DDL).option("maxFilesPerTrigger", 1)
         .parquet(args.input).writeStream.foreachBatch(timed)
         .option("checkpointLocation", args.checkpoint).trigger(availableNow=True).start())
    try:
        q.awaitTermination()
    finally:
        if sink is not None:
            sink.close()
        spark.stop()
    return 0


# --------------------------------------------------------------------------- the runs


def _events(marks: Path) -> list[dict[str, Any]]:
    if not marks.exists():
        return []
    out = []
    for line in marks.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            out.append(json.loads(line))
    return out


def _start(variant: str, run: dict[str, str]) -> subprocess.Popen[bytes]:
    """The job as a user starts it: the venv's interpreter, this file; no PYSPARK_PYTHON
    for B (the sink chooses the workers' interpreter); A, a plain job using pyarrow on the
    workers, must name one, as any such PySpark job must."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")
           and not k.startswith("TWOPHASE_")}
    if variant == "A":
        env["PYSPARK_PYTHON"] = sys.executable
    cmd = [sys.executable, str(Path(__file__).resolve()), "--job", variant]
    for k, v in run.items():
        cmd += [f"--{k}", v]
    with open(Path(run["marks"]).with_suffix(".log"), "ab") as log:  # the child keeps it
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)


def _wait(proc: subprocess.Popen[bytes], marks: Path, until: Any, timeout: float) -> dict[str, Any]:
    """The first mark for which ``until`` holds (bounded; the job's death is an error)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in _events(marks):
            if until(e):
                return e
        if proc.poll() is not None:
            for e in _events(marks):  # it may have ended right after writing the mark
                if until(e):
                    return e
            tail = Path(marks).with_suffix(".log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the job ended (exit {proc.returncode}) first:\n{tail}")
        time.sleep(0.01)
    raise TimeoutError(f"no such mark within {timeout:.0f} s in {marks}")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def one_run(variant: str, work: Path, dsn: str, input_dir: Path, kill_after: float,
            timeout: float) -> tuple[float, float, str, int, int, dict[str, float]]:
    """Kill mid-batch 1, restart; returns (restart s, of which before foreachBatch was
    first called, the first batch's outcome, rows, distinct ids, B's phases)."""
    import psycopg
    from psycopg import sql

    tag = uuid.uuid4().hex[:10]
    run = {
        "input": str(input_dir), "dsn": dsn, "table": f"rst_{variant.lower()}_{tag}",
        "out": str(work / f"out-{tag}"), "checkpoint": str(work / f"ck-{tag}"),
        "coordinator": str(work / f"coord-{tag}.db"), "sink": f"rst{tag}",
        "marks": str(work / f"marks-{tag}-1.jsonl"),
    }
    Path(run["out"]).mkdir()
    first = _start(variant, run)
    try:
        _wait(first, Path(run["marks"]), lambda e: e["event"] == "start" and e["batch"] == 1,
              timeout)
        time.sleep(kill_after)
    finally:
        _kill(first)
    run["marks"] = str(work / f"marks-{tag}-2.jsonl")
    t0 = time.time()
    second = _start(variant, run)
    try:
        done = _wait(second, Path(run["marks"]), lambda e: e["event"] == "done", timeout)
        began = next(e for e in _events(Path(run["marks"])) if e["event"] == "start")
        second.wait(timeout)
        if second.returncode != 0:
            raise RuntimeError(f"the restarted job failed (exit {second.returncode}); "
                               f"see {Path(run['marks']).with_suffix('.log')}")
    finally:
        _kill(second)
    with psycopg.connect(dsn, autocommit=True) as conn:
        t = sql.Identifier(run["table"])
        rows, distinct = conn.execute(
            sql.SQL("SELECT count(*), count(DISTINCT id) FROM {}").format(t)).fetchone() or (0, 0)
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(t))
    for k in ("out", "checkpoint"):
        shutil.rmtree(run[k], ignore_errors=True)
    return (done["t"] - t0, began["t"] - t0, str(done.get("outcome", "")), int(rows),
            int(distinct), done.get("phases") or {})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="A,B pairs, alternating (default 3)")
    ap.add_argument("--rows", type=int, default=100_000, help="rows per batch (default 100k)")
    ap.add_argument("--batches", type=int, default=3, help="input files = batches (>= 2)")
    ap.add_argument("--kill-after", type=float, default=0.1,
                    help="seconds after batch 1 began to SIGKILL the job (default 0.1)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per wait, seconds")
    ap.add_argument("--dir", help="work folder (default: a temporary one)")
    ap.add_argument("--job", choices=["A", "B"], help=argparse.SUPPRESS)
    for k in ("input", "dsn", "table", "out", "checkpoint", "coordinator", "sink", "marks"):
        ap.add_argument(f"--{k}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        return job(args)
    if args.batches < 2:
        ap.error("--batches must be at least 2: batch 1 is the one killed")

    from twophase.testing.job import write_input
    from twophase.testing.localpg import LocalPostgres

    work = Path(tempfile.mkdtemp(prefix="twophase-restart-", dir=args.dir))
    print(f"restart: {args.pairs} pairs, {args.rows:,} rows per batch, {args.batches} batches, "
          f"SIGKILL {args.kill_after:.2f} s into batch 1, load {os.getloadavg()[0]:.1f}, "
          f"work dir {work}", flush=True)
    pg = LocalPostgres().start()
    try:
        input_dir = work / "in"
        write_input(input_dir, batches=args.batches, rows_per_batch=args.rows)
        total = args.batches * args.rows
        times: dict[str, list[float]] = {"A": [], "B": []}
        for i in range(args.pairs):
            for v in ("A", "B") if i % 2 == 0 else ("B", "A"):
                s, spark_s, outcome, rows, distinct, phases = one_run(v, work, pg.dsn, input_dir,
                                                     args.kill_after, args.timeout)
                if distinct != total:
                    raise SystemExit(f"{v}: {distinct} distinct ids of {total}: rows lost")
                if v == "B" and rows != total:
                    raise SystemExit(f"B: {rows} rows for {total} ids: not exactly once")
                times[v].append(s)
                print(f"  pair {i + 1} {v}: restart -> first batch {s * 1000:,.0f} ms "
                      f"(to its foreachBatch {spark_s * 1000:,.0f} ms, the batch "
                      f"{(s - spark_s) * 1000:,.0f} ms"
                      + (f", {outcome}" if v == "B" else "") + ")"
                      + ("; B's phases (ms) " + ", ".join(
                          f"{k.removesuffix('_s')} {x * 1000:.0f}" for k, x in phases.items()
                          if x >= 0.0005) if phases else "")
                      + f"; {rows:,} rows, {rows - distinct:,} duplicates", flush=True)
        added = [b - a for a, b in zip(times["A"], times["B"], strict=True)]
        print(f"restart: A p50 {statistics.median(times['A']) * 1000:,.0f} ms, "
              f"B p50 {statistics.median(times['B']) * 1000:,.0f} ms; B minus A per pair "
              f"[{', '.join(f'{x * 1000:.0f}' for x in added)}] ms, load "
              f"{os.getloadavg()[0]:.1f}")
        print(f"restart: added_p50={statistics.median(added) * 1000:.0f} ms")
    finally:
        pg.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
