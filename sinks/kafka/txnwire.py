"""A Kafka transaction ended by another process: FindCoordinator, DescribeTransactions and
EndTxn on Kafka's wire, over the log reader's secured connection (:mod:`.brokerconn`).

Why by hand: librdkafka ends only the transactions of its own producer instance (it has
neither KIP-939 nor a resume), but the broker's ``EndTxn`` is a plain request keyed by
(transactional id, producer id, epoch) that any connection may send, as Flink's KafkaSink
committer does. kafka-python's protocol classes (a dependency already) encode and decode
the requests; nothing else of kafka-python's client is used.

Versions: ``EndTxn`` v3 (below v5: librdkafka runs transaction version 1, no KIP-890
epoch bump, so the epoch the task wrote with is the one that ends it), ``FindCoordinator``
v3 (key type 1: a transaction coordinator), ``DescribeTransactions`` v0 (Kafka 3.0+).
"""

from __future__ import annotations

import itertools
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from twophase.errors import ParticipantError
from twophase.sinks.kafka.brokerconn import connect, recv_exact

__all__ = ["COORDINATOR_MOVED", "TxnState", "TxnWireError", "committed_offset",
           "describe_transaction", "end_transaction", "find_coordinator"]

END_TXN_VERSION: Final = 3
OFFSET_FETCH_VERSION: Final = 5  # no require_stable (v7): pending offsets never wait
GROUP: Final = 0
TRANSACTION: Final = 1
"""FindCoordinator's key types."""
FIND_COORDINATOR_VERSION: Final = 3
DESCRIBE_TRANSACTIONS_VERSION: Final = 0
_CLIENT_ID: Final = "twophase-txn"
# Kafka error codes (org.apache.kafka.common.protocol.Errors)
ERROR_NAMES: Final = {
    0: "NONE", 7: "REQUEST_TIMED_OUT", 14: "COORDINATOR_LOAD_IN_PROGRESS",
    15: "COORDINATOR_NOT_AVAILABLE", 16: "NOT_COORDINATOR", 47: "INVALID_PRODUCER_EPOCH",
    48: "INVALID_TXN_STATE", 49: "INVALID_PRODUCER_ID_MAPPING", 51: "CONCURRENT_TRANSACTIONS",
    53: "TRANSACTIONAL_ID_AUTHORIZATION_FAILED", 90: "PRODUCER_FENCED",
    105: "TRANSACTIONAL_ID_NOT_FOUND", 31: "CLUSTER_AUTHORIZATION_FAILED",
    30: "GROUP_AUTHORIZATION_FAILED", 29: "TOPIC_AUTHORIZATION_FAILED",
    3: "UNKNOWN_TOPIC_OR_PARTITION",
}
COORDINATOR_MOVED: Final = frozenset({"NOT_COORDINATOR", "COORDINATOR_NOT_AVAILABLE",
                                      "COORDINATOR_LOAD_IN_PROGRESS"})
"""Answers that mean: ask FindCoordinator again (a failover, a broker starting)."""
RETRIABLE: Final = COORDINATOR_MOVED | {"CONCURRENT_TRANSACTIONS", "REQUEST_TIMED_OUT"}
_correlations = itertools.count(1)


class TxnWireError(ParticipantError):
    """A broker answered an error code (``name``) or could not be reached (``name`` is
    ``"NETWORK"``)."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class TxnState:
    """One transactional id as its coordinator describes it."""

    state: str  # Ongoing, PrepareCommit, CompleteCommit, PrepareAbort, CompleteAbort, Empty
    producer_id: int
    producer_epoch: int
    partitions: tuple[str, ...]  # "topic-partition", sorted


def _error_name(code: int) -> str:
    return ERROR_NAMES.get(code, f"error code {code}")


def _exchange(sock: socket.socket, request: Any, version: int, response_class: Any) -> Any:
    correlation = next(_correlations) & 0x7FFFFFFF
    request.API_VERSION = version
    request.with_header(correlation_id=correlation, client_id=_CLIENT_ID)
    sock.sendall(request.encode(header=True, framed=True))
    (size,) = struct.unpack(">i", recv_exact(sock, 4))
    data = recv_exact(sock, size)
    if struct.unpack_from(">i", data)[0] != correlation:
        raise TxnWireError("Kafka answer out of order", "NETWORK")
    return response_class.decode(data, version=version, header=True)


def _hosts(config: Mapping[str, object]) -> list[tuple[str, int]]:
    out = []
    for item in str(config["bootstrap.servers"]).split(","):
        host, _, port = item.strip().rpartition(":")
        out.append((host.strip("[]") or "localhost", int(port or 9092)))
    return out


def _ask(host: str, port: int, config: Mapping[str, object], timeout: float,
         request: Any, version: int, response_class: Any) -> Any:
    try:
        with connect(host, port, config, timeout) as sock:
            return _exchange(sock, request, version, response_class)
    except OSError as exc:
        raise TxnWireError(f"cannot reach Kafka at {host}:{port}: {exc}", "NETWORK") from exc


def find_coordinator(config: Mapping[str, object], transactional_id: str,
                     timeout: float, key_type: int = TRANSACTION) -> tuple[str, int]:
    """(host, port) of the transaction coordinator of ``transactional_id`` (with
    ``key_type=GROUP``: of the consumer group so named), asked of the bootstrap servers
    in turn."""
    from kafka.protocol.metadata.find_coordinator import (
        FindCoordinatorRequest,
        FindCoordinatorResponse,
    )

    last: TxnWireError | None = None
    for host, port in _hosts(config):
        try:
            answer = _ask(host, port, config, timeout,
                          FindCoordinatorRequest(key=transactional_id, key_type=key_type),
                          FIND_COORDINATOR_VERSION, FindCoordinatorResponse)
        except TxnWireError as exc:
            last = exc
            continue
        if answer.error_code:
            last = TxnWireError(
                f"FindCoordinator for {'group' if key_type == GROUP else 'transactional id'}"
                f" {transactional_id!r} at {host}:{port} "
                f"answered {_error_name(answer.error_code)}", _error_name(answer.error_code))
            continue
        return str(answer.host), int(answer.port)
    assert last is not None
    raise last


def _coordinated(config: Mapping[str, object], transactional_id: str, timeout: float,
                 request: Any, version: int, response_class: Any,
                 error_of: Any, key_type: int = TRANSACTION) -> Any:
    """Send ``request`` to the id's (or group's) coordinator, asking again where it
    moved (a failover, a broker starting) until ``timeout``; other errors are for the
    caller."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            host, port = find_coordinator(config, transactional_id, timeout, key_type)
            answer = _ask(host, port, config, timeout, request, version, response_class)
            name = _error_name(error_of(answer))
        except TxnWireError as exc:
            if exc.name not in COORDINATOR_MOVED | {"NETWORK"} \
                    or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        if name in COORDINATOR_MOVED and time.monotonic() < deadline:
            time.sleep(0.2)
            continue
        return answer


def describe_transaction(config: Mapping[str, object], transactional_id: str,
                         timeout: float) -> TxnState | None:
    """The id's state on its coordinator; None when the broker does not know the id."""
    from kafka.protocol.admin.transactions import (
        DescribeTransactionsRequest,
        DescribeTransactionsResponse,
    )

    def error_of(answer: Any) -> int:
        return int(answer.transaction_states[0].error_code)

    answer = _coordinated(
        config, transactional_id, timeout,
        DescribeTransactionsRequest(transactional_ids=[transactional_id]),
        DESCRIBE_TRANSACTIONS_VERSION, DescribeTransactionsResponse, error_of)
    [found] = answer.transaction_states
    name = _error_name(found.error_code)
    if name == "TRANSACTIONAL_ID_NOT_FOUND":
        return None
    if found.error_code:
        raise TxnWireError(f"DescribeTransactions of {transactional_id!r} answered {name}"
                           + (" (the principal needs Describe on the transactional id)"
                              if "AUTHORIZATION" in name else ""), name)
    parts = tuple(sorted(f"{t.topic}-{p}" for t in found.topics for p in t.partitions))
    return TxnState(str(found.transaction_state), int(found.producer_id),
                    int(found.producer_epoch), parts)


def end_transaction(config: Mapping[str, object], transactional_id: str, producer_id: int,
                    producer_epoch: int, *, commit: bool, timeout: float,
                    settle: bool = True) -> str:
    """Send ``EndTxn`` for (id, producer id, epoch) to its coordinator; returns the
    answer's error name (``"NONE"`` on success). Coordinator moves are asked again until
    ``timeout``; every other answer is the caller's to classify.

    ``settle``: on success, ask the coordinator (same connection) until the transaction
    shows complete: Kafka answers ``EndTxn`` once its decision is logged and writes the
    partitions' markers after, so a reader right after the answer could still see the
    transaction open."""
    from kafka.protocol.admin.transactions import (
        DescribeTransactionsRequest,
        DescribeTransactionsResponse,
    )
    from kafka.protocol.producer.transaction import EndTxnRequest, EndTxnResponse

    deadline = time.monotonic() + timeout
    while True:
        try:
            host, port = find_coordinator(config, transactional_id, timeout)
            with connect(host, port, config, timeout) as sock:
                answer = _exchange(sock, EndTxnRequest(
                    transactional_id=transactional_id, producer_id=producer_id,
                    producer_epoch=producer_epoch, committed=commit),
                    END_TXN_VERSION, EndTxnResponse)
                name = _error_name(int(answer.error_code))
                while name == "NONE" and settle and time.monotonic() < deadline:
                    described = _exchange(
                        sock, DescribeTransactionsRequest(transactional_ids=[transactional_id]),
                        DESCRIBE_TRANSACTIONS_VERSION, DescribeTransactionsResponse)
                    [found] = described.transaction_states
                    if found.error_code or str(found.transaction_state) not in (
                            "PrepareCommit", "PrepareAbort", "Ongoing"):
                        break
                    time.sleep(0.01)
        except OSError as exc:
            name = "NETWORK"
            if time.monotonic() > deadline:
                raise TxnWireError(f"cannot reach the transaction coordinator of "
                                   f"{transactional_id!r}: {exc}", name) from exc
        except TxnWireError as exc:
            if exc.name not in COORDINATOR_MOVED | {"NETWORK"} \
                    or time.monotonic() > deadline:
                raise
            name = exc.name
        if name in COORDINATOR_MOVED | {"NETWORK"} and time.monotonic() < deadline:
            time.sleep(0.2)
            continue
        return name


def committed_offset(config: Mapping[str, object], group: str, topic: str, partition: int,
                     timeout: float) -> int:
    """``group``'s committed offset of (``topic``, ``partition``), -1 when none, from its
    coordinator (``OffsetFetch`` v5): only committed offsets, never waiting on a
    transaction that holds the group's offsets open (the stable read of v7+ would). One
    connection per call: a new consumer for the same read costs ~50 ms."""
    from kafka.protocol.consumer.group import OffsetFetchRequest, OffsetFetchResponse

    request = OffsetFetchRequest(group_id=group, topics=[
        OffsetFetchRequest.OffsetFetchRequestTopic(name=topic, partition_indexes=[partition])])

    def error_of(answer: Any) -> int:
        return int(answer.error_code)

    answer = _coordinated(config, group, timeout, request, OFFSET_FETCH_VERSION,
                          OffsetFetchResponse, error_of, key_type=GROUP)
    codes = [int(answer.error_code)] + [int(q.error_code) for t in answer.topics
                                        for q in t.partitions]
    bad = next((c for c in codes if c), 0)
    if bad:
        name = _error_name(bad)
        raise TxnWireError(f"OffsetFetch of group {group!r} answered {name}"
                           + (" (the principal needs Describe on the group and the topic)"
                              if "AUTHORIZATION" in name else ""), name)
    for t in answer.topics:
        for q in t.partitions:
            if t.name == topic and int(q.partition_index) == partition:
                return max(int(q.committed_offset), -1)
    return -1
