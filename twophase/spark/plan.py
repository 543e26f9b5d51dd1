"""What the driver reads from Spark before a batch runs (the protocol's "plan" step):
how a batch is split, how many task slots the application has, the Arrow schema the
tasks get, and the Spark handles it needs. Plans the batch's query; runs no job (except
``run_through``, a replay's pass through Spark's noop sink)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from twophase.errors import InvalidRequest
from twophase.spark.compat import arrow_schema_of

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from twophase.participant import Participant

__all__ = ["arrow_schema", "check_gang", "coordinator_address", "default_partitions",
           "fixed_split", "input_partitions", "jvm_context", "query_lineage", "run_through",
           "spark_connect_client", "split_rule", "task_slots"]


def split_rule(participants: Sequence[Participant]) -> tuple[tuple[str, ...], bool]:
    """How every batch is split: (hash columns, one partition only).

    No column asked for: hash by every column (stable, so a replay splits alike).
    Participants asking for key columns get the columns all of them share (the first
    one's order): equal keys of each then meet in one branch. Nothing shared, or a
    participant that needs the whole batch, means a single partition."""
    single = any(p.single_branch() for p in participants)
    asks = [tuple(c) for p in participants if (c := p.partition_columns()) is not None]
    if single or not asks:
        return (), single
    shared = [c for c in asks[0] if all(c in a for a in asks[1:])]
    return tuple(shared), not shared


def fixed_split(
    sink: str, participants: Sequence[Participant], partitions: int | None
) -> tuple[tuple[str, ...], bool, int | None]:
    """``split_rule`` with the sink's ``partitions=``: (hash columns, one branch only,
    partitions). One branch only refuses any other partition count, saying why."""
    columns, single = split_rule(participants)
    if not single:
        return columns, False, partitions
    if partitions not in (None, 1):
        whole = [p.describe() for p in participants if p.single_branch()]
        why = (", ".join(whole) + " writes each batch as one branch" if whole else
               "the participants' key columns (partition_columns) share no column, "
               "so only one branch keeps every key in one place")
        raise InvalidRequest(
            f"sink {sink!r}: partitions={partitions} but {why}; leave partitions unset (or 1)"
        )
    return columns, True, 1


QUERY_ID_PROPERTY = "sql.streaming.queryId"  # set by Spark on the stream execution thread


def query_lineage(df: DataFrame, sink: str) -> str:
    """The streaming query's id, the lineage of a sink given none (a new checkpoint
    location is a new query id, so batch ids restart under a new lineage)."""
    from twophase.errors import BatchFailed

    qid = df.sparkSession.sparkContext.getLocalProperty(QUERY_ID_PROPERTY)
    if not qid:
        raise BatchFailed(
            f"sink {sink!r}: no streaming query id on this thread; call the sink "
            "from foreachBatch, or pass lineage=... for a batch (non-streaming) write"
        )
    return str(qid)


def run_through(df: DataFrame) -> None:
    """Evaluate a replayed batch without writing it anywhere.

    A stateful query (``groupBy().count()``, dedup, stream joins) commits its state
    stores for a batch only when the batch's plan runs, and Spark (4.1+) fails the query
    when ``foreachBatch`` returns without every state partition committed
    (STATE_STORE_COMMIT_VALIDATION_FAILED). So a batch the coordinator already shows
    committed still runs through Spark's ``noop`` sink; its rows go nowhere. This costs one
    pass over the batch, only on a replay after a crash."""
    df.write.format("noop").mode("overwrite").save()


def spark_connect_client() -> bool:
    """True when this process talks to Spark through Spark Connect."""
    try:
        from pyspark.sql.utils import is_remote
    except ImportError:
        return False
    return bool(is_remote())


def jvm_context(df: DataFrame) -> Any:
    """The JVM SparkContext, or None under Spark Connect."""
    session = df.sparkSession
    if type(session).__module__.startswith("pyspark.sql.connect"):
        return None
    return session.sparkContext


def task_slots(df: DataFrame) -> int | None:
    """How many tasks the application's executors can run at once (Spark's own figure
    for barrier stages), or None when it cannot be asked (Spark Connect)."""
    sc = jvm_context(df)
    if sc is None:
        return None
    jsc = sc._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def default_partitions(df: DataFrame) -> int:
    sc = jvm_context(df)
    if sc is None:
        conf = df.sparkSession.conf.get("spark.default.parallelism", None)
        return max(1, int(conf)) if conf else 2
    return max(1, int(sc.defaultParallelism))


def arrow_schema(df: DataFrame, tz: str | None = None) -> Any:
    """The Arrow schema ``mapInArrow`` will hand the tasks (timestamps in the session zone,
    read from the session unless given; :func:`twophase.spark.compat.arrow_schema_of`)."""
    if tz is None:
        tz = df.sparkSession.conf.get("spark.sql.session.timeZone")
    return arrow_schema_of(df.schema, tz)


# RDDs whose split is fixed by what the batch reads (its files, its offset ranges, its
# local rows), so a replay of the batch splits it the same way.
_SOURCES = frozenset({
    "FileScanRDD", "DataSourceRDD", "KafkaSourceRDD", "ParallelCollectionRDD", "EmptyRDD",
})


def input_partitions(df: DataFrame, any_split: bool = False) -> int | None:
    """How many partitions the batch has as Spark made it, when a replay of the batch
    makes the same split: its RDD lineage is one source RDD and then only one-to-one
    (narrow, same partition) steps, no shuffle, no union, no coalesce (which a barrier
    stage would refuse anyway); 0 when the source is known to hold no rows at all. With
    ``any_split`` (a sink whose prepares are durable: only a redo, which the vote's digest
    checks, needs a replay split alike) also a split that comes from a shuffle, a union
    or a coalesce, as planned (a stateful aggregation's ``spark.sql.shuffle.partitions``):
    no second shuffle. None otherwise, or when it cannot be told (Spark Connect).
    foreachBatch hands the batch over as an RDD scan, so the RDD, not the plan, is read.
    Plans the batch; runs no job."""
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


def coordinator_address(df: DataFrame | None) -> tuple[str, str]:
    """Where an embedded coordinator listens and what the tasks are told: loopback
    under a ``local`` master (or with no session to ask), else the driver's own bind
    address and host."""
    if df is None:
        return "127.0.0.1", "127.0.0.1"
    conf = df.sparkSession.conf
    master = conf.get("spark.master", "local") or "local"
    if master.startswith("local"):
        return "127.0.0.1", "127.0.0.1"
    host = conf.get("spark.driver.host", None)
    if not host:
        import socket

        host = socket.gethostbyname(socket.gethostname())
    bind = conf.get("spark.driver.bindAddress", None) or host
    return bind, host


def check_gang(df: DataFrame, sink: str, in_task: str, partitions: int, wait: float) -> None:
    """A barrier stage of ``partitions`` tasks (``in_task`` names the participants that
    need it) runs only without dynamic allocation and with that many task slots at once:
    refuse otherwise, with the fix, waiting up to ``wait`` seconds for executors."""
    conf = df.sparkSession.conf
    master = conf.get("spark.master", "local") or "local"
    dyn = (conf.get("spark.dynamicAllocation.enabled", "false") or "false").lower()
    if dyn == "true" and not master.startswith("local"):
        raise InvalidRequest(
            f"sink {sink!r}: spark.dynamicAllocation.enabled=true, but "
            f"{in_task} keeps its prepared branches in-task until the "
            "decision, so the sink runs each batch as a barrier stage, which Spark "
            "does not run under dynamic allocation; start the application with "
            "--conf spark.dynamicAllocation.enabled=false and a fixed executor count "
            "(--num-executors / spark.cores.max) covering the sink's partitions"
        )
    slots = task_slots(df)
    if slots is None:  # Spark Connect: no SparkContext to ask; Spark's own check rules
        return
    deadline = time.monotonic() + wait
    while slots < partitions and time.monotonic() < deadline:
        time.sleep(0.5)  # executors may still be registering
        slots = task_slots(df) or 0
    if slots < partitions:
        raise InvalidRequest(
            f"sink {sink!r}: a batch needs {partitions} task slots at once (one "
            f"barrier task per partition, as {in_task} keeps its prepared "
            f"branches in-task) but the cluster offers {slots} (waited "
            f"{wait:.0f}s for executors); pass partitions<={slots} to "
            "the sink, or give the application more executor cores "
            "(spark.cores.max / --num-executors x spark.executor.cores)"
        )
