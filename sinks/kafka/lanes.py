"""The staged prepare's commit lanes: transactional producers that copy staged records
into the target topic, pooled per process and (settings, sink, participant).

Each lane is one transactional id, ``twophase.<sink>.<participant>.commit<i>``, with its
producer and a reader of the staging topic; :data:`COMMIT_IDS` of them per pool, all
initialised when a process first commits, so a copy a dead process left open is aborted
(``init_transactions`` fences it) before any copy of this one reads a marker.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from twophase.participant import ParticipantError
from twophase.sinks.kafka.clients import abandon, txn_producer
from twophase.sinks.kafka.config import common_config
from twophase.sinks.kafka.errors import describe_error
from twophase.sinks.kafka.lingering import COMMIT_LANE

if TYPE_CHECKING:
    from twophase.sinks.kafka.participant import KafkaParticipant

__all__ = ["COMMIT_IDS", "POOL", "CommitPool", "Lane", "drop", "fence_lane", "ready", "retire"]

COMMIT_IDS: Final = 8
"""Transactional ids per (sink, participant) for the copies: as many as the driver's
commit threads (``twophase.commit.COMMIT_THREADS``), so no copy waits for an id."""


@dataclass
class Lane:
    transactional_id: str
    producer: Any = None
    reader: Any = None


class CommitPool:
    """Per process and (settings, sink, participant): :data:`COMMIT_IDS` transactional
    producers with stable ids. The first use initialises every id, which aborts any copy
    a dead process left open on it (its marker offsets would otherwise hold stable reads
    of the marker until the broker's transaction timeout)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._free: dict[str, list[Lane]] = {}
        self._busy: set[str] = set()  # transactional ids of the lanes copying now
        self._pid = os.getpid()

    def take(self, p: KafkaParticipant, sink: str) -> tuple[str, Lane]:
        key = json.dumps([p.config, sink, p.name, p.transaction_timeout_ms],
                         sort_keys=True, default=str)
        with self._cond:
            if self._pid != os.getpid():
                self._free, self._busy, self._pid = {}, set(), os.getpid()
            fresh = key not in self._free
            if fresh:
                self._free[key] = [Lane(f"twophase.{sink}.{p.name}.{COMMIT_LANE}{i}")
                                   for i in range(COMMIT_IDS)]
            while not self._free[key]:
                self._cond.wait()
            lane = self._free[key].pop()
            self._busy.add(lane.transactional_id)
            fence, self._free[key] = (self._free[key], []) if fresh else ([], self._free[key])
        if fence:  # never used in this process: initialise (fence) them all, at once,
            # out of the free list (a lane initialised twice fences its own producer)
            threads = [threading.Thread(target=_fence, args=(p, other), daemon=True)
                       for other in fence]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            with self._cond:
                self._free[key].extend(fence)
                self._cond.notify_all()
        return key, lane

    def give(self, key: str, lane: Lane) -> None:
        with self._cond:
            self._busy.discard(lane.transactional_id)
            self._free.setdefault(key, []).append(lane)
            self._cond.notify()

    def busy(self) -> set[str]:
        """The transactional ids copying in this process now (never fenced from here)."""
        with self._cond:
            return set(self._busy)

    def forget(self, transactional_id: str) -> None:
        """An idle lane of this id is about to be fenced from outside the pool: its
        clients are dropped, so its next use initialises a new producer."""
        with self._cond:
            for free in self._free.values():
                for lane in free:
                    if lane.transactional_id == transactional_id:
                        drop(lane)

    def close_all(self) -> None:
        """Close every idle lane's clients (none has a transaction open)."""
        with self._cond:
            lanes = [lane for free in self._free.values() for lane in free]
            self._free = {}
        for lane in lanes:
            with contextlib.suppress(Exception):
                if lane.producer is not None:
                    lane.producer.close()
            lane.producer = None
            drop(lane)




POOL = CommitPool()


def fence_lane(p: KafkaParticipant, transactional_id: str) -> None:
    """Abort the copy a dead process left open on a lane (``twophase resolve``, a sink
    starting): a new producer of its id runs ``init_transactions``, so the broker writes
    the ABORT markers and releases the marker group's pending offsets (until then every
    stable read of the marker, a redo's first step, waits)."""
    POOL.forget(transactional_id)
    lane = Lane(transactional_id)
    ready(p, lane, reader=False)
    with contextlib.suppress(Exception):
        lane.producer.close()


def _fence(p: KafkaParticipant, lane: Lane) -> None:
    with contextlib.suppress(Exception):  # a failure here is met again when the lane is used
        ready(p, lane, reader=False)


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
