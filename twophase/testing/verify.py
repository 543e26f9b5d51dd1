"""The exactly-once verifier: what landed in each system, compared with what should have.

Given a sink's participants, the id column and the expected ids, it reads every system
the way a consumer would (PostgreSQL table, files through pyarrow, Kafka with a
``read_committed`` consumer) and reports per system: duplicates, missing ids, unexpected
ids, and leftovers still prepared (``pg_prepared_xacts``, staged files, open Kafka
branches known to this process). Used by the tests, ``twophase demo`` and ``twophase
chaos``. Readers are chosen by the participant's ``kind`` and import their client
library only when used.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from twophase.participant import Participant

__all__ = ["SystemReport", "VerifyReport", "read_ids", "verify"]


@dataclass
class SystemReport:
    participant: str
    kind: str
    rows: int
    duplicates: int  # rows beyond the first for an id
    missing: int
    unexpected: int
    prepared_leftovers: int
    examples: dict[str, list[Any]] = field(default_factory=dict)
    exact: bool = True  # False when the reader cannot judge exactly-once (e.g. tansu)
    note: str = ""
    # Temp files of a prepare killed mid-write (files: ``_twophase_staging/.*.tmp``): never
    # visible to readers and never prepared (the staged name did not appear), so they do not
    # break exactly-once; reported so the litter is seen.
    temp_leftovers: int = 0

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.missing or self.unexpected or self.prepared_leftovers)


@dataclass
class VerifyReport:
    expected: int
    systems: list[SystemReport]

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.systems if s.exact)

    def to_json(self) -> str:
        data = {
            "expected": self.expected,
            "ok": self.ok,
            "systems": [asdict(s) | {"ok": s.ok} for s in self.systems],
        }
        return json.dumps(data, indent=2, default=str)

    def lines(self) -> list[str]:
        out = [f"expected ids: {self.expected}"]
        for s in self.systems:
            verdict = "OK" if s.ok else "FAIL"
            if not s.exact:
                verdict += " (not judged: " + s.note + ")"
            out.append(
                f"  {s.participant:<24} rows={s.rows:<8} duplicates={s.duplicates:<5} "
                f"missing={s.missing:<5} unexpected={s.unexpected:<5} "
                f"prepared_leftovers={s.prepared_leftovers:<3} {verdict}"
            )
            if s.temp_leftovers:
                out.append(f"  {'':<24} + {s.temp_leftovers} temp file(s) of a prepare killed "
                           "mid-write (never visible, not prepared)")
        return out


def _pg_ids(p: Any, column: str) -> tuple[list[Any], int]:
    import psycopg
    from psycopg import sql

    with psycopg.connect(p.dsn, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL("SELECT {} FROM {}.{}").format(
                sql.Identifier(column), sql.Identifier(p.schema), sql.Identifier(p.table)
            )
        ).fetchall()
        prepared = conn.execute(
            "SELECT count(*) FROM pg_prepared_xacts"
            " WHERE database = current_database() AND gid LIKE 'tp:%'"
        ).fetchone()
    return [r[0] for r in rows], int(prepared[0]) if prepared else 0


def _file_ids(p: Any, column: str) -> tuple[list[Any], int]:
    import pyarrow.dataset as ds

    path = p.path
    if not path.exists():
        return [], 0
    fmt = "parquet" if p.format == "parquet" else "json"
    files = sorted(
        str(f) for f in path.iterdir() if f.is_file() and not f.name.startswith(("_", "."))
    )
    ids: list[Any] = []
    if files:
        ids = ds.dataset(files, format=fmt).to_table(columns=[column]).column(column).to_pylist()
    staging = path / "_twophase_staging"
    leftovers = sum(1 for f in staging.iterdir() if f.is_file() and not _is_temp(f.name)) \
        if staging.exists() else 0
    return ids, leftovers


def _is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def _file_temp_leftovers(p: Any) -> int:
    staging = p.path / "_twophase_staging"
    if not staging.exists():
        return 0
    return sum(1 for f in staging.iterdir() if f.is_file() and _is_temp(f.name))


def _kafka_ids(p: Any, column: str, timeout: float = 120.0) -> tuple[list[Any], int]:
    """Read the topic to its end with a ``read_committed`` consumer.

    Robust to a slow or briefly confused broker: the topic's metadata and end offsets are
    retried until they answer, and a partition is done when the consumer's *position*
    reaches the end offset (the last offsets of a transactional topic are commit
    markers, which are never delivered as messages).
    """
    import time

    from confluent_kafka import Consumer, KafkaException, TopicPartition

    conf = dict(p.config)
    conf.update({
        "group.id": "twophase-verify",
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        "auto.offset.reset": "earliest",
    })
    deadline = time.monotonic() + timeout
    consumer = Consumer(conf)
    ids: list[Any] = []
    try:
        while True:
            try:
                meta = consumer.list_topics(p.topic, timeout=10)
                topic = meta.topics.get(p.topic)
                if topic is not None and topic.error is None and topic.partitions:
                    parts = sorted(topic.partitions)
                    ends = {
                        i: consumer.get_watermark_offsets(
                            TopicPartition(p.topic, i), timeout=10)[1]
                        for i in parts
                    }
                    break
            except KafkaException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"verify: no metadata for Kafka topic {p.topic!r}")
            time.sleep(0.5)
        consumer.assign([TopicPartition(p.topic, i, 0) for i in parts])
        pending = {i for i, end in ends.items() if end > 0}
        while pending and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                value = msg.value()
                if value and p.value is None:
                    ids.append(json.loads(value)[column])
            for tp in consumer.position([TopicPartition(p.topic, i) for i in pending]):
                if tp.offset is not None and tp.offset >= ends[tp.partition]:
                    pending.discard(tp.partition)
        if pending:
            raise RuntimeError(
                f"verify: Kafka topic {p.topic!r} partitions {sorted(pending)} were not read "
                f"to their end within {timeout:.0f}s"
            )
    finally:
        consumer.close()
    return ids, 0


_READERS = {"postgres": _pg_ids, "files": _file_ids, "kafka": _kafka_ids}


def read_ids(p: Participant, column: str) -> tuple[list[Any], int]:
    """The id column as a consumer sees it, and the count of prepared leftovers."""
    try:
        reader = _READERS[p.kind]
    except KeyError:
        raise ValueError(f"no verifier reader for participant kind {p.kind!r}") from None
    return reader(p, column)


def verify(
    participants: Sequence[Participant],
    expected: Iterable[Any],
    *,
    column: str = "id",
    sink: str | None = None,
    judge_kafka: bool = True,
) -> VerifyReport:
    """Compare every participant's committed ids with ``expected``.

    ``sink`` adds the participant's own ``in_doubt(sink)`` leftovers. ``judge_kafka=False``
    reports Kafka figures without judging them (a broker that shows aborted records,
    such as tansu, cannot prove exactly-once).
    """
    want = Counter(expected)
    systems: list[SystemReport] = []
    for p in participants:
        ids, leftovers = read_ids(p, column)
        if sink is not None:
            leftovers = max(leftovers, len(p.in_doubt(sink)))
        got = Counter(ids)
        dups = sorted(k for k, n in got.items() if n > 1)
        missing = sorted(k for k in want if k not in got)
        unexpected = sorted(k for k in got if k not in want)
        exact = judge_kafka or p.kind != "kafka"
        systems.append(
            SystemReport(
                participant=p.name,
                kind=p.kind,
                rows=sum(got.values()),
                duplicates=sum(n - 1 for n in got.values() if n > 1),
                missing=len(missing),
                unexpected=len(unexpected),
                prepared_leftovers=leftovers,
                examples={"duplicates": dups[:5], "missing": missing[:5],
                          "unexpected": unexpected[:5]},
                exact=exact,
                note="" if exact else "broker shows aborted records (tansu)",
                temp_leftovers=_file_temp_leftovers(p) if p.kind == "files" else 0,
            )
        )
    return VerifyReport(expected=len(want), systems=systems)
