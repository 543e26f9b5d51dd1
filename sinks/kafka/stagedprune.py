"""Deleting the staging topic's records that no branch can still need (Kafka's ``staged``
prepare), from the driver's background prune (``Participant.prune_markers``).

Without it a staging topic keeps every staged record until its retention deletes it. The
driver calls the prune after batch ``C`` committed with ``below = C - keep``; every batch
of this sink's lineage below ``below`` is then committed: each committed attempt's
branches were copied and acknowledged (the driver returns only then, and batches run in
order), an aborted attempt's records and a duplicate task's are never copied, and a
replay of a committed batch is answered COMMITTED by the coordinator without a copy.

The rule that makes it safe: in each staging partition, from its earliest offset on,
the records are read in order, and the partition is cut before the first record that is
not provably done: one whose headers do not name this sink and lineage, or name a batch
at or above ``below`` (another sink or query sharing the staging topic, an older lineage
with a batch in doubt, a later batch being staged now, anything unreadable). So a record
is deleted only when it was read and found to be this sink's, of a committed batch; the
offsets below the cut were all read, and a log only grows at its end, so nothing written
while the prune runs falls below it. ``DeleteRecords`` (Kafka's own API for a consumed
repartition topic, as Kafka Streams uses it) removes exactly the offsets below the cut.
docs/decisions.md (issue 30 leftovers) has the reasoning in full.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final

from twophase.participant import ParticipantError
from twophase.sinks.kafka.config import common_config
from twophase.sinks.kafka.errors import describe_error

if TYPE_CHECKING:
    from twophase.sinks.kafka.participant import KafkaParticipant

__all__ = ["prune_staged"]

_READER_GROUP: Final = "twophase.staged-pruner"  # never commits: only names the reader


def prune_staged(p: KafkaParticipant, sink: str, lineage: str, below: int) -> int:
    """Delete, in every partition of ``p``'s staging topic, the leading records that are
    ``sink``'s, of ``lineage``, of a batch below ``below`` (see the module docstring).
    Returns how many offsets were deleted. A refusal (no Delete right on the topic) is
    raised naming the ACL; the driver logs it and goes on."""
    from confluent_kafka import Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient

    from twophase.sinks.kafka.staged import _partitions

    topic, timeout = p.staging_topic, p.connect_timeout_s
    conf: Any = {**common_config(p.config), "allow.auto.create.topics": False}
    admin = AdminClient(conf)  # never creates the topic it asks about (staged.check)
    n = _partitions(admin, topic, timeout)
    if not n:
        return 0
    reader = Consumer({**common_config(p.config), "group.id": _READER_GROUP,
                       "enable.auto.commit": False, "auto.offset.reset": "earliest",
                       "fetch.wait.max.ms": 10, "isolation.level": "read_committed"})
    cuts: list[Any] = []
    deleted = 0
    try:
        for q in range(n):
            low, high = reader.get_watermark_offsets(TopicPartition(topic, q), timeout)
            cut = _done_below(reader, TopicPartition(topic, q, low), high,
                              (sink.encode(), lineage.encode()), below, timeout)
            if cut > low:
                cuts.append(TopicPartition(topic, q, cut))
                deleted += cut - low
    finally:
        reader.close()
    if not cuts:
        return 0
    try:
        for future in admin.delete_records(cuts, request_timeout=timeout,
                                           operation_timeout=timeout).values():
            future.result(timeout=timeout)
    except Exception as exc:
        raise ParticipantError(
            f"{p.describe()}: cannot delete the staged records of committed batches from "
            f"{topic!r}: {describe_error(exc)}; grant the sink's principal Delete on the "
            "topic (kafka-acls --operation Delete --topic ...) to prune them, else they "
            "leave with its retention") from exc
    return deleted


def _done_below(reader: Any, start: Any, high: int, ours: tuple[bytes, bytes], below: int,
                timeout: float) -> int:
    """The offset of ``start``'s partition before which every record was read and is
    ours and of a batch below ``below`` (``start.offset`` when the first is not)."""
    reader.assign([start])
    try:
        offset = int(start.offset)
        stalled = time.monotonic() + timeout
        while offset < high:
            msgs = reader.consume(min(1000, high - offset), 0.05)
            if not msgs:
                if time.monotonic() > stalled:
                    return offset  # what was read stands; the rest waits for the next prune
                continue
            stalled = time.monotonic() + timeout
            for msg in msgs:
                if msg.error() is not None:
                    return offset
                if not _done(msg.headers(), ours, below):
                    return int(msg.offset())
                offset = int(msg.offset()) + 1  # a gap below it held no record of anyone's
        return offset
    finally:
        reader.unassign()


def _done(headers: list[tuple[str, bytes]] | None, ours: tuple[bytes, bytes],
          below: int) -> bool:
    """A staged record of ``ours`` (sink, lineage) of a batch below ``below``."""
    h = dict(headers or ())
    batch = h.get("twophase.batch", b"")
    return ((h.get("twophase.sink"), h.get("twophase.lineage")) == ours
            and batch.isdigit() and int(batch) < below)
