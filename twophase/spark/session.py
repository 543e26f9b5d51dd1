"""The Spark session as the driver reads it: which Spark it talks to (classic or
Connect), the JVM context, the application's parallelism and task slots, the streaming
query's id, where an embedded coordinator listens, the Arrow schema the tasks get, and a
replay's pass through Spark's noop sink. Plans the batch's query; runs no job (except
``run_through``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twophase.errors import BatchFailed
from twophase.spark.compat import arrow_schema_of

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["arrow_schema", "coordinator_address", "default_partitions", "jvm_context",
           "query_lineage", "run_through", "spark_connect_client"]


QUERY_ID_PROPERTY = "sql.streaming.queryId"  # set by Spark on the stream execution thread


def query_lineage(df: DataFrame, sink: str) -> str:
    """The streaming query's id, the lineage of a sink given none (a new checkpoint
    location is a new query id, so batch ids restart under a new lineage)."""
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
