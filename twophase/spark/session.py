"""The Spark session as the driver reads it: which Spark it talks to (classic or
Connect), the JVM context, the streaming query's id, where an embedded coordinator
listens, the Arrow schema the tasks get, and a replay's pass through Spark's
noop sink. Plans the batch's query; runs no job (except ``run_through``).

A batch reads Spark once, at the top of its run (:func:`read_batch`): the steps after it
take the frozen :class:`SparkBatch` as plain data and ask Spark nothing more about the
batch (the split, which needs the job's own plan, is :mod:`twophase.spark.split`'s)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twophase.errors import BatchFailed
from twophase.spark.compat import arrow_schema_of, check_spark

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["SparkApp", "SparkBatch", "arrow_schema", "coordinator_address",
           "read_app", "read_batch", "run_through", "spark_connect_client"]


QUERY_ID_PROPERTY = "sql.streaming.queryId"  # set by Spark on the stream execution thread


@dataclass(frozen=True)
class SparkApp:
    """What a sink reads of the Spark application once, when it starts: the session its
    preflight probes and where an embedded coordinator listens (bind, advertised)."""

    session: Any = field(repr=False)
    jvm: Any = field(repr=False)  # the JVM SparkContext; None under Spark Connect
    address: tuple[str, str]


def read_app(session: SparkSession, host: str | None = None) -> SparkApp:
    """The application as a sink starts in it (``host``: the sink's ``coordinator_host``,
    which overrides where the coordinator listens)."""
    return SparkApp(session, _jvm(session),
                    (host, host) if host else coordinator_address(session))


@dataclass(frozen=True)
class SparkBatch:
    """One micro-batch as the driver reads it from Spark, once, before anything is begun:
    its lineage, the JVM context, and the Arrow schema ``mapInArrow`` hands the tasks
    (timestamps in the session's zone). ``app``: the application, read at the sink's
    first batch and carried over."""

    app: SparkApp
    lineage: str
    jvm: Any = field(repr=False)  # the JVM SparkContext; None under Spark Connect
    zone: str | None
    spark_schema: Any = field(repr=False)
    schema: Any = field(repr=False)


def read_batch(df: DataFrame, sink: str, lineage: str | None, host: str | None,
               before: SparkBatch | None) -> SparkBatch:
    """Read the batch ``df`` of ``sink`` (``lineage``: the sink's own, else the query's
    id). ``before``: the sink's previous read (None at its first batch, when the Spark
    release is checked and the application read): its Arrow conversion is reused while
    the Spark schema and the session's zone stay the same; the batch's schema is its own,
    never the lineage's (a foreachBatch function may add a column from batch N on)."""
    session = df.sparkSession
    app = before.app if before is not None else read_app(session, host)
    jvm = _jvm(session)
    # the streaming query's id: a new checkpoint location is a new query id, so batch ids
    # restart under a new lineage
    lineage = lineage or session.sparkContext.getLocalProperty(QUERY_ID_PROPERTY)
    zone = session.conf.get("spark.sql.session.timeZone")  # one py4j round trip
    spark_schema = df.schema
    if before is None:  # before anything is begun or written
        import pyspark

        check_spark(sink, session.version, pyspark.__version__)
    if not lineage:
        raise BatchFailed(
            f"sink {sink!r}: no streaming query id on this thread; call the sink "
            "from foreachBatch, or pass lineage=... for a batch (non-streaming) write"
        )
    same = before is not None and (before.spark_schema, before.zone) == (spark_schema, zone)
    arrow = (before.schema if same and before is not None
             else arrow_schema_of(spark_schema, zone))
    return SparkBatch(app, str(lineage), jvm, zone, spark_schema, arrow)


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


def _jvm(session: SparkSession) -> Any:
    """The JVM SparkContext, or None under Spark Connect."""
    if type(session).__module__.startswith("pyspark.sql.connect"):
        return None
    return session.sparkContext


def arrow_schema(df: DataFrame, tz: str | None = None) -> Any:
    """The Arrow schema ``mapInArrow`` will hand the tasks (timestamps in the session zone,
    read from the session unless given; :func:`twophase.spark.compat.arrow_schema_of`)."""
    if tz is None:
        tz = df.sparkSession.conf.get("spark.sql.session.timeZone")
    return arrow_schema_of(df.schema, tz)


def coordinator_address(session: SparkSession | None) -> tuple[str, str]:
    """Where an embedded coordinator listens and what the tasks are told: loopback
    under a ``local`` master (or with no session to ask), else the driver's own bind
    address and host."""
    if session is None:
        return "127.0.0.1", "127.0.0.1"
    conf = session.conf
    master = conf.get("spark.master", "local") or "local"
    if master.startswith("local"):
        return "127.0.0.1", "127.0.0.1"
    host = conf.get("spark.driver.host", None)
    if not host:
        import socket

        host = socket.gethostbyname(socket.gethostname())
    bind = conf.get("spark.driver.bindAddress", None) or host
    return bind, host
