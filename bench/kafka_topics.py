"""Topics for the Kafka benches: made fresh per run, dropped after, counted from the log."""

from __future__ import annotations

import time
import uuid


def new_topic(bootstrap: str, topic: str | None = None, partitions: int = 1) -> str:
    """Create ``topic`` (default: a new ``bench-<hex>``) and wait until its partitions
    are listed; returns its name."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    topic = topic or f"bench-{uuid.uuid4().hex[:12]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions)]).values():
        future.result(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        t = admin.list_topics(topic=topic, timeout=10).topics.get(topic)
        if t is not None and t.error is None and len(t.partitions) == partitions:
            return topic
        time.sleep(0.1)
    raise RuntimeError(f"kafka topic {topic} did not appear within 30 s")


def drop_topic(bootstrap: str, topic: str) -> None:
    """Delete the topic, best effort (frees the broker's memory between runs)."""
    try:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": bootstrap})
        for future in admin.delete_topics([topic]).values():
            future.result(timeout=10)
    except Exception:  # a bench's clean-up: never the reason it fails
        pass


def committed_rows(bootstrap: str, topic: str) -> int:
    """Records the topic's log shows committed (plain records count as committed)."""
    from twophase.sinks.kafka.log import read_log

    return len(read_log({"bootstrap.servers": bootstrap}, topic, timeout=60).committed)
