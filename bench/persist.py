"""The persist policy measured: a sink of PostgreSQL + Parquet files (``bench/e2e.py``'s
default), its files participant on each path, side by side in one run.

Reproduce (from the repository root, in the README's venv)::

    .venv/bin/python bench/persist.py                          # 3 rounds, 10k/100k/1M
    .venv/bin/python bench/persist.py --rounds 2 --sizes 10000 --batches 3   # quick look

Variants, each a new query over the same input (``bench/e2e.py``'s ``run_query``: a
private PostgreSQL with fsync on, local[2], one Parquet file per micro-batch, the first
batch a warm-up, ``--batches`` measured):

- ``A``: at-least-once ``foreachBatch`` (COPY + one pyarrow Parquet file per task);
- ``P``: ``TransactionalSink``, files on the Python path (``native=False``; the rows of
  both participants stream through one Python task per partition);
- ``N``: files on the native path beside the Python job (``native=True``), the split
  batch persisted ``MEMORY_AND_DISK`` for the two consumers (the persist policy);
- ``R``: as ``N`` but not persisted (``PrepareJob.persist = False``): the Python job
  and Spark's writer each compute the batch from the source.

``--costly-plan``: the batch both sides get is filtered by a SHA-512 of each row that
keeps every row (``COSTLY``), a plan whose recomputation costs CPU, as a user's
transformations before the sink would; without it the batch is the file read as is.

Each round runs the four in a rotated order (A,P,N,R then P,N,R,A ...). Printed per
size: rows/s per run, each sink's ratio to A per round and its median, N/P and N/R, and
the p50 batch time per variant. The load average is printed with each size.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.e2e import Run, Setup, label, rate, run_query  # noqa: E402
from bench.rss import WorkerRss  # noqa: E402
from twophase.testing.job import spark_session, write_input  # noqa: E402
from twophase.testing.localpg import LocalPostgres  # noqa: E402

VARIANTS = {
    "A": "at-least-once foreachBatch",
    "P": "files on the Python path",
    "N": "files native, batch persisted",
    "R": "files native, batch recomputed",
}

COSTLY = "sha2(concat_ws('|', id, customer, amount, ts), 512) <> ''"
"""True for every row; Spark evaluates the hash per row (one consumer or each)."""


def _setup(base: Setup, v: str) -> Setup:
    if v == "P":
        return dataclasses.replace(base, files_native=False)
    if v == "N":
        return dataclasses.replace(base, files_native=True, persist=None)
    if v == "R":
        return dataclasses.replace(base, files_native=True, persist=False)
    return base


def _phase(runs: list[Run], key: str) -> float:
    """p50 (ms) of one phase the sink measured (``BatchReport.phases``), warm-ups left out."""
    return 1000 * statistics.median(ph.get(key, 0.0) for r in runs for ph in r.phases[1:])


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.1f} {five:.1f} {fifteen:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000", help="rows per batch")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (A,P,N,R rotated) per size")
    ap.add_argument("--batches", type=int, default=3, help="measured batches per run")
    ap.add_argument("--variants", default="APNR", help="which of A, P, N, R to run")
    ap.add_argument("--costly-plan", action="store_true",
                    help=f"both sides get the batch filtered by {COSTLY!r} (all rows kept)")
    ap.add_argument("--dir", default=None, help="work folder (default: a temp folder)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    variants = [v for v in args.variants if v in VARIANTS]

    work = Path(tempfile.mkdtemp(prefix="twophase-persist-", dir=args.dir))
    pg = LocalPostgres(fsync=True).start()
    summary: dict[str, float] = {}
    try:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        spark = spark_session()
        base = Setup(spark, work, pg.dsn, WorkerRss(),
                     where=COSTLY if args.costly_plan else None)
        plan = "a costly plan (SHA-512 filter)" if args.costly_plan else "the file as read"
        print(f"persist: Spark {spark.version} local[2], PostgreSQL + Parquet, {plan}, "
              f"{args.rounds} rounds of {''.join(variants)}, {args.batches} measured "
              f"batches per run, {_load()}", flush=True)
        warm = work / "in-warmup"
        write_input(str(warm), batches=2, rows_per_batch=1000)
        for v in variants:
            run_query(_setup(base, v), str(warm), v)
        for size in sizes:
            inp = work / f"in-{label(size)}"
            write_input(str(inp), batches=args.batches + 1, rows_per_batch=size)
            runs: dict[str, list[Run]] = {v: [] for v in variants}
            print(f"{label(size)}: {_load()}", flush=True)
            for i in range(args.rounds):
                order = variants[i % len(variants):] + variants[:i % len(variants)]
                got = {v: run_query(_setup(base, v), str(inp), v) for v in order}
                for v, r in got.items():
                    if sum(r.rows[1:]) != size * args.batches:
                        raise RuntimeError(f"{v} wrote {sum(r.rows[1:])} rows, expected "
                                           f"{size * args.batches}")
                    runs[v].append(r)
                print(f"  {label(size)} round {i + 1} ({''.join(order)}): " + ", ".join(
                    f"{v} {rate(got[v]):,.0f} rows/s" for v in variants)
                    + f"; {_load()}", flush=True)
            med = {v: statistics.median(rate(r) for r in runs[v]) for v in variants}
            p50 = {v: statistics.median(t for r in runs[v] for t in r.times[1:])
                   for v in variants}
            print(f"{label(size)}: batch p50 " + ", ".join(
                f"{v} {1000 * p50[v]:.0f} ms" for v in variants), flush=True)
            print(f"{label(size)}: the sink's job p50 [its longest outcome: a Python task, "
                  "or N's and R's native write] " + ", ".join(
                      f"{v} {_phase(runs[v], 'job_s'):.0f} [{_phase(runs[v], 'task_s'):.0f}]"
                      " ms" for v in variants if v != "A"), flush=True)
            for x, y in (("P", "A"), ("N", "A"), ("R", "A"), ("N", "P"), ("N", "R")):
                if x in runs and y in runs:
                    rs = [rate(a) / rate(b) for a, b in zip(runs[x], runs[y], strict=True)]
                    summary[f"{x}/{y}@{label(size)}"] = statistics.median(rs)
                    print(f"{label(size)}: {x}/{y} per round "
                          f"[{', '.join(f'{r:.2f}' for r in rs)}] median "
                          f"{statistics.median(rs):.2f} (medians of rows/s: "
                          f"{med[x] / med[y]:.2f})", flush=True)
        spark.stop()
    finally:
        pg.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("persist: " + " ".join(f"{k}={v:.2f}" for k, v in summary.items())
          + f" ({_load()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
