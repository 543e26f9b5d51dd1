"""The reference streaming job: generated events -> TransactionalSink -> every system.

With ``aggregate="update"`` or ``"complete"`` the job writes ``groupBy("customer").count()``
in that output mode instead of the events (pair it with ``pg_mode="upsert"``,
``pg_key=["customer"]``, or ``pg_mode="complete"``).

``twophase demo`` runs it in-process; ``twophase chaos`` and the crash tests run it as a
separate driver process (``python -m twophase.testing.job CONFIG.json``) so that it can be
SIGKILLed and restarted from its checkpoint. Input is a folder of Parquet files, one
per micro-batch (``maxFilesPerTrigger=1``), with deterministic ids, so a replayed batch
has exactly the same rows; or, with ``source_topic``, a Kafka topic read by Spark's own
Kafka source (:mod:`.kafkasource`, ``source_per_batch`` records a micro-batch).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twophase.participant import Participant

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from twophase.doors.foreachbatch import BatchReport

__all__ = [
    "EVENT_DDL",
    "JobConfig",
    "build_participants",
    "committed_batches",
    "expected_counts",
    "expected_ids",
    "job_session",
    "place_batch",
    "run",
    "spark_session",
    "write_input",
]

EVENT_DDL = "id long, customer string, amount decimal(12,2), ts timestamp"


@dataclass
class JobConfig:
    input_dir: str
    checkpoint: str
    coordinator: str
    sink: str = "orders"
    token: str | None = None
    pg_dsn: str | None = None
    pg_table: str = "orders"
    pg_mode: str = "append"  # PostgresParticipant mode: append, upsert or complete
    pg_key: list[str] | None = None
    pg_on_schema_change: str = "fail"
    files_path: str | None = None
    files_format: str = "parquet"
    files_options: dict[str, Any] | None = None  # storage_options of an s3:// files_path
    files_native: bool | None = None  # StagedFileParticipant(native=...); None: automatic
    kafka_bootstrap: str | None = None
    kafka_topic: str = "orders"
    kafka_reuse: bool = False  # KafkaParticipant(reuse_clients=...)
    # KafkaParticipant(prepare=...): "resumable", "staged" ("in_task" refused: retired in
    # 0.4); None: its default
    kafka_prepare: str | None = None
    # KafkaParticipant(transaction_timeout_ms=...); None: its default
    kafka_transaction_timeout_ms: int | None = None
    # librdkafka settings (TLS, SASL) from a properties file, read where the participant
    # is made; the password from TWOPHASE_KAFKA_SASL_PASSWORD, never in this config
    kafka_config_file: str | None = None
    # SqlAlchemyParticipant, one per URL (mysql+pymysql://..., postgresql+psycopg://...)
    sql_urls: list[str] | None = None
    sql_table: str = "orders"
    delta_path: str | None = None  # DeltaParticipant: a local folder or s3://bucket/prefix
    delta_options: dict[str, str] | None = None  # its storage_options (s3:// only)
    delta_partition_by: list[str] | None = None  # DeltaParticipant(partition_by=...)
    iceberg_table: str | None = None  # IcebergParticipant: "namespace.name"
    iceberg_catalog: dict[str, str] | None = None  # pyiceberg load_catalog properties
    iceberg_partition_by: list[str] | None = None  # IcebergParticipant(partition_by=...)
    # Any participant kind rebuilt by kind (the twophase.participants entry points, e.g. a
    # third-party package's): descriptors {"kind", "name", "target", "options"}, secrets
    # from TWOPHASE_SECRET_<PARTICIPANT>_<KEY> as for `twophase resolve`
    participants: list[dict[str, Any]] | None = None
    partitions: int | None = None
    # repartition the input to this many Spark partitions (tasks) before the sink; None:
    # as read (one input file a batch: one task)
    input_partitions: int | None = None
    aggregate: str | None = None  # "update" or "complete": groupBy("customer").count()
    max_attempts: int = 3
    vote_timeout: float = 120.0
    spark_conf: dict[str, str] = field(default_factory=dict)
    # Spark's Kafka source instead of the Parquet folder: the topic (on source_bootstrap,
    # else kafka_bootstrap) and the records a micro-batch
    source_topic: str | None = None
    source_bootstrap: str | None = None
    source_per_batch: int = 1000
    # A stream instead of availableNow: the query runs on a processing-time trigger until
    # this file exists and the query has committed all it planned and found no new input
    # for 5 s; then the driver stops and exits 0 (the cluster chaos test feeds input while
    # it kills and restarts such a driver, then writes the file once all input is there).
    stream_stop: str | None = None
    # A second streaming query in the same application, beside the sink's: a rate source
    # written as Parquet to <side_output>/out (its checkpoint <side_output>/ckpt); its
    # committed batches show it kept running (side_batches()).
    side_output: str | None = None
    # Spark's own data source door, writeStream.format("twophase"), instead of foreachBatch
    door: bool = False

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> JobConfig:
        return cls(**json.loads(Path(path).read_text()))


def write_input(input_dir: str | Path, batches: int, rows_per_batch: int, first: int = 0) -> None:
    """One Parquet file per batch; ids ``batch * rows_per_batch + i`` (deterministic)."""
    import datetime as dt
    import decimal

    import pyarrow as pa

    out = Path(input_dir)
    schema = pa.schema([
        ("id", pa.int64()), ("customer", pa.string()), ("amount", pa.decimal128(12, 2)),
        ("ts", pa.timestamp("us", tz="UTC")),
    ])
    base = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    for b in range(first, first + batches):
        ids = list(range(b * rows_per_batch, (b + 1) * rows_per_batch))
        table = pa.table(
            {
                "id": ids,
                "customer": [f"customer-{i % 97}" for i in ids],
                "amount": [decimal.Decimal(i % 10_000) / 100 for i in ids],
                "ts": [base + dt.timedelta(seconds=i) for i in ids],
            },
            schema=schema,
        )
        place_batch(out, b, table)


def place_batch(input_dir: str | Path, index: int, table: Any) -> Path:
    """Write one input file so that the file source reads it as batch ``index``.

    Spark's file source orders new files by modification time only; files written within
    the same clock tick would come in any order, so the mtime is set from ``index``.
    """
    import pyarrow.parquet as pq

    out = Path(input_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".batch-{index:06d}.parquet.tmp"
    pq.write_table(table, tmp)
    stamp = 1_700_000_000 + index
    os.utime(tmp, (stamp, stamp))
    final = out / f"batch-{index:06d}.parquet"
    os.replace(tmp, final)  # the source never sees half a file
    return final


def expected_ids(batches: int, rows_per_batch: int) -> list[int]:
    return list(range(batches * rows_per_batch))


def expected_counts(batches: int, rows_per_batch: int) -> dict[str, int]:
    """``groupBy("customer").count()`` over every input row of ``write_input``."""
    counts: dict[str, int] = {}
    for i in expected_ids(batches, rows_per_batch):
        name = f"customer-{i % 97}"
        counts[name] = counts.get(name, 0) + 1
    return counts


def build_participants(cfg: JobConfig) -> list[Participant]:
    parts: list[Participant] = []
    if cfg.pg_dsn:
        from twophase.sinks.postgres import PostgresParticipant

        parts.append(PostgresParticipant(
            dsn=cfg.pg_dsn, table=cfg.pg_table, mode=cfg.pg_mode, key=cfg.pg_key,
            on_schema_change=cfg.pg_on_schema_change,
        ))
    if cfg.files_path:
        from twophase.sinks.files import StagedFileParticipant

        parts.append(StagedFileParticipant(path=cfg.files_path, format=cfg.files_format,
                                           storage_options=cfg.files_options,
                                           native=cfg.files_native))
    if cfg.kafka_bootstrap:
        from twophase.sinks.kafka import KafkaParticipant
        from twophase.sinks.kafka.config import load_client_config

        settings = load_client_config(cfg.kafka_config_file, "kafka_config_file") \
            if cfg.kafka_config_file else {}
        chosen: dict[str, Any] = {} if cfg.kafka_prepare is None else {
            "prepare": cfg.kafka_prepare}
        if cfg.kafka_transaction_timeout_ms is not None:
            chosen["transaction_timeout_ms"] = cfg.kafka_transaction_timeout_ms
        parts.append(
            KafkaParticipant(topic=cfg.kafka_topic,
                             config={**settings, "bootstrap.servers": cfg.kafka_bootstrap},
                             reuse_clients=cfg.kafka_reuse, **chosen)
        )
    if cfg.sql_urls:
        from twophase.sinks.sql import SqlAlchemyParticipant

        for i, url in enumerate(cfg.sql_urls):
            name = f"sql-{cfg.sql_table}" if i == 0 else f"sql{i}-{cfg.sql_table}"
            parts.append(SqlAlchemyParticipant(url, cfg.sql_table, name=name[:64]))
    if cfg.delta_path:
        from twophase.sinks.delta import DeltaParticipant

        parts.append(DeltaParticipant(cfg.delta_path, storage_options=cfg.delta_options,
                                      mode="complete" if cfg.aggregate == "complete"
                                      else "append", partition_by=cfg.delta_partition_by))
    if cfg.iceberg_table:
        from twophase.sinks.iceberg import IcebergParticipant

        parts.append(IcebergParticipant(cfg.iceberg_table, cfg.iceberg_catalog or {},
                                        mode="complete" if cfg.aggregate == "complete"
                                        else "append", partition_by=cfg.iceberg_partition_by))
    if cfg.participants:
        from twophase.participant import rebuild

        parts.extend(rebuild(d) for d in cfg.participants)
    if not parts:
        raise ValueError("the job needs at least one of: pg_dsn, files_path, kafka_bootstrap, "
                         "sql_urls, delta_path, iceberg_table, participants")
    return parts


def spark_session(conf: dict[str, str] | None = None) -> SparkSession:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # keep Spark on loopback
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master("local[2]")
        .appName("twophase-job")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "1g")
    )
    for k, v in (conf or {}).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def job_session(cfg: JobConfig) -> SparkSession:
    """The Spark session ``run`` uses for ``cfg`` (with Spark's Kafka connector when the
    job reads a Kafka topic)."""
    conf = dict(cfg.spark_conf)
    if cfg.source_topic:
        from twophase.testing.sparkkafka import spark_kafka_conf

        conf = {**spark_kafka_conf(), **conf}
    return spark_session(conf)


def run(
    cfg: JobConfig,
    spark: SparkSession | None = None,
    *,
    participants: Sequence[Participant] | None = None,
    on_batch: Callable[[BatchReport], None] | None = None,
) -> Any:
    """Process every input file present now (``availableNow``), or with ``stream_stop``
    as a stream until that file says stop; then return the sink."""
    from twophase.doors.foreachbatch import TransactionalSink

    if spark is None:
        spark = job_session(cfg)
    sink = TransactionalSink(
        cfg.sink,
        participants=list(participants) if participants is not None else build_participants(cfg),
        coordinator=cfg.coordinator,
        token=cfg.token,
        partitions=cfg.partitions,
        max_attempts=cfg.max_attempts,
        vote_timeout=cfg.vote_timeout,
        on_batch=on_batch,
    )
    try:
        if cfg.source_topic:
            from twophase.testing.kafkasource import kafka_events

            bootstrap = cfg.source_bootstrap or cfg.kafka_bootstrap
            if not bootstrap:
                raise ValueError("source_topic needs source_bootstrap or kafka_bootstrap")
            stream = kafka_events(spark, bootstrap, cfg.source_topic, cfg.source_per_batch)
        else:
            stream = spark.readStream.schema(EVENT_DDL).option("maxFilesPerTrigger", 1) \
                .parquet(cfg.input_dir)
        if cfg.input_partitions is not None:
            stream = stream.repartition(cfg.input_partitions)
        output_mode = "append"
        if cfg.aggregate is not None:
            if cfg.aggregate not in ("update", "complete"):
                raise ValueError(f"aggregate must be 'update' or 'complete', got {cfg.aggregate!r}")
            stream, output_mode = stream.groupBy("customer").count(), cfg.aggregate
        side = _start_side_query(spark, cfg.side_output) if cfg.side_output else None
        writer = stream.writeStream.outputMode(output_mode)
        if cfg.door:
            from twophase.doors.datasource import register

            register(spark, sink)
            writer = writer.format("twophase").option("sink", sink.name)
        else:
            writer = writer.foreachBatch(sink)
        writer = writer.option("checkpointLocation", cfg.checkpoint)
        if cfg.stream_stop is None:
            query = writer.trigger(availableNow=True).start()
            query.awaitTermination()
        else:
            query = writer.trigger(processingTime="1 second").start()
            _stream_until(query, side, Path(cfg.checkpoint), Path(cfg.stream_stop))
        if side is not None:
            side.stop()
    finally:
        sink.close()
    return sink


def _start_side_query(spark: SparkSession, folder: str) -> Any:
    """The second query of the application: independent of the sink, sharing its
    executors; it must go on running while the sink's tasks are killed and retried."""
    return (spark.readStream.format("rate").option("rowsPerSecond", 20)
            .option("numPartitions", 1).load()
            .writeStream.format("parquet").option("path", f"{folder}/out")
            .option("checkpointLocation", f"{folder}/ckpt")
            .queryName("side").trigger(processingTime="2 seconds").start())


def committed_batches(checkpoint: str | Path) -> int:
    """How many batches a streaming query's checkpoint records as committed: the last
    committed batch id + 1 (Spark keeps only the newest ~100 commit files, so they
    cannot be counted)."""
    commits = Path(checkpoint) / "commits"
    if not commits.is_dir():
        return 0
    return max((int(p.name) + 1 for p in commits.iterdir() if p.name.isdigit()), default=0)


def _stream_until(query: Any, side: Any, checkpoint: Path, stop: Path) -> None:
    """Run until ``stop`` exists and the query has read every input file and committed
    every batch it planned (a batch may read more than one file: after a restart Spark
    can merge what the dead driver listed into one batch, so files are not batches).
    A query that died raises its error (``awaitTermination`` re-raises it): the driver
    exits non-zero."""
    import time

    idle_since: float | None = None
    while True:
        for q in (query, side):
            if q is not None and not q.isActive:
                q.awaitTermination()
                raise RuntimeError(f"query {q.name or q.id} stopped before the stop file "
                                   f"{stop} was reached")
        status = query.status
        planned = max((int(p.name) for p in (checkpoint / "offsets").iterdir()
                       if p.name.isdigit()), default=-1) if (checkpoint / "offsets").is_dir() \
            else -1
        # lastProgress: a trigger of this run has listed the input (a restarted driver
        # is idle while it initialises its sources, before it has looked)
        idle = (stop.exists() and query.lastProgress is not None
                and not status["isDataAvailable"]
                and not status["isTriggerActive"]
                and committed_batches(checkpoint) == planned + 1)
        if not idle:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= 5.0:  # several triggers found nothing new
            break
        time.sleep(0.5)
    query.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m twophase.testing.job CONFIG.json", file=sys.stderr)
        return 2
    cfg = JobConfig.load(args[0])

    def progress(r: BatchReport) -> None:
        print(json.dumps({"batch": r.batch_id, "outcome": r.outcome, "attempts": r.attempts,
                          "rows": r.rows, "recovered": r.recovered, "redone": r.redone,
                          "seconds": round(r.seconds, 3)}), flush=True)

    run(cfg, on_batch=progress)
    print(json.dumps({"done": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
