"""A branch's rows as Kafka records: key, value, headers, the size limit; produced.

Both prepares produce through :func:`produce_all` (:mod:`.resumable` to the target topic,
:mod:`.staged` to the staging topic), so a row is encoded and size-checked one way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from twophase.errors import TwophaseError
from twophase.jsoncodec import json_rows
from twophase.participant import BranchRef, ParticipantError
from twophase.sinks.kafka.admin import check_columns as check_key_value
from twophase.sinks.kafka.clients import to_bytes
from twophase.sinks.kafka.config import RECORD_OVERHEAD_BYTES

if TYPE_CHECKING:
    from twophase.sinks.kafka.participant import KafkaParticipant

__all__ = ["Deliveries", "Refusal", "check_columns", "headers", "messages", "produce_all"]


class Refusal(TwophaseError):
    """Internal: a reason to vote NO that the data or the broker explains."""


class Deliveries:
    """The delivery reports of one transaction's records (the producer's ``on_delivery``):
    the failures, and the first offset written in each partition, which the vote's
    handle names."""

    def __init__(self) -> None:
        self.errors: list[Any] = []
        self.first: dict[int, int] = {}

    def __call__(self, err: Any, msg: Any) -> None:
        if err is not None:
            self.errors.append(err)
            return
        part, offset = msg.partition(), msg.offset()
        if offset is not None and offset >= 0 and offset < self.first.get(part, offset + 1):
            self.first[part] = offset

    def check(self) -> None:
        """After the flush: the first failed delivery refuses the vote."""
        if self.errors:
            first = self.errors[0]
            raise Refusal(f"delivery failed: {first.name()}: {first.str()}")


def headers(branch: BranchRef) -> list[tuple[str, bytes]]:
    """Headers of every message of a branch: where it came from, so a consumer can
    trace a message to its batch or drop a batch it has already seen (a branch's
    messages become visible together, once per (sink, lineage, batch, partition))."""
    return [
        ("twophase.sink", branch.sink.encode()),
        ("twophase.lineage", branch.lineage.encode()),
        ("twophase.batch", str(branch.batch_id).encode()),
        ("twophase.partition", str(branch.partition).encode()),
    ]


def check_columns(p: KafkaParticipant, schema: pa.Schema) -> None:
    """The key and value columns are in the schema, and several key columns can be
    written as one JSON object (checked before the first write, not per row)."""
    check_key_value(p.describe(), schema, p.key, p.value)
    missing = [c for c in p.keys if c not in schema.names]
    if missing:
        raise ParticipantError(
            f"{p.describe()}: key column(s) {missing} are not in the schema "
            f"{schema.names}"
        )
    if len(p.keys) > 1:
        try:
            list(json_rows(pa.RecordBatch.from_pylist(
                [], schema=pa.schema([schema.field(c) for c in p.keys]))))
        except (ValueError, pa.ArrowException) as exc:
            raise ParticipantError(f"{p.describe()}: key columns: {exc}") from exc


def produce_all(
    p: KafkaParticipant,
    producer: Any,
    schema: pa.Schema,
    batches: Iterable[pa.RecordBatch],
    on_delivery: Callable[[Any, Any], None],
    errors: list[Any],
    headers: list[tuple[str, bytes]],
    *,
    topic: str | None = None,
    partition: int = -1,
) -> int:
    """Produce every row (waiting on a full local queue); the row count. A row over the
    message size limit or a delivery error already reported raises :class:`Refusal`."""
    limit = p.max_message_bytes()
    room = limit - RECORD_OVERHEAD_BYTES - sum(len(k) + len(v) for k, v in headers)
    produce, poll, topic = producer.produce, producer.poll, topic or p.topic
    rows = 0
    for batch in batches:
        if batch.schema.names != schema.names:
            raise Refusal(
                f"batch columns {batch.schema.names} differ from the schema {schema.names}"
            )
        for k, v in messages(p, batch):
            size = (len(v) if v else 0) + (len(k) if k else 0)
            if size > room:
                raise Refusal(
                    f"row {rows} is {size} bytes (key+value), over the message size limit "
                    f"of {limit} bytes less {RECORD_OVERHEAD_BYTES} bytes of record "
                    "overhead and the twophase headers (message.max.bytes of the "
                    "producer / max.message.bytes of the topic)"
                )
            try:
                produce(topic, v, k, partition, on_delivery=on_delivery, headers=headers)
            except BufferError:
                while True:  # the local queue is full: serve delivery reports, retry
                    poll(0.05)
                    try:
                        produce(topic, v, k, partition, on_delivery=on_delivery,
                                headers=headers)
                        break
                    except BufferError:
                        continue
            rows += 1
        if errors:
            raise Refusal(f"delivery failed: {errors[0].name()}: {errors[0].str()}")
    return rows


def messages(p: KafkaParticipant, batch: pa.RecordBatch
             ) -> Iterator[tuple[bytes | None, bytes | None]]:
    """(key, value) per row: the value column as is, else the row as JSON; one key
    column as is, several as a JSON object, none: no key."""
    n = batch.num_rows
    if p.value is not None:
        values: Iterable[bytes | None] = (
            to_bytes(v) for v in batch.column(p.value).to_pylist()
        )
    else:
        values = json_rows(batch)
    if p.key is not None:
        keys: Iterable[bytes | None] = [
            to_bytes(k) for k in batch.column(p.key).to_pylist()
        ]
    elif p.keys:
        keys = list(json_rows(batch.select(list(p.keys))))
    else:
        keys = itertools.repeat(None, n)
    return zip(keys, values, strict=True)
