"""This process's Kafka clients kept between batches, and small value helpers.

Split out of :mod:`.participant` so the prepares (:mod:`.resumable`, :mod:`.staged`) and
:mod:`.legacy` share them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from twophase.errors import ParticipantError

__all__ = ["MARKER_CONSUMERS", "PRODUCERS", "STUCK_GRACE_S", "IdleClients", "abandon", "bounded",
           "close_process_clients", "healthy", "parse_offsets", "to_bytes", "txn_producer"]

STUCK_GRACE_S = 5.0
"""How long past its own timeout a librdkafka call may take before :func:`bounded` gives
up on it (its own timers fire late by up to a request timeout's tick)."""


class IdleClients:
    """Idle Kafka clients of this process, keyed by (settings, transactional.id or group).

    Only a producer whose last transaction was committed or aborted (or that never began
    one) is put here; taking one removes it, so two prepares never share a producer. At
    most ``limit`` are kept (the least recently used is dropped). A forked child does not
    use its parent's clients (librdkafka's threads do not survive a fork)."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._idle: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._pid = os.getpid()

    def _own(self) -> None:
        if self._pid != os.getpid():  # inherited through fork: unusable, never closed here
            self._idle, self._pid = OrderedDict(), os.getpid()

    def take(self, key: tuple[str, str]) -> Any:
        with self._lock:
            self._own()
            return self._idle.pop(key, None)

    def put(self, key: tuple[str, str], producer: Any) -> None:
        """Keep an idle producer; one it replaces or pushes out is dropped (released, not
        ``close()``d: close aborts an open transaction with no time limit and blocks on a
        fenced producer; an idle one has nothing to flush)."""
        with self._lock:
            self._own()
            self._idle.pop(key, None)
            self._idle[key] = producer
            while len(self._idle) > self.limit:
                self._idle.popitem(last=False)

    def drop(self, key: tuple[str, str]) -> None:
        self.take(key)

    def close_all(self) -> None:
        """Close every idle client (none has a transaction open), for a process that is
        done with its brokers: a test or tool stopping the broker it started, so the
        clients do not go on reconnecting to it."""
        with self._lock:
            self._own()
            idle, self._idle = list(self._idle.values()), OrderedDict()
        for client in idle:
            with contextlib.suppress(Exception):
                client.close()

    def __len__(self) -> int:
        with self._lock:
            self._own()
            return len(self._idle)


PRODUCERS = IdleClients()
"""This process's idle producers (see the module docstring)."""
MARKER_CONSUMERS = IdleClients()
"""This process's idle marker-group consumers: ``committed()`` asks the group coordinator
every time, so a cached consumer reads fresh offsets without reconnecting."""


def close_process_clients() -> None:
    """Close every Kafka client this process keeps between batches (idle producers and
    marker consumers, the staged path's producers and commit lanes): for a test or tool
    stopping a broker it started, so they do not go on reconnecting to it and logging it
    until the process exits."""
    from twophase.sinks.kafka import staged  # staged builds on this module

    PRODUCERS.close_all()
    MARKER_CONSUMERS.close_all()
    staged.close_all()


_PRODUCER_TYPES: dict[type, type] = {}


def txn_producer(base: type, config: Mapping[str, object]) -> Any:
    """A ``base`` (confluent_kafka's Producer) that keeps the errors librdkafka reports
    to its ``error_cb`` (a broker disconnect, all brokers down, ...) in
    ``broker_errors``; they are collected whenever its events are served (poll, flush,
    the transactional calls)."""
    kind = _PRODUCER_TYPES.get(base)
    if kind is None:
        kind = _PRODUCER_TYPES[base] = type("TxnProducer", (base,), {})
    errors: list[str] = []

    def note(err: Any) -> None:
        errors.append(f"{err.name()}: {err.str()}")

    producer = kind({**config, "error_cb": note})
    producer.broker_errors = errors
    return producer


def healthy(producer: Any) -> bool:
    """No broker error since the producer was created (its pending events served
    first): only such a producer is kept for the next batch. A producer that lived
    through a broker restart (disconnects while idle) is not: librdkafka's cached
    group coordinator can block ``send_offsets_to_transaction`` past its timeout
    (confluentinc/librdkafka#5456, #5511), seen as a 9-minute hang after a tansu
    restart (docs/kafka.md, "Producer reuse")."""
    with contextlib.suppress(Exception):
        producer.poll(0)
    return not getattr(producer, "broker_errors", ())


def bounded(client: Any, method: str, timeout: float, what: str, *args: Any,
            grace: float = STUCK_GRACE_S) -> Any:
    """``client.<method>(*args)``, given ``timeout`` + ``grace`` to return:
    some librdkafka calls do not enforce their own timeout (``send_offsets_to_transaction``
    waiting on a group coordinator it cached before a broker restart,
    confluentinc/librdkafka#5456). A call that does not return is left running in its
    thread, the client is marked ``stuck`` (the caller abandons it and fences its
    transactional.id), and a ParticipantError names the cause."""
    out: list[Any] = []
    failed: list[BaseException] = []

    def call() -> None:
        try:
            out.append(getattr(client, method)(*args))
        except BaseException as exc:  # handed to the caller
            failed.append(exc)

    worker = threading.Thread(target=call, name=f"twophase-{method}", daemon=True)
    worker.start()
    worker.join(timeout + grace)
    if worker.is_alive():
        client.stuck = True
        raise ParticipantError(
            f"{what}: librdkafka's {method} did not return within "
            f"{timeout + grace:g}s although its timeout is {timeout:g}s (it waits on "
            "a coordinator it cached before the broker went away, "
            "confluentinc/librdkafka#5456); the producer is abandoned and its "
            "transactional.id fenced, so its open transaction does not hold the marker "
            "group until the broker's transaction timeout; if this repeats, check the "
            "broker is up and reachable")
    if failed:
        raise failed[0]
    return out[0] if out else None


_STUCK: list[Any] = []
"""Clients left blocked in a librdkafka call (:func:`bounded`): kept referenced, so no
thread ever runs their destructor, which would wait on the blocked call."""


def abandon(client: Any) -> None:
    """Give up on a ``stuck`` client for good: never closed, never dropped (see
    :data:`_STUCK`); the caller fences its transactional.id."""
    if not any(c is client for c in _STUCK):
        _STUCK.append(client)


def parse_offsets(text: str) -> dict[int, int]:
    """``"0:12,3:40"`` (a handle's ``offsets``) -> {0: 12, 3: 40}; anything else -> {}."""
    out: dict[int, int] = {}
    for item in text.split(","):
        p, sep, o = item.partition(":")
        if not (sep and p.isdigit() and o.isdigit()):
            return {}
        out[int(p)] = int(o)
    return out


def to_bytes(v: object) -> bytes | None:
    if v is None:
        return None
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode("utf-8")
    return str(v).encode("ascii")
