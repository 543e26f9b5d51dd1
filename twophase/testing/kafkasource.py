"""The Kafka-in pipeline's input: events produced to a source topic, read back by Spark's
own Kafka source (``format("kafka")``) as the reference job's event rows.

Why the job can be replayed exactly: Spark's Kafka source writes each micro-batch's end
offsets to the checkpoint's offset log before the batch runs, so a driver restarted from
its checkpoint reads the very same records for the batch it was writing; with
``maxOffsetsPerTrigger`` the records arrive in several micro-batches, as a stream does.
Each record's value is one event as JSON (``EVENT_DDL``), its key the id.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["create_source_topic", "kafka_events", "produce_events"]


def create_source_topic(bootstrap: str, topic: str, partitions: int, timeout: float = 30.0
                        ) -> None:
    """The source topic with ``partitions`` partitions (an existing one is kept)."""
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions)],
                                      request_timeout=timeout).values():
        try:
            future.result(timeout=timeout)
        except Exception as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise RuntimeError(f"cannot create the source topic {topic!r} at "
                                   f"{bootstrap}: {exc}") from exc


def produce_events(bootstrap: str, topic: str, first: int, count: int) -> None:
    """Events ``first .. first+count-1`` (the rows :func:`~.job.write_input` would
    write), acknowledged by every in-sync replica before this returns."""
    from confluent_kafka import Producer

    base = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                         "linger.ms": 20})
    failed: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(str(err))

    for i in range(first, first + count):
        ts = (base + dt.timedelta(seconds=i)).isoformat().replace("+00:00", "Z")
        value = {"id": i, "customer": f"customer-{i % 97}",
                 "amount": f"{(i % 10_000) / 100:.2f}", "ts": ts}
        producer.produce(topic, json.dumps(value).encode(), str(i).encode(),
                         on_delivery=delivered)
        producer.poll(0)
    left = producer.flush(60)
    if left or failed:
        raise RuntimeError(f"producing the source events to {topic!r} at {bootstrap}: "
                           f"{left} undelivered, errors {failed[:3]}")


def kafka_events(spark: SparkSession, bootstrap: str, topic: str, per_batch: int
                 ) -> DataFrame:
    """The source topic as a stream of event rows, from its start, at most
    ``per_batch`` records a micro-batch."""
    from pyspark.sql import functions as F

    from twophase.testing.job import EVENT_DDL

    raw = (spark.readStream.format("kafka")
           .option("kafka.bootstrap.servers", bootstrap)
           .option("subscribe", topic)
           .option("startingOffsets", "earliest")
           .option("maxOffsetsPerTrigger", str(per_batch))
           .option("failOnDataLoss", "true")
           .load())
    return (raw.select(F.from_json(F.col("value").cast("string"), EVENT_DDL).alias("e"))
            .select("e.*"))
