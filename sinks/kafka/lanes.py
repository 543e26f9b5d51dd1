"""The staged prepare's copy lanes: the transactional producer that copies one branch's
staged records into the target topic, on a transactional id of the branch's own.

A branch's copies always use ``twophase.<sink>.<participant>.commit.p<partition>``
(:func:`copy_id`), whoever makes them (the driver, a restarted driver, ``twophase
resolve``, a Spark task's redo), so two copies of one branch fence each other: the
later ``init_transactions`` aborts the earlier copy's open transaction, and a copy
reads the branch's marker only after its own init (docs/kafka.md, "Staged prepare").
The ids are bounded by the partition count per (sink, participant), never by batches.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twophase.participant import BranchRef, ParticipantError
from twophase.sinks.kafka.clients import abandon, txn_producer
from twophase.sinks.kafka.config import common_config
from twophase.sinks.kafka.errors import describe_error
from twophase.sinks.kafka.lingering import COMMIT_LANE

if TYPE_CHECKING:
    from twophase.sinks.kafka.participant import KafkaParticipant

__all__ = ["Lane", "copy_id", "copying", "drop", "fence_lane", "ready", "retire", "using"]


@dataclass
class Lane:
    transactional_id: str
    producer: Any = None
    reader: Any = None


def copy_id(p: KafkaParticipant, branch: BranchRef) -> str:
    """The transactional id of every copy of ``branch``: one per partition of the sink."""
    return f"twophase.{branch.sink}.{p.name}.{COMMIT_LANE}p{branch.partition}"


_lock = threading.Lock()
_copying: Counter[str] = Counter()


@contextlib.contextmanager
def using(transactional_id: str) -> Iterator[None]:
    """Mark a copy of this process as running on ``transactional_id`` for the block."""
    with _lock:
        _copying[transactional_id] += 1
    try:
        yield
    finally:
        with _lock:
            _copying[transactional_id] -= 1
            if _copying[transactional_id] <= 0:
                del _copying[transactional_id]


def copying() -> set[str]:
    """The transactional ids copying in this process now (the start-up clean-up spares
    them: fencing one would only make its copy start again)."""
    with _lock:
        return set(_copying)


def fence_lane(p: KafkaParticipant, transactional_id: str) -> None:
    """Abort the copy a dead process left open on a lane (``twophase resolve``, a sink
    starting): a new producer of its id runs ``init_transactions``, so the broker writes
    the ABORT markers and releases the marker group's pending offsets (until then every
    stable read of the marker, a redo's first step, waits)."""
    lane = Lane(transactional_id)
    ready(p, lane, reader=False)
    retire(lane)


def ready(p: KafkaParticipant, lane: Lane, *, reader: bool = True) -> None:
    """The lane's producer, initialised (a new one fences every older one of the id), and
    its reader of the staging topic."""
    from confluent_kafka import Consumer, Producer

    if lane.producer is None:
        producer = txn_producer(Producer, p.producer_config(lane.transactional_id))
        try:
            producer.init_transactions(p.connect_timeout_s)
        except Exception as exc:
            raise ParticipantError(
                f"{p.describe()}: cannot initialise transactional.id "
                f"{lane.transactional_id!r} at {p.bootstrap}: {describe_error(exc)}") from exc
        lane.producer = producer
    if lane.reader is None and reader:
        lane.reader = Consumer({**common_config(p.config),
                                "group.id": "twophase.staged-reader",
                                "enable.auto.commit": False, "auto.offset.reset": "error",
                                "fetch.wait.max.ms": 10,  # the range is there: no long poll
                                "fetch.error.backoff.ms": 50,
                                "isolation.level": "read_committed"})


def drop(lane: Lane) -> None:
    """A lane whose producer failed: dropped, not closed (close waits on a fenced
    producer); the next use initialises a new one, which aborts what this one held."""
    if lane.producer is not None and getattr(lane.producer, "stuck", False):
        abandon(lane.producer)
    lane.producer = None
    if lane.reader is not None:
        with contextlib.suppress(Exception):
            lane.reader.close()
        lane.reader = None


def retire(lane: Lane) -> None:
    """An idle lane (no transaction open) that is not to be used again: closed."""
    with contextlib.suppress(Exception):
        lane.producer.close()
    lane.producer = None
    drop(lane)
