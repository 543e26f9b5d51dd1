"""Child process for the S3 native path's tests: a driver of its own (Spark local[2] with
Hadoop's S3A jars) that writes batches into an ``s3://`` files participant whose
``prepare`` refuses rows (so a row handed to Python fails the batch), arming a failpoint
before a chosen batch so that it can be SIGKILLed there.

Usage: ``python -m tests.support.s3native_job JOB.json``; JOB holds ``url``,
``storage_options``, ``coordinator``, ``jars``, ``batches`` (``[batch id, rows]`` each)
and optionally ``arm`` (``[batch id, failpoint spec]``). Prints one JSON line per batch:
its outcome, rows and partitions, then ``{"native": ...}`` (the path taken).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from twophase.participant import BranchRef, Handle
from twophase.sinks.s3 import S3StagedFileParticipant

SINK, LINEAGE = "nat", "lin-1"
QUERY = ("SELECT id, CAST(id AS STRING) AS name, timestamp_seconds(id) AS ts, "
         "CAST(id AS DECIMAL(10, 2)) AS amount, array(id, id) AS pair "
         "FROM range({lo}, {hi}, 1, 3)")


def batch_df(spark: Any, batch: int, rows: int) -> Any:
    """Batch ``batch``'s rows: ``rows`` ids from ``batch * 1000`` (3 input partitions; an
    odd batch shuffled)."""
    df = spark.sql(QUERY.format(lo=batch * 1000, hi=batch * 1000 + rows))
    return df.repartition(3, "id") if batch % 2 else df


class NoPythonRows(S3StagedFileParticipant):
    """An S3 files participant whose rows must never reach Python."""

    def prepare(self, branch: BranchRef, schema: pa.Schema,
                batches: Iterable[pa.RecordBatch]) -> Handle:
        raise AssertionError("the native path handed rows to Python")


def main() -> int:
    from pyspark.sql import SparkSession

    from twophase import TransactionalSink, failpoints

    with open(sys.argv[1]) as f:
        job: dict[str, Any] = json.load(f)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    spark = (SparkSession.builder.master("local[2]").appName("twophase-s3native")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.driver.memory", "1g")
             .config("spark.jars", ",".join(job["jars"]))
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    part = NoPythonRows(job["url"], name="files-out", storage_options=job["storage_options"])
    sink = TransactionalSink(SINK, [part], job["coordinator"], lineage=LINEAGE,
                             preflight=False, vote_timeout=60.0)
    print(json.dumps({"native": [p.name for p in sink._engine.job.native]}), flush=True)
    arm = job.get("arm") or [None, ""]
    try:
        for batch, rows in job["batches"]:
            if batch == arm[0]:
                failpoints.reload(arm[1])
            sink(batch_df(spark, batch, rows), batch)
            r = sink.history[-1]
            print(json.dumps([r.outcome, r.rows, r.partitions]), flush=True)
    finally:
        sink.close()
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
