"""A baseline users know: Spark's own exactly-once file sink (``writeStream.format("parquet")``
with its ``_spark_metadata`` log, A) against ``TransactionalSink`` with one
``StagedFileParticipant`` (Parquet, B), on the same input, side by side in one run.

Reproduce (from the repository root, in the README's venv)::

    .venv/bin/python bench/files_vs_spark.py                  # 5 pairs, 100k and 1M rows
    .venv/bin/python bench/files_vs_spark.py --sizes 10000 --pairs 2 --batches 3

One Spark session (``local[2]``, as bench/e2e.py), no PYSPARK_PYTHON (A runs no Python on
the workers; B's sink chooses the interpreter itself). The query: a file source of the
reference job's events, one Parquet file per micro-batch (``maxFilesPerTrigger=1``,
``availableNow``); each run is a new query on a fresh checkpoint and a fresh output
folder; its first batch warms up and is not measured. B's coordinator is embedded
(SQLite, in the work folder). Both sides write Snappy Parquet, one file per input
partition (no shuffle on either side).

A batch's time is Spark's own ``triggerExecution`` from the query's progress (the same
clock on both sides: planning, the write, the commit to the sink's log or the
coordinator, the checkpoint). Printed per size: rows/s ratio B/A per pair and its median,
batch p50 of each side; the output is read back (pyarrow, which skips ``_spark_metadata``
and ``_twophase_staging``) and must hold every id once on both sides. The last line:
``files_vs_spark: ratio@100k= ratio@1M=``. Issue 24's goal: >= 1.0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.vs_spark import Batches, check_ids, label, measured, run_pairs  # noqa: E402
from twophase.testing.job import EVENT_DDL, spark_session, write_input  # noqa: E402


def _ids(out: Path) -> tuple[int, int]:
    """(rows, distinct ids) of the Parquet files a reader sees in ``out``."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    table = ds.dataset(str(out), format="parquet").to_table(columns=["id"])
    return table.num_rows, len(pc.unique(table["id"]))


def run_query(spark: Any, work: Path, input_dir: Path, variant: str) -> Batches:
    """One query; (rows, seconds) per batch from Spark's progress, warm-up first."""
    from twophase import TransactionalSink
    from twophase.sinks.files import StagedFileParticipant

    tag = uuid.uuid4().hex[:10]
    out, ckpt = work / f"out-{tag}", work / f"ck-{tag}"
    out.mkdir()
    stream = (spark.readStream.schema(EVENT_DDL).option("maxFilesPerTrigger", 1)
              .parquet(str(input_dir)))
    sink: TransactionalSink | None = None
    if variant == "A":
        writer = stream.writeStream.format("parquet").option("path", str(out))
    else:
        sink = TransactionalSink(f"fvs{tag}", [StagedFileParticipant(str(out), "parquet")],
                                 coordinator=f"sqlite:///{work / f'coord-{tag}.db'}")
        writer = stream.writeStream.foreachBatch(sink)
    try:
        q = (writer.option("checkpointLocation", str(ckpt)).trigger(availableNow=True)
             .start())
        q.awaitTermination()
        batches = measured(q)
        check_ids(variant, batches, *_ids(out))
        return batches
    finally:
        if sink is not None:
            sink.close()
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(ckpt, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100000,1000000", help="rows per batch, comma-separated")
    ap.add_argument("--pairs", type=int, default=5, help="A,B pairs, alternating (default 5)")
    ap.add_argument("--batches", type=int, default=5, help="measured batches per run")
    ap.add_argument("--dir", help="work folder (default: a temporary one)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]

    work = Path(tempfile.mkdtemp(prefix="twophase-fvs-", dir=args.dir))
    spark = spark_session()
    print(f"files_vs_spark: Spark {spark.version} local[2], Parquet, {args.pairs} pairs, "
          f"{args.batches} measured batches per run, load {os.getloadavg()[0]:.1f}, "
          f"work dir {work}", flush=True)
    summary: dict[str, float] = {}
    try:
        warm = work / "in-warm"
        write_input(warm, batches=2, rows_per_batch=1000)
        for v in ("A", "B"):  # JIT, the workers, imports: not charged to the first pair
            run_query(spark, work, warm, v)
        for size in sizes:
            input_dir = work / f"in-{size}"
            write_input(input_dir, batches=args.batches + 1, rows_per_batch=size)
            summary[label(size)] = run_pairs(
                label(size), args.pairs, lambda v, d=input_dir: run_query(spark, work, d, v))
            shutil.rmtree(input_dir, ignore_errors=True)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"files_vs_spark: load {os.getloadavg()[0]:.1f}; "
          + " ".join(f"ratio@{k}={v:.2f}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
