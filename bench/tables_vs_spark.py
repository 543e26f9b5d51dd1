"""The table sinks users would pick instead (issue 32 item 4): Spark's own Delta streaming
sink (``writeStream.format("delta")``) and Iceberg's (``writeStream.format("iceberg")
.toTable(...)``) as A, against ``TransactionalSink`` with only a ``DeltaParticipant`` /
only an ``IcebergParticipant`` as B (the native data path: Spark's Parquet writer writes
the data files, the default for such a sink) and as P (``native=False``: the rows go
through Python, pyarrow writes them), on the same input, side by side in one run.

Spark's connectors are built for Spark 4.1, not for the pyspark of the project's venv,
so this runs in the Spark reader's environment (tests/support/spark_connectors.py) with
twophase's dependencies added to it and twophase from ``PYTHONPATH``. Reproduce (from
the repository root)::

    .venv/bin/python -m tests.support.spark_connectors --bench   # once: jars + venv
    PY=~/.cache/twophase/spark-reader-pyspark4.1.4/bin/python
    PYTHONPATH=$PWD $PY bench/tables_vs_spark.py                 # 5 pairs, 100k and 1M
    PYTHONPATH=$PWD $PY bench/tables_vs_spark.py --quick         # smoke run, ~1 min
    PYTHONPATH=$PWD $PY bench/tables_vs_spark.py --sinks iceberg --variants A,B --phases
                                                    # + each variant's p50 per phase

One Spark session (``local[2]``) with both connectors; the query and the clock are
bench/files_vs_spark.py's: a file source of the reference job's events, one Parquet
file per micro-batch, ``availableNow``, a fresh checkpoint and a fresh table per run,
its first batch (which creates the table) not measured; a batch's time is Spark's own
``triggerExecution``. Delta replays its log in 2 tasks (``snapshotPartitions``, as
the 2 shuffle partitions; its default 50 costs seconds per batch here). Delta: both
sides on a local folder. Iceberg: both sides in one SQL catalog on SQLite over one
warehouse folder (Iceberg's JdbcCatalog for A and pyiceberg's SqlCatalog for B, as
tests/sinks/test_spark_reads_tables.py). Each side
writes with its library's defaults (Spark Delta: Snappy; Iceberg, both: zstd; delta-rs:
its own), one file per input partition, unpartitioned tables. Every table is read back
(delta-rs / pyiceberg) and must hold every id once. The last line:
``tables_vs_spark: delta@100k= ... iceberg@1M=`` (B/A rows/s medians; goal >= 0.95), and
the same for P/A (``delta-python@100k=`` ...).
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

from bench.vs_spark import Batches, check_ids, label, measured, run_rounds  # noqa: E402
from twophase.testing.job import EVENT_DDL, spark_session, write_input  # noqa: E402

CATALOG, NAMESPACE = "lake", "bench"


class Tables:
    """The work folder's Delta tables and the Iceberg catalog both sides share."""

    def __init__(self, work: Path) -> None:
        self.work = work
        (work / "wh").mkdir()
        self.uri = f"sqlite:///{work / 'catalog.db'}"
        self.warehouse = f"file://{work / 'wh'}"
        # pyiceberg makes the catalog's tables and the namespace first; Spark's
        # JdbcCatalog then finds them (the reader test's order)
        self.catalog().create_namespace(NAMESPACE)

    def spark_conf(self, jars: list[str]) -> dict[str, str]:
        c = f"spark.sql.catalog.{CATALOG}"
        return {"spark.jars": ",".join(jars),
                "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension,"
                "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions",
                "spark.sql.catalog.spark_catalog":
                    "org.apache.spark.sql.delta.catalog.DeltaCatalog",
                # Delta's log replay in as many tasks as the shuffle (its default, 50
                # tasks per batch, costs seconds on local[2] and is no fair A)
                "spark.databricks.delta.snapshotPartitions": "2",
                c: "org.apache.iceberg.spark.SparkCatalog", f"{c}.type": "jdbc",
                f"{c}.uri": "jdbc:sqlite:" + self.uri.removeprefix("sqlite:///"),
                f"{c}.warehouse": self.warehouse}

    def props(self) -> dict[str, str]:
        return {"name": CATALOG, "type": "sql", "uri": self.uri, "warehouse": self.warehouse}

    def catalog(self) -> Any:
        from pyiceberg.catalog import load_catalog

        props = self.props()
        return load_catalog(props.pop("name"), **props)

    def ids(self, kind: str, where: str) -> tuple[int, int]:
        """(rows, distinct ids) a reader (delta-rs, pyiceberg) sees in the table."""
        import pyarrow.compute as pc

        if kind == "delta":
            from deltalake import DeltaTable

            table = DeltaTable(where).to_pyarrow_table(columns=["id"])
        else:
            table = self.catalog().load_table(where).scan(selected_fields=("id",)).to_arrow()
        return table.num_rows, len(pc.unique(table["id"]))

    def drop(self, kind: str, where: str) -> None:
        if kind == "delta":
            shutil.rmtree(where, ignore_errors=True)
        else:
            self.catalog().purge_table(where)


def run_query(spark: Any, tables: Tables, input_dir: Path, kind: str,
              variant: str, phases: Any = None, key: str = "") -> Batches:
    """One query into a new table; (rows, seconds) per batch from Spark's progress."""
    from twophase import TransactionalSink
    from twophase.sinks.delta import DeltaParticipant
    from twophase.sinks.iceberg import IcebergParticipant

    tag = uuid.uuid4().hex[:10]
    ckpt = tables.work / f"ck-{tag}"
    where = (str(tables.work / f"delta-{tag}") if kind == "delta"
             else f"{NAMESPACE}.t_{variant.lower()}_{tag}")
    stream = (spark.readStream.schema(EVENT_DDL).option("maxFilesPerTrigger", 1)
              .parquet(str(input_dir)))
    sink: TransactionalSink | None = None
    if phases is not None:
        phases.variant(variant)
    if variant != "A":
        native = False if variant == "P" else None
        part = (DeltaParticipant(where, name="dl", native=native) if kind == "delta"
                else IcebergParticipant(where, tables.props(), name="ice", native=native))
        sink = TransactionalSink(f"tvs{tag}", [part],
                                 coordinator=f"sqlite:///{tables.work / f'coord-{tag}.db'}",
                                 on_batch=phases.on_batch if phases is not None else None)
        writer = stream.writeStream.foreachBatch(sink)
    else:
        writer = stream.writeStream.format(kind).outputMode("append")
    writer = writer.option("checkpointLocation", str(ckpt)).trigger(availableNow=True)
    try:
        if variant != "A":
            q = writer.start()
        elif kind == "delta":
            q = writer.start(where)
        else:
            q = writer.toTable(f"{CATALOG}.{where}")
        q.awaitTermination()
        if q.exception() is not None:
            raise SystemExit(f"{kind} {variant}: the query failed: {q.exception()}")
        batches = measured(q)
        if phases is not None:
            phases.take(key, q, spark, variant)
        check_ids(f"{kind} {variant}", batches, *tables.ids(kind, where))
        return batches
    finally:
        if sink is not None:
            sink.close()
        tables.drop(kind, where)
        shutil.rmtree(ckpt, ignore_errors=True)


def _jars() -> list[str]:
    from tests.support.spark_connectors import connector_jars

    return [str(j) for j in connector_jars()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100000,1000000", help="rows per batch, comma-separated")
    ap.add_argument("--pairs", type=int, default=5,
                    help="rounds of A, B and P, in rotating order (default 5)")
    ap.add_argument("--batches", type=int, default=5, help="measured batches per run")
    ap.add_argument("--sinks", default="delta,iceberg", help="delta, iceberg or both")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 10k rows, 1 pair, 2 batches")
    ap.add_argument("--dir", help="work folder (default: a temporary one)")
    ap.add_argument("--variants", default="A,B,P",
                    help="which of A, B and P run (A always; default all three); with "
                    "--phases also B2: B with PHASES_B2_OPTIONS=k=v,... as write options")
    ap.add_argument("--phases", action="store_true",
                    help="print each variant's p50 per phase (bench/iceberg_phases.py)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.pairs, args.batches = "10000", 1, 2
    sizes = [int(s) for s in args.sizes.split(",") if s]
    variants = ("A", *(v for v in ("B", "P", "B2") if v in args.variants.split(",")))
    kinds = [k for k in args.sinks.split(",") if k]
    if not set(kinds) <= {"delta", "iceberg"}:
        ap.error(f"--sinks: delta and/or iceberg, got {args.sinks!r}")
    import pyspark

    if not pyspark.__version__.startswith("4.1."):
        raise SystemExit(
            f"pyspark {pyspark.__version__}: Spark's Delta and Iceberg connectors are built "
            "for Spark 4.1. Fix: run with the interpreter of `python -m "
            "tests.support.spark_connectors --bench` (see this script's --help)")

    work = Path(tempfile.mkdtemp(prefix="twophase-tvs-", dir=args.dir))
    tables = Tables(work)
    spark = spark_session(tables.spark_conf(_jars()))
    phases = None
    if args.phases:
        from bench.iceberg_phases import Phases

        phases = Phases()
    print(f"tables_vs_spark: Spark {spark.version} local[2], {args.pairs} pairs, "
          f"{args.batches} measured batches per run, load {os.getloadavg()[0]:.1f}, "
          f"work dir {work}", flush=True)
    summary: dict[str, float] = {}
    try:
        warm = work / "in-warm"
        write_input(warm, batches=2, rows_per_batch=1000)
        for kind in kinds:  # JIT, the workers, imports: not charged to the first pair
            for v in variants:
                run_query(spark, tables, warm, kind, v)
        for size in sizes:
            input_dir = work / f"in-{size}"
            write_input(input_dir, batches=args.batches + 1, rows_per_batch=size)
            for kind in kinds:
                key = f"{kind}@{label(size)}"
                def one(v: str, d: Path = input_dir, k: str = kind,
                        key: str = key) -> Batches:
                    return run_query(spark, tables, d, k, v, phases, key)

                medians = run_rounds(key, args.pairs, one, variants)
                if "B" in medians:
                    summary[key] = medians["B"]
                if "P" in medians:
                    summary[f"{kind}-python@{label(size)}"] = medians["P"]
            shutil.rmtree(input_dir, ignore_errors=True)
        if phases is not None:
            phases.print()
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"tables_vs_spark: load {os.getloadavg()[0]:.1f}; "
          + " ".join(f"{k}={v:.2f}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
