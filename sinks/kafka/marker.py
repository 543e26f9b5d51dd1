"""A branch's idempotency marker: the committed offset of its marker group on (topic, 0).

Both prepares use it (:mod:`.resumable`, :mod:`.staged`): the marker offset
``batch_id + 1`` is sent inside the branch's transaction, so it becomes visible exactly
when the rows do, and a branch whose marker reads committed is never written again.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from twophase.participant import BranchRef, ParticipantError
from twophase.sinks.kafka.clients import MARKER_CONSUMERS, bounded
from twophase.sinks.kafka.config import common_config
from twophase.sinks.kafka.errors import COORDINATOR_MOVES, describe_error, kafka_error

if TYPE_CHECKING:
    from twophase.sinks.kafka.participant import KafkaParticipant

__all__ = ["add_marker", "committed_marker", "held_consumer", "marker_config",
           "marker_consumer", "marker_done", "marker_key", "read_marker", "read_marker_now"]


def marker_config(p: KafkaParticipant, group: str) -> dict[str, object]:
    cfg = common_config(p.config)
    cfg.update(
        {
            "group.id": group,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    return cfg


def marker_key(p: KafkaParticipant, group: str) -> tuple[str, str]:
    """The key of a marker consumer in :data:`~.clients.MARKER_CONSUMERS`."""
    return json.dumps(marker_config(p, group), sort_keys=True, default=str), group


def marker_consumer(p: KafkaParticipant, group: str) -> Any:
    """The marker group's consumer: this process's idle one if a batch before left
    it (no subscription, only ``committed()`` and its group metadata are used), else
    a new one. Give it back with :func:`marker_done`."""
    from confluent_kafka import Consumer

    cached = MARKER_CONSUMERS.take(marker_key(p, group)) if p.reuse_clients else None
    return cached if cached is not None else Consumer(marker_config(p, group))


def marker_done(p: KafkaParticipant, group: str, consumer: Any, healthy: bool = True) -> None:
    """Keep a healthy consumer for the next batch (``reuse_clients``), else close it."""
    if healthy and p.reuse_clients:
        MARKER_CONSUMERS.put(marker_key(p, group), consumer)
    else:
        consumer.close()


@contextlib.contextmanager
def held_consumer(p: KafkaParticipant, branch: BranchRef) -> Iterator[Any]:
    """The branch's marker consumer for the block: given back when the block ends
    normally, closed when it raises (its state is then unknown)."""
    group = p.marker_group(branch)
    consumer = marker_consumer(p, group)
    ok = False
    try:
        yield consumer
        ok = True
    finally:
        marker_done(p, group, consumer, ok)


def read_marker(p: KafkaParticipant, branch: BranchRef) -> int:
    """The branch's committed marker offset (-1 when none), on a held consumer."""
    with held_consumer(p, branch) as consumer:
        return committed_marker(p, consumer, branch)


def read_marker_now(p: KafkaParticipant, branch: BranchRef) -> int:
    """The branch's committed marker offset (-1 when none) without waiting on a
    transaction open on its group: ``OffsetFetch`` on Kafka's wire (:mod:`.txnwire`, a
    few milliseconds), or, with security settings the wire reader cannot use, a
    ``read_uncommitted`` consumer (~50 ms: a new client per read); neither counts a
    pending transactional commit."""
    from confluent_kafka import Consumer

    from twophase.sinks.kafka.brokerconn import unsupported
    from twophase.sinks.kafka.txnwire import TxnWireError, committed_offset

    group = p.marker_group(branch)
    config = common_config(p.config)
    if unsupported(config) is None:
        try:
            return committed_offset(config, group, p.topic, 0, p.connect_timeout_s)
        except TxnWireError as exc:
            raise ParticipantError(
                f"{p.describe()}: cannot read marker group {group!r} at {p.bootstrap}: "
                f"{exc}") from exc
    loose = Consumer({**marker_config(p, group), "isolation.level": "read_uncommitted"})
    try:
        return committed_marker(p, loose, branch)
    finally:
        loose.close()


def committed_marker(
    p: KafkaParticipant, consumer: Any, branch: BranchRef, pending_wait_s: float | None = None
) -> int:
    """The marker group's committed offset on (topic, 0); -1 when none. A group
    coordinator that is loading or moved (a fresh or restarted broker, a failover:
    NOT_COORDINATOR, COORDINATOR_LOAD_IN_PROGRESS) is asked again until
    ``connect_timeout_s``; librdkafka's ``committed()`` does not retry those.

    A ``read_committed`` consumer asks for stable offsets (KIP-447): Kafka answers
    only once no transaction holding offsets of the group is open, so while one is,
    librdkafka retries until its timeout. ``pending_wait_s``: wait that long, then
    answer -1 (the open transaction's offset is not committed)."""
    from confluent_kafka import TopicPartition

    wait = p.connect_timeout_s if pending_wait_s is None else pending_wait_s
    deadline = time.monotonic() + p.connect_timeout_s
    while True:
        try:
            [tp] = consumer.committed([TopicPartition(p.topic, 0)], timeout=wait)
            break
        except Exception as exc:
            err = kafka_error(exc)
            if (err is not None and err.name() in COORDINATOR_MOVES
                    and time.monotonic() < deadline):
                time.sleep(0.1)
                continue
            if pending_wait_s is not None and err is not None \
                    and err.name() == "_TIMED_OUT":
                return -1
            hint = ("; a transaction left open on the broker by a process that died "
                    "mid-commit holds this group's offsets until it ends: `twophase "
                    f"resolve {branch.sink}` aborts it (the broker does after "
                    "transaction.timeout.ms)"
                    if err is not None and err.name() == "_TIMED_OUT" else "")
            raise ParticipantError(
                f"{p.describe()}: cannot read marker group "
                f"{p.marker_group(branch)!r} at {p.bootstrap}: "
                f"{describe_error(exc)}{hint}"
            ) from exc
    if tp.error is not None:
        raise ParticipantError(
            f"{p.describe()}: cannot read marker group {p.marker_group(branch)!r}: "
            f"{tp.error}"
        )
    return int(tp.offset) if tp.offset is not None and tp.offset >= 0 else -1


def add_marker(p: KafkaParticipant, producer: Any, consumer: Any, branch: BranchRef,
               what: str) -> None:
    """Send the marker offset into ``producer``'s open transaction, bounded: librdkafka
    does not enforce this call's timeout when the group coordinator it has cached went
    away (confluentinc/librdkafka#5456, #5511), so it is given ``connect_timeout_s`` plus
    a grace, then the producer is marked ``stuck`` and a ParticipantError raised
    (:func:`~.clients.bounded`); the caller abandons it and fences its transactional.id."""
    from confluent_kafka import TopicPartition

    bounded(producer, "send_offsets_to_transaction", p.connect_timeout_s,
            f"{p.describe()}: {what}: cannot add the marker offset to the transaction at "
            f"{p.bootstrap}", [TopicPartition(p.topic, 0, branch.batch_id + 1)],
            consumer.consumer_group_metadata(), p.connect_timeout_s)
