"""Read a topic back the way a consumer does, for the exactly-once verifier.

Not part of the protocol: ``KafkaParticipant.read_back`` uses it so that the verifier in
``twophase.testing`` needs no Kafka knowledge.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["read_topic"]
from twophase.errors import ParticipantError


def read_topic(
    config: Mapping[str, object],
    topic: str,
    column: str,
    *,
    value_column: str | None,
    timeout: float = 120.0,
) -> list[Any]:
    """``column`` of every committed JSON value, read to the end with ``read_committed``.

    Robust to a slow or briefly confused broker: the topic's metadata and end offsets are
    retried until they answer, and a partition is done when the consumer's *position*
    reaches the end offset (the last offsets of a transactional topic are commit
    markers, which are never delivered as messages). When ``value_column`` names the
    value (not the row as JSON) the column cannot be read back: no values are returned.
    """
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    conf = dict(config)
    conf.update({
        "group.id": "twophase.verify",
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        "auto.offset.reset": "earliest",
    })
    deadline = time.monotonic() + timeout
    consumer = Consumer(conf)
    ids: list[Any] = []
    try:
        while True:
            try:
                meta = consumer.list_topics(topic, timeout=10)
                found = meta.topics.get(topic)
                if found is not None and found.error is None and found.partitions:
                    parts = sorted(found.partitions)
                    ends = {
                        i: consumer.get_watermark_offsets(
                            TopicPartition(topic, i), timeout=10)[1]
                        for i in parts
                    }
                    break
            except KafkaException:
                pass
            if time.monotonic() > deadline:
                raise ParticipantError(f"verify: no metadata for Kafka topic {topic!r}")
            time.sleep(0.5)
        consumer.assign([TopicPartition(topic, i, 0) for i in parts])
        pending = {i for i, end in ends.items() if end > 0}
        while pending and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                value = msg.value()
                if value and value_column is None:
                    ids.append(json.loads(value)[column])
            for tp in consumer.position([TopicPartition(topic, i) for i in pending]):
                if tp.offset is not None and tp.offset >= ends[tp.partition]:
                    pending.discard(tp.partition)
        if pending:
            raise ParticipantError(
                f"verify: Kafka topic {topic!r} partitions {sorted(pending)} were not read "
                f"to their end within {timeout:.0f}s"
            )
    finally:
        consumer.close()
    return ids
