"""A topic's committed records rebuilt from its partition logs, for the verifier.

Why: a ``read_committed`` consumer is only as good as the broker's read isolation, and
tansu (the broker the tests run) shows aborted and open records to such readers. Every
broker, tansu included, writes the transaction control batches (COMMIT / ABORT markers)
into each partition's log, and a raw Fetch returns every record batch with its
attributes. So this module fetches each partition from offset 0 to the high watermark
and applies Kafka's own rule (see :func:`replay`):

- a non-transactional data batch is visible at once;
- a producer's transactional batches on a partition become visible at its next COMMIT
  marker on that partition and are discarded at an ABORT marker;
- batches still pending at the end of the log belong to an open transaction.

Record batches are decoded with kafka-python's maintained record module (format v2,
control batches, every compression codec it supports). The Fetch itself is a plain
Fetch v4 request (``read_uncommitted``, so control batches come back) on a connection to
each partition's leader secured as the user's settings say (TLS, SASL PLAIN or SCRAM:
:mod:`.brokerconn`); the partition leaders come from a confluent-kafka metadata request.

Two users: the verifier (:func:`read_log`, :func:`judge_log`) and the Kafka participant's
redo (:func:`read_branch`), which asks the log whether a branch's records were committed
before writing them again: the committed-offset marker alone is not enough on a broker
that applies a transaction's offset commit late (tansu, see ``docs/kafka.md``).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from twophase.errors import ParticipantError
from twophase.participant import ReadBack
from twophase.sinks.kafka.brokerconn import connect, recv_exact, request_header

__all__ = [
    "BranchInLog", "LogBatch", "LostMarker", "OpenTxn", "PartitionLog", "TopicLog",
    "count_tagged", "decode_batches", "fetch_partition", "judge_log", "read_branch",
    "read_log", "replay", "settle_lost_markers",
]

_FETCH = 1
_FETCH_VERSION = 4  # isolation level + record batch v2; no tagged fields
_MAX_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class LogBatch:
    """One record batch as the log holds it (what :func:`replay` needs)."""

    offset: int
    producer_id: int
    producer_epoch: int
    transactional: bool
    control: bool
    values: tuple[bytes | None, ...] = ()  # data batch: the record values
    commit: bool = False  # control batch: COMMIT (True) or ABORT (False)
    next_offset: int = 0  # the offset after this batch
    tag: tuple[tuple[str, bytes], ...] = ()  # data batch: its first record's headers


@dataclass(frozen=True)
class OpenTxn:
    """Where a producer's still-open transaction sits in a partition."""

    producer_id: int
    epochs: tuple[int, ...]  # the producer epochs of its batches
    first_offset: int
    end_offset: int  # the offset after its last batch


@dataclass
class PartitionLog:
    """One partition's records, sorted by what Kafka's rule makes of them."""

    partition: int
    high_watermark: int = 0
    committed: list[bytes | None] = field(default_factory=list)
    aborted: list[bytes | None] = field(default_factory=list)
    # producer id -> records of its transaction still open at the end of the log
    open: dict[int, list[bytes | None]] = field(default_factory=dict)
    open_txns: dict[int, OpenTxn] = field(default_factory=dict)
    # [start, end) offset ranges below the high watermark that hold no batch: on a
    # broker that reserves an offset before it writes the batch (tansu), a write cut
    # by a crash (see settle_lost_markers)
    gaps: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class TopicLog:
    topic: str
    partitions: list[PartitionLog]
    cluster_id: str | None = None  # the broker's, as its metadata reports it

    @property
    def committed(self) -> list[bytes | None]:
        return [v for p in self.partitions for v in p.committed]

    @property
    def aborted(self) -> list[bytes | None]:
        return [v for p in self.partitions for v in p.aborted]

    @property
    def open_transactions(self) -> int:
        """Open (producer, partition) transactions at the end of the logs."""
        return sum(len(p.open) for p in self.partitions)

    @property
    def open_records(self) -> int:
        return sum(len(r) for p in self.partitions for r in p.open.values())


def replay(partition: int, batches: Iterable[LogBatch], high_watermark: int = 0) -> PartitionLog:
    """Kafka's visibility rule over one partition's batches, in log order.

    A control marker settles every pending batch of its producer id: a fenced producer's
    open transaction is aborted by a marker carrying the newer epoch, so the epoch is not
    compared. A transactional data batch arriving after its producer's transaction was
    settled starts a new transaction.
    """
    out = PartitionLog(partition, high_watermark)
    pending: dict[int, list[bytes | None]] = {}
    where: dict[int, list[LogBatch]] = {}
    end: int | None = None
    for b in batches:
        if end is not None and b.offset > end:
            out.gaps.append((end, b.offset))
        end = max(end or 0, b.next_offset)
        if b.control:
            done = pending.pop(b.producer_id, [])
            where.pop(b.producer_id, None)
            (out.committed if b.commit else out.aborted).extend(done)
        elif b.transactional:
            pending.setdefault(b.producer_id, []).extend(b.values)
            where.setdefault(b.producer_id, []).append(b)
        else:
            out.committed.extend(b.values)
    if end is not None and high_watermark > end:
        out.gaps.append((end, high_watermark))
    out.open = {pid: vals for pid, vals in pending.items()}
    out.open_txns = {
        pid: OpenTxn(pid, tuple(sorted({b.producer_epoch for b in bs})), bs[0].offset,
                     bs[-1].next_offset)
        for pid, bs in where.items()
    }
    return out


@dataclass(frozen=True)
class LostMarker:
    """An open transaction settled from the broker's own transaction state."""

    partition: int
    producer_id: int
    producer_epoch: int
    first_offset: int
    end_offset: int
    rows: int
    committed: bool
    gap: tuple[int, int] | None  # reserved offsets after it that never got their batch

    def describe(self) -> str:
        where = (f"marker offset(s) {self.gap[0]}..{self.gap[1] - 1} reserved but never "
                 "written" if self.gap else "no marker offset reserved after it")
        return (f"partition {self.partition}: {self.rows} rows of producer "
                f"{self.producer_id} epoch {self.producer_epoch} at offsets "
                f"{self.first_offset}..{self.end_offset - 1}, {where}, "
                f"{'COMMITTED' if self.committed else 'ABORTED'} by the broker's "
                "transaction state")


def settle_lost_markers(
    log: TopicLog, outcomes: Mapping[tuple[int, int], bool]
) -> tuple[TopicLog, list[LostMarker]]:
    """The log with the open transactions whose control markers a broker crash lost
    settled by the broker's own record of their outcome.

    Why: tansu (0.6.0, dynostore) ends a transaction in three steps: it stores
    ``PrepareCommit``/``PrepareAbort``, writes each partition's marker in turn
    (reserving the offset in the watermark first, then writing the batch), then stores
    the outcome. Killed in between, it leaves the transaction's records without markers
    (the partition being written keeps a reserved, empty offset; the ones not reached
    yet keep nothing), and the producer's retried ``EndTxn`` (the state is no longer
    ``Begin``) writes no marker but answers success. Kafka's coordinator completes the
    markers of a decided transaction after a crash; tansu never does.

    ``outcomes`` maps (producer id, epoch) to the outcome the broker's transaction
    coordinator recorded (True: commit decided, False: abort decided); a transaction
    the broker still has open (``Begin``) is not in it. An open transaction is settled
    only when all its batches have one epoch and that epoch has a recorded outcome; any
    other stays open: a transaction that is really open is never hidden. Exact when an
    epoch holds one transaction (a new producer per transaction, the participant's
    default): the broker keeps one state per epoch.
    """
    lost: list[LostMarker] = []
    parts: list[PartitionLog] = []
    for part in log.partitions:
        new = dataclasses.replace(part, committed=list(part.committed),
                                  aborted=list(part.aborted), open=dict(part.open),
                                  open_txns=dict(part.open_txns))
        for pid, txn in part.open_txns.items():
            if len(txn.epochs) != 1:
                continue
            outcome = outcomes.get((pid, txn.epochs[0]))
            if outcome is None:
                continue
            gap = next((g for g in part.gaps if g[0] >= txn.end_offset), None)
            values = new.open.pop(pid)
            del new.open_txns[pid]
            (new.committed if outcome else new.aborted).extend(values)
            lost.append(LostMarker(part.partition, pid, txn.epochs[0], txn.first_offset,
                                   txn.end_offset, len(values), outcome, gap))
        parts.append(new)
    return TopicLog(log.topic, parts, log.cluster_id), lost


def decode_batches(data: bytes) -> list[LogBatch]:
    """The record batches in a Fetch response's ``records`` bytes (a trailing partial
    batch, which brokers may send, is left out)."""
    from kafka.record import MemoryRecords

    out: list[LogBatch] = []
    records = MemoryRecords(data)
    while True:
        batch = records.next_batch()
        if batch is None:
            break
        if batch.magic != 2:
            raise ParticipantError(
                f"verify: record batch at offset {batch.base_offset} has message format "
                f"v{batch.magic}; transactions need v2"
            )
        items = list(batch)
        if batch.is_control_batch:
            kinds = {bool(r.commit) for r in items}
            if len(kinds) != 1:
                raise ParticipantError(
                    f"verify: control batch at offset {batch.base_offset} is neither "
                    "one COMMIT nor one ABORT"
                )
            out.append(LogBatch(batch.base_offset, batch.producer_id, batch.producer_epoch,
                                batch.is_transactional, True, commit=kinds.pop(),
                                next_offset=batch.next_offset))
        else:
            out.append(LogBatch(batch.base_offset, batch.producer_id, batch.producer_epoch,
                                batch.is_transactional, False,
                                values=tuple(r.value for r in items),
                                next_offset=batch.next_offset,
                                tag=tuple(items[0].headers) if items else ()))
    return out


# -- the Fetch request -------------------------------------------------------------------
def _string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack(">h", len(raw)) + raw


def _fetch_request(correlation: int, topic: str, partition: int, offset: int) -> bytes:
    body = request_header(_FETCH, _FETCH_VERSION, correlation)
    # replica_id, max_wait_ms, min_bytes, max_bytes, isolation_level (read_uncommitted)
    body += struct.pack(">iiiib", -1, 500, 1, _MAX_BYTES, 0)
    body += struct.pack(">i", 1) + _string(topic)
    body += struct.pack(">iiqi", 1, partition, offset, _MAX_BYTES)
    return struct.pack(">i", len(body)) + body


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> tuple[int, ...]:
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def num(self, fmt: str) -> int:
        return int(self.take(fmt)[0])

    def raw(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out


def _fetch_once(
    sock: socket.socket, correlation: int, topic: str, partition: int, offset: int
) -> tuple[int, bytes]:
    """(high watermark, records bytes) of one Fetch v4 at ``offset``."""
    sock.sendall(_fetch_request(correlation, topic, partition, offset))
    (size,) = struct.unpack(">i", recv_exact(sock, 4))
    r = _Reader(recv_exact(sock, size))
    if r.num(">i") != correlation:
        raise ParticipantError("verify: Fetch answer out of order")
    r.take(">i")  # throttle time
    for _ in range(r.num(">i")):
        name = r.raw(r.num(">h")).decode()
        for _ in range(r.num(">i")):
            part, error, hwm, _lso = r.take(">ihqq")
            aborted = r.num(">i")
            r.raw(max(aborted, 0) * 16)  # (producer id, first offset) pairs
            records = r.raw(max(r.num(">i"), 0))
            if name == topic and part == partition:
                if error:
                    raise ParticipantError(
                        f"verify: Fetch of {topic!r} partition {partition} at offset {offset} "
                        f"answered error code {error}"
                    )
                return int(hwm), records
    raise ParticipantError(f"verify: Fetch answer has no {topic!r} partition {partition}")


def fetch_partition(
    host: str, port: int, topic: str, partition: int, *, timeout: float = 30.0,
    start: int = 0, settle_s: float | None = None, config: Mapping[str, object] | None = None,
) -> tuple[int, list[LogBatch]]:
    """Every record batch of one partition from ``start`` to the high watermark read at
    the first Fetch (later appends are left out: the verifier reads a settled topic).

    A broker may answer a high watermark whose last batch is not written yet (tansu
    reserves the offset first): the read waits for it up to ``timeout`` and then fails,
    unless ``settle_s`` is given: then offsets that stay empty that long are a gap (a
    write a crash cut, see :func:`settle_lost_markers`) and the read ends there.
    ``config``: the user's librdkafka settings, for TLS and SASL (plaintext without)."""
    batches: list[LogBatch] = []
    deadline = time.monotonic() + timeout
    with connect(host, port, config or {}, timeout) as sock:
        correlation, offset = 1, start
        end, data = _fetch_once(sock, correlation, topic, partition, offset)
        stuck_since: float | None = None
        while offset < end:
            got = [b for b in decode_batches(data) if b.next_offset > offset]
            if got:
                batches.extend(got)
                offset = got[-1].next_offset
                stuck_since = None
            else:
                stuck_since = stuck_since or time.monotonic()
                if settle_s is not None and time.monotonic() - stuck_since > settle_s:
                    break
                if time.monotonic() > deadline:
                    raise ParticipantError(
                        f"verify: {topic!r} partition {partition} not read to offset {end} "
                        f"within {timeout:.0f}s (stuck at {offset})"
                    )
                time.sleep(0.1)
            if offset >= end:
                break
            correlation += 1
            _, data = _fetch_once(sock, correlation, topic, partition, offset)
    return end, [b for b in batches if b.offset < end]


def _leaders(
    config: Mapping[str, object], topic: str, timeout: float
) -> tuple[dict[int, tuple[str, int]], str | None]:
    """(partition -> (host, port) of its leader, the cluster id), from a metadata request."""
    from confluent_kafka import KafkaException

    from twophase.sinks.kafka.admin import _admin, list_metadata, security_refusal

    admin, errors = _admin(config)
    deadline = time.monotonic() + timeout
    while True:
        try:
            md = list_metadata(admin, errors, min(10.0, timeout), topic)
            found = md.topics.get(topic)
            if found is not None and found.error is None and found.partitions:
                out: dict[int, tuple[str, int]] = {}
                for pid, p in found.partitions.items():
                    broker = md.brokers.get(p.leader)
                    if broker is None:
                        break
                    out[pid] = (str(broker.host), int(broker.port))
                else:
                    return out, md.cluster_id
        except KafkaException:
            pass
        refused = security_refusal(errors, admin)
        if refused is not None:  # credentials or CA: waiting does not help
            raise ParticipantError(f"Kafka log reader: {refused[0]}: {refused[1]}")
        if time.monotonic() > deadline:
            raise ParticipantError(f"verify: no metadata for Kafka topic {topic!r}")
        time.sleep(0.5)


def read_log(
    config: Mapping[str, object], topic: str, *, timeout: float = 120.0,
    settle_s: float | None = None,
) -> TopicLog:
    """Every partition of ``topic`` fetched to its high watermark and replayed
    (``settle_s``: see :func:`fetch_partition`)."""
    from twophase.sinks.kafka.config import common_config

    leaders, cluster_id = _leaders(common_config(config), topic, timeout)
    parts = []
    for pid in sorted(leaders):
        host, port = leaders[pid]
        try:
            hwm, batches = fetch_partition(host, port, topic, pid, timeout=timeout,
                                           settle_s=settle_s, config=config)
        except OSError as exc:
            raise ParticipantError(
                f"verify: cannot fetch {topic!r} partition {pid} from {host}:{port}: {exc}"
            ) from exc
        parts.append(replay(pid, batches, hwm))
    return TopicLog(topic, parts, cluster_id)


@dataclass(frozen=True)
class BranchInLog:
    """How many of one branch's records (found by their headers) the log shows committed,
    aborted, and still in an open transaction."""

    committed: int = 0
    aborted: int = 0
    open: int = 0


def count_tagged(batches: Iterable[LogBatch], tag: Mapping[str, bytes]) -> BranchInLog:
    """Kafka's rule (as in :func:`replay`) over the data batches whose first record
    carries every header of ``tag``: a batch holds one producer's records, and every
    record of a branch carries the same headers, so the first record tags the batch."""
    want = set(tag.items())
    pending: dict[int, int] = {}
    committed = aborted = 0
    for b in batches:
        if b.control:
            n = pending.pop(b.producer_id, 0)
            if b.commit:
                committed += n
            else:
                aborted += n
        elif want <= set(b.tag):
            if b.transactional:
                pending[b.producer_id] = pending.get(b.producer_id, 0) + len(b.values)
            else:
                committed += len(b.values)
    return BranchInLog(committed, aborted, sum(pending.values()))


def read_branch(
    config: Mapping[str, object],
    topic: str,
    tag: Mapping[str, bytes],
    start: Mapping[int, int],
    *,
    timeout: float = 60.0,
) -> BranchInLog:
    """The records tagged ``tag`` in every partition of ``topic``, read from ``start``
    (partition -> offset; partitions not named are read from their first offset)."""
    from confluent_kafka import Consumer, TopicPartition

    from twophase.sinks.kafka.config import common_config

    cfg = common_config(config)
    leaders, _ = _leaders(cfg, topic, timeout)
    low: dict[int, int] = {}
    missing = [pid for pid in leaders if pid not in start]
    if missing:  # the log may no longer begin at offset 0 (retention)
        consumer = Consumer({**cfg, "group.id": "twophase.log-reader"})
        try:
            for pid in missing:
                first, _ = consumer.get_watermark_offsets(
                    TopicPartition(topic, pid), timeout=timeout, cached=False)
                low[pid] = max(int(first), 0)
        finally:
            consumer.close()
    total = BranchInLog()
    for pid in sorted(leaders):
        host, port = leaders[pid]
        try:
            _, batches = fetch_partition(host, port, topic, pid, timeout=timeout,
                                         start=start.get(pid, low.get(pid, 0)),
                                         config=config)
        except OSError as exc:
            raise ParticipantError(
                f"cannot fetch {topic!r} partition {pid} from {host}:{port}: {exc}"
            ) from exc
        got = count_tagged(batches, tag)
        total = BranchInLog(total.committed + got.committed, total.aborted + got.aborted,
                            total.open + got.open)
    return total


def _column(value: bytes | None, column: str) -> Any:
    if not value:
        return None  # a tombstone: no row
    try:
        return json.loads(value)[column]
    except (ValueError, KeyError, TypeError) as exc:
        raise ParticipantError(
            f"verify: a record value is not a JSON object with {column!r}: {value[:80]!r}"
        ) from exc


def judge_log(
    log: TopicLog,
    column: str,
    consumer: Sequence[Any] | None,
    *,
    value_column: str | None = None,
) -> ReadBack:
    """The verifier's view of a topic: ``column`` of every committed row, the aborted
    rows and open transactions, and the cross-check with ``consumer`` (the ids a
    ``read_committed`` consumer read, or None when not read).

    The cross-check: the consumer agreeing with the log is proof from a second reader;
    any difference, an aborted row it returned included, is counted in ``mismatch``
    (a broker that shows aborted rows to read_committed readers, as tansu did, fails).
    """
    if value_column is not None:
        # The value is one column, not the row: the id cannot be read back.
        return ReadBack((), aborted=len(log.aborted), open=log.open_transactions, exact=False,
                        note=f"value= names column {value_column!r}: ids not readable")
    committed = [_column(v, column) for v in log.committed if v]
    aborted = [_column(v, column) for v in log.aborted if v]
    note, mismatch = "judged from the partition logs", 0
    if consumer is not None:
        want, got = Counter(committed), Counter(consumer)
        if got == want:
            note += "; a read_committed consumer agrees"
        else:
            mismatch = sum(((got - want) + (want - got)).values())
            note += f"; a read_committed consumer disagrees on {mismatch} rows"
            if (got - want) & Counter(aborted):
                note += " (it returned aborted rows)"
    return ReadBack(tuple(committed), aborted=len(aborted), open=log.open_transactions,
                    mismatch=mismatch, note=note)
