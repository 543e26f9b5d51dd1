"""A branch's transactional producer: made and initialised, kept for the next batch, or
closed without hanging.

Producers are **reused** by the next batch in the same process (``reuse_clients``, Spark
reuses its Python workers): once a producer's transaction is committed or aborted it
waits in :data:`~.clients.PRODUCERS` keyed by (settings, transactional.id), and the next
use of that id (a fence of a lingering or a 0.3 in-task branch, :mod:`.legacy`) takes it
instead of creating a producer and running ``init_transactions``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from twophase.participant import BranchRef, PrepareRefused
from twophase.sinks.kafka.clients import PRODUCERS, abandon, healthy, txn_producer
from twophase.sinks.kafka.errors import describe_error, kafka_error

if TYPE_CHECKING:
    from twophase.sinks.kafka.participant import KafkaParticipant

__all__ = ["cache_key", "discard", "new_producer", "release"]


def cache_key(p: KafkaParticipant, branch: BranchRef) -> tuple[str, str]:
    """The key of the branch's idle producer in :data:`~.clients.PRODUCERS`."""
    tid = p.transactional_id(branch)
    return json.dumps(p.producer_config(tid), sort_keys=True, default=str), tid


def release(p: KafkaParticipant, branch: BranchRef, producer: Any) -> None:
    """A producer with no open transaction goes back to the cache for the next batch
    (``reuse_clients``) if it never saw a broker error, or is closed (it has no
    transaction to wait for)."""
    if p.reuse_clients and healthy(producer):
        PRODUCERS.put(cache_key(p, branch), producer)
    else:
        producer.close()


def new_producer(p: KafkaParticipant, branch: BranchRef) -> Any:
    """A producer for the branch's transactional.id, initialised: zombies are fenced."""
    from confluent_kafka import Producer

    tid = p.transactional_id(branch)
    cfg = p.producer_config(tid)
    producer = txn_producer(Producer, cfg) if p.reuse_clients else Producer(cfg)
    try:
        producer.init_transactions(p.connect_timeout_s)
    except Exception as exc:
        err = kafka_error(exc)
        hint = ""
        if err is not None and err.name() == "INVALID_TRANSACTION_TIMEOUT":
            hint = (
                f" (transaction_timeout_ms={p.transaction_timeout_ms} exceeds the "
                "broker's transaction.max.timeout.ms)"
            )
        raise PrepareRefused(
            f"{p.describe()}: cannot initialise transactional.id {tid!r} at "
            f"{p.bootstrap} within {p.connect_timeout_s:g}s: {describe_error(exc)}{hint}"
        ) from exc
    return producer


def discard(p: KafkaParticipant, producer: Any) -> None:
    """Close a producer without hanging. ``Producer.close()`` aborts an open
    transaction first and waits for that abort without a bound, forever on a broker
    that drops a fenced producer's requests (tansu). So abort within
    ``connect_timeout_s`` first; only a producer left with no transaction is closed,
    any other is just dropped (librdkafka's destructor does not wait; the broker, or
    the next ``init_transactions`` of the transactional.id, aborts what it held). A
    producer left ``stuck`` in a call (:func:`~.clients.bounded`) is abandoned."""
    from confluent_kafka import KafkaError

    if getattr(producer, "stuck", False):  # blocked in a call: any other call is refused
        abandon(producer)
        return
    try:
        producer.abort_transaction(p.connect_timeout_s)
    except Exception as exc:
        err = kafka_error(exc)
        if err is None or err.code() != KafkaError._STATE:  # _STATE: no transaction
            return
    producer.close()
