"""Reads the tables twophase wrote with Spark's own Delta and Iceberg connectors: run by
``tests.support.spark_connectors.spark_read`` as its own process, in the reader's virtual
environment (pyspark only; neither twophase nor the tests are importable here).

argv[1] is a JSON spec: ``jars``, and ``delta`` and/or ``iceberg`` (see below; each
with ``filters``, SQL conditions whose scans are reported: files read, the plan). Prints
one JSON line with what Spark read; the test compares it with delta-rs, pyiceberg and
DuckDB. Spark's log goes to stderr."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F


def session(spec: dict[str, Any]) -> SparkSession:
    b = (SparkSession.builder.master("local[1]").appName("twophase-spark-reader")
         .config("spark.jars", ",".join(spec["jars"]))
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "1")
         .config("spark.default.parallelism", "1")
         .config("spark.sql.adaptive.enabled", "false")  # the scan's metrics in the plan
         .config("spark.sql.session.timeZone", "UTC")
         .config("spark.databricks.delta.snapshotPartitions", "1")  # a small log: 1 task
         .config("spark.sql.extensions",
                 "io.delta.sql.DeltaSparkSessionExtension,"
                 "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions")
         .config("spark.sql.catalog.spark_catalog",
                 "org.apache.spark.sql.delta.catalog.DeltaCatalog"))
    ice = spec.get("iceberg")
    if ice:
        # the same catalog pyiceberg's SQL catalog keeps in SQLite, through Iceberg's
        # JdbcCatalog (one schema: the catalog's name column says whose tables they are)
        c = f"spark.sql.catalog.{ice['catalog']}"
        b = (b.config(c, "org.apache.iceberg.spark.SparkCatalog")
             .config(f"{c}.type", "jdbc").config(f"{c}.uri", ice["uri"])
             .config(f"{c}.warehouse", ice["warehouse"]))
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def rows(df: DataFrame) -> list[list[Any]]:
    """Every row, timestamps as UTC text to the microsecond, ordered by id."""
    cols = [F.date_format(c, "yyyy-MM-dd HH:mm:ss.SSSSSS").alias(c) if t == "timestamp"
            else F.col(c) for c, t in df.dtypes]
    return [list(r) for r in df.select(cols).orderBy("id").collect()]


def scan(df: DataFrame) -> dict[str, Any]:
    """Run the query; its scan node's metrics (files read, skipped) and its plan text."""
    df.collect()
    qe = df._jdf.queryExecution()
    leaves = qe.executedPlan().collectLeaves()
    metrics: dict[str, int] = {}
    for i in range(leaves.size()):
        it = leaves.apply(i).metrics().iterator()
        while it.hasNext():
            kv = it.next()
            metrics[str(kv._1())] = int(kv._2().value())
    return {"metrics": metrics, "plan": str(qe.executedPlan().toString())}


def delta(spark: SparkSession, d: dict[str, Any]) -> dict[str, Any]:
    path = d["path"]

    df = spark.read.format("delta").load(path)
    out: dict[str, Any] = {"columns": [list(x) for x in df.dtypes], "rows": rows(df)}
    detail = spark.sql(f"DESCRIBE DETAIL delta.`{path}`").first()
    assert detail is not None
    out["detail"] = {k: detail[k] for k in ("numFiles", "partitionColumns",
                                            "minReaderVersion", "minWriterVersion")}
    history = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").orderBy("version").collect()
    out["versions"] = [h["version"] for h in history]
    out["counts_by_version"] = [
        spark.read.format("delta").option("versionAsOf", v).load(path).count()
        for v in out["versions"]]
    out["scans"] = {k: scan(df.where(sql)) for k, sql in d["filters"].items()}
    # Spark's own idempotent write (txnAppId/txnVersion, as a foreachBatch writer keeps
    # it): the batch twophase committed last is skipped, the next one applied
    table_types = dict(df.dtypes)
    applied = []
    for version, first_id in ((d["committed_batch"], d["replay_id"]),
                              (d["committed_batch"] + 1, d["new_id"])):
        new = spark.range(first_id, first_id + 3).select(
            *[(F.col("id") if c == "id" else F.lit(d["row"].get(c))).cast(t).alias(c)
              for c, t in df.dtypes])
        assert dict(new.dtypes) == table_types
        (new.write.format("delta").mode("append").option("txnAppId", d["app_id"])
         .option("txnVersion", version).save(path))
        after = spark.read.format("delta").load(path)
        applied.append({"txn_version": version, "rows": after.count(),
                        "ids": [r[0] for r in after.where(F.col("id") >= min(
                            d["replay_id"], d["new_id"])).select("id").orderBy("id").collect()],
                        "version": spark.sql(f"DESCRIBE HISTORY delta.`{path}` LIMIT 1")
                        .first()["version"]})  # type: ignore[index]
    out["txn_writes"] = applied
    return out


def iceberg(spark: SparkSession, i: dict[str, Any]) -> dict[str, Any]:
    name = f"{i['catalog']}.{i['table']}"
    df = spark.table(name)
    out: dict[str, Any] = {"columns": [list(x) for x in df.dtypes], "rows": rows(df)}
    snaps = spark.sql(f"SELECT snapshot_id, parent_id, operation, summary FROM {name}.snapshots "
                      "ORDER BY committed_at").collect()
    out["snapshots"] = [{"id": s["snapshot_id"], "parent": s["parent_id"],
                         "operation": s["operation"], "summary": dict(s["summary"])}
                        for s in snaps]
    out["counts_by_snapshot"] = [
        spark.sql(f"SELECT count(*) FROM {name} VERSION AS OF {s['snapshot_id']}").first()[0]  # type: ignore[index]
        for s in snaps]
    out["data_files"] = spark.sql(f"SELECT count(*) FROM {name}.files").first()[0]  # type: ignore[index]
    out["scans"] = {k: scan(df.where(sql)) for k, sql in i["filters"].items()}
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    t0 = time.monotonic()
    spark = session(spec)
    out: dict[str, Any] = {"spark": spark.version, "seconds": {}}
    out["seconds"]["start"] = round(time.monotonic() - t0, 1)
    for kind, read in (("delta", delta), ("iceberg", iceberg)):
        if spec.get(kind):
            t0 = time.monotonic()
            out[kind] = read(spark, spec[kind])
            out["seconds"][kind] = round(time.monotonic() - t0, 1)
    spark.stop()
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
