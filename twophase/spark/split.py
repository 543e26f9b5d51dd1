"""How Spark split a batch, read from its RDD lineage: whether a replay of the batch
splits it alike (then the sink keeps Spark's split and needs no shuffle). Plans the
batch; runs no job."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["default_partitions", "input_partitions"]


# RDDs whose split is fixed by what the batch reads (its files, its offset ranges, its
# local rows), so a replay of the batch splits it the same way.
_SOURCES = frozenset({
    "FileScanRDD", "DataSourceRDD", "KafkaSourceRDD", "ParallelCollectionRDD", "EmptyRDD",
})


def input_partitions(df: DataFrame, any_split: bool = False) -> int | None:
    """How many partitions the batch has as Spark made it, when a replay of the batch
    makes the same split: its RDD lineage is one source RDD and then only one-to-one
    (narrow, same partition) steps, no shuffle, no union, no coalesce; 0 when the source
    is known to hold no rows at all. With ``any_split`` (the sink: its prepares are
    durable, so only a redo, which the vote's digest checks, needs a replay split alike)
    also a split that comes from a shuffle, a union or a coalesce, as planned (a stateful
    aggregation's ``spark.sql.shuffle.partitions``): no second shuffle. None otherwise, or
    when it cannot be told (Spark Connect). foreachBatch hands the batch over as an RDD
    scan, so the RDD, not the plan, is read. Plans the batch; runs no job."""
    try:
        rdd = df._jdf.queryExecution().toRdd()
        # With any split allowed, only an empty local relation answers otherwise than the
        # partition count: one py4j call for the lineage's text instead of a walk of
        # ~5 calls per RDD (2.2 -> 0.4 ms a batch at 10k rows, timed apart; toRdd's
        # planning, the rest of this phase, is the job's own, which it reuses).
        if any_split and "ParallelCollectionRDD" not in rdd.toDebugString():
            return int(rdd.getNumPartitions())
        stable = _replayed_alike(rdd)
        if stable is None and any_split:
            return int(rdd.getNumPartitions())
        return stable
    except Exception:  # no JVM plan to read (Spark Connect): fall back to the hash split
        return None


def _replayed_alike(rdd: Any) -> int | None:
    """``input_partitions`` for a split a replay makes alike (see there)."""
    stack, sources, empty = [rdd], 0, True
    while stack:  # each JVM call is a py4j round trip (~0.3-1 ms): as few as possible
        node = stack.pop()
        deps = node.dependencies()
        n_deps = deps.size()
        if n_deps == 0:
            kind = node.getClass().getSimpleName()
            if kind not in _SOURCES:
                return None
            sources += 1
            if kind == "ParallelCollectionRDD":  # local rows: are there any?
                empty = empty and all(p.values().isEmpty() for p in node.partitions())
            elif kind == "DataSourceRDD" and _kafka_ranges(node):
                return None
            elif kind != "EmptyRDD":
                empty = False
        for i in range(n_deps):
            dep = deps.apply(i)
            if dep.getClass().getSimpleName() != "OneToOneDependency":
                return None
            stack.append(dep.rdd())
    if sources != 1:
        return None
    return 0 if empty else int(rdd.getNumPartitions())


def _kafka_ranges(rdd: Any) -> bool:
    """Spark's Kafka source: its offset ranges come in the order of an unordered set of
    topic-partitions, so a batch replayed from the checkpoint's offset log may give a
    topic-partition another Spark partition than the first run did (a redo's digest then
    refuses it: found by tests/spark/test_kafka_source.py). Such a batch takes the hash
    split, which does not depend on the order."""
    parts = rdd.partitions()
    if len(parts) == 0:
        return False
    inputs = parts[0].inputPartitions()
    return bool(inputs.nonEmpty()) and "kafka" in inputs.head().getClass().getName().lower()


def default_partitions(df: DataFrame, jvm: Any) -> int:
    """The application's parallelism, the partitions of a batch whose split cannot be
    read (``jvm``: the JVM SparkContext, None under Spark Connect: then the session's
    ``spark.default.parallelism``, else 2). Two py4j round trips: read only when needed."""
    if jvm is None:
        conf = df.sparkSession.conf.get("spark.default.parallelism", None)
        return max(1, int(conf)) if conf else 2
    return max(1, int(jvm.defaultParallelism))
