"""The two front doors on the same query: at-least-once ``foreachBatch`` (A),
``foreachBatch(TransactionalSink)`` (B) and ``writeStream.format("twophase")`` (D), each
into PostgreSQL and Parquet files, in rotating order (A,B,D then D,B,A ...).

Reproduce (from the repository root, in the README's venv)::

    .venv/bin/python bench/door.py --sizes 100000 --rounds 3 --batches 3

A private PostgreSQL (fsync on) and one Spark session (local[2]) are started here. Each
run is a new query on fresh checkpoint, table and folder over one Parquet file per batch
(``availableNow``); its first batch warms up, the next ``--batches`` are timed by Spark's
own progress (``durationMs.triggerExecution``: the batch end to end, the door's commit
included). Printed per size: rows/s per variant and round, the medians, and D/B and
B/A; the load average before and after. The machine may be shared: say so beside any
figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.e2e import _at_least_once_writer  # noqa: E402
from twophase.testing.job import EVENT_DDL, spark_session, write_input  # noqa: E402
from twophase.testing.localpg import LocalPostgres  # noqa: E402


def run(spark: Any, dsn: str, work: Path, input_dir: Path, variant: str, batches: int) -> float:
    """One query; rows per second over its timed batches."""
    import twophase
    from twophase import TransactionalSink
    from twophase.sinks.files import StagedFileParticipant
    from twophase.sinks.postgres import PostgresParticipant
    from twophase.spark.session import arrow_schema

    tag = uuid.uuid4().hex[:8]
    table, out = f"door_{variant.lower()}_{tag}", work / f"out-{tag}"
    out.mkdir()
    pg = PostgresParticipant(dsn=dsn, table=table)
    stream = (spark.readStream.schema(EVENT_DDL).option("maxFilesPerTrigger", 1)
              .parquet(str(input_dir)))
    sink = None
    if variant == "A":
        writer = _at_least_once_writer(dsn, table, str(out), None)

        checked: list[bool] = []

        def at_least_once(df: Any, batch_id: int) -> None:
            if not checked:  # the table the participants would create
                pg.check(arrow_schema(df))
                checked.append(True)
            df.mapInArrow(writer, "rows long, task_s double").collect()

        w = stream.writeStream.foreachBatch(at_least_once)
    else:  # D's bound: Spark reads one input file as up to 3 splits (1M rows)
        sink = TransactionalSink(f"door{tag}", [pg, StagedFileParticipant(str(out))],
                                 coordinator=f"sqlite:///{work / f'c-{tag}.db'}",
                                 vote_timeout=120.0, partitions=4 if variant == "D" else None)
        if variant == "B":
            w = stream.writeStream.foreachBatch(sink)
        else:
            twophase.register(spark, sink)
            w = stream.writeStream.format("twophase").option("sink", sink.name)
    q = w.option("checkpointLocation", str(work / f"ck-{tag}")).trigger(availableNow=True).start()
    q.awaitTermination()
    if sink is not None:
        sink.close()
    timed = [p for p in q.recentProgress if p["numInputRows"]][1:1 + batches]
    return sum(p["numInputRows"] for p in timed) / sum(
        p["durationMs"]["triggerExecution"] / 1000 for p in timed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=3)
    args = ap.parse_args()
    print("load before:", os.getloadavg(), flush=True)
    work = Path(tempfile.mkdtemp(prefix="door-bench-"))
    pg = LocalPostgres(fsync=True)
    pg.start()
    # A's mapInArrow runs Spark's worker Python, which without PYSPARK_PYTHON is the
    # PATH's python3 (the sinks choose the driver's; A has no sink): the same for all
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = spark_session({"spark.sql.execution.arrow.maxRecordsPerBatch": "10000"})
    try:
        for size in map(int, args.sizes.split(",")):
            input_dir = work / f"in-{size}"
            write_input(input_dir, args.batches + 1, size)
            got: dict[str, list[float]] = {"A": [], "B": [], "D": []}
            for r in range(args.rounds):
                order = "ABD" if r % 2 == 0 else "DBA"
                for v in order:
                    got[v].append(run(spark, pg.dsn, work, input_dir, v, args.batches))
                print(f"{size} rows/batch round {r + 1} ({order}):",
                      {v: round(x[-1]) for v, x in got.items()}, flush=True)
            med = {v: statistics.median(x) for v, x in got.items()}
            print(f"{size} rows/batch medians rows/s:", {v: round(m) for v, m in med.items()},
                  f"D/B={med['D'] / med['B']:.3f} B/A={med['B'] / med['A']:.3f}", flush=True)
    finally:
        spark.stop()
        pg.stop()
    print("load after:", os.getloadavg(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
