"""The decision log's tables (SQLAlchemy Core), shared by SQLite and PostgreSQL.

One row per sink, one per transaction attempt, one per branch of an attempt, and an
append-only event history. ``txns.version`` is the compare-and-set counter that every
change checks; ``sinks.version`` does the same for the sink row. ``meta`` records the
schema version, which the store checks at start so that an old daemon never writes into
a newer layout (or the reverse).
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import (
    Boolean,
    Column,
    Float,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)

SCHEMA_VERSION: Final = 1

metadata = MetaData()

meta = Table(
    "twophase_meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", String(256), nullable=False),
)

sinks = Table(
    "twophase_sinks",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("epoch", Integer, nullable=False),
    Column("lineage", String(128), nullable=True),
    Column("last_committed", Integer, nullable=True),
    Column("version", Integer, nullable=False),
)

_TXN_KEY = ("sink", "lineage", "checkpoint", "attempt")

txns = Table(
    "twophase_txns",
    metadata,
    Column("sink", String(64), primary_key=True),
    Column("lineage", String(128), primary_key=True),
    Column("checkpoint", Integer, primary_key=True, autoincrement=False),
    Column("attempt", Integer, primary_key=True, autoincrement=False),
    Column("epoch", Integer, nullable=False),
    Column("partitions", Integer, nullable=False),
    Column("branch_count", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("reason", Text, nullable=True),
    Column("deadline", Float, nullable=False),
    Column("created", Float, nullable=False),
    Column("decided_at", Float, nullable=True),
    Column("finished_at", Float, nullable=True),
    Column("updated", Float, nullable=False),
    # operational flag, not protocol state: decided long ago and branches still not acked
    Column("alert", Boolean, nullable=False, default=False),
    Column("version", Integer, nullable=False),
    Index("twophase_txns_state", "state", "deadline"),
    Index("twophase_txns_finished", "finished_at"),
)

branches = Table(
    "twophase_branches",
    metadata,
    Column("sink", String(64), primary_key=True),
    Column("lineage", String(128), primary_key=True),
    Column("checkpoint", Integer, primary_key=True, autoincrement=False),
    Column("attempt", Integer, primary_key=True, autoincrement=False),
    Column("branch", String(96), primary_key=True),
    Column("participant", String(64), nullable=False),
    Column("partition", Integer, nullable=False),
    Column("vote", String(8), nullable=True),  # COMMIT (voted YES) / ABORT (voted NO)
    Column("handle", Text, nullable=True),  # JSON object of strings
    Column("reason", Text, nullable=True),
    Column("ack", String(8), nullable=True),  # the outcome the branch confirmed
    ForeignKeyConstraint(
        list(_TXN_KEY),
        [f"twophase_txns.{c}" for c in _TXN_KEY],
        ondelete="CASCADE",
    ),
)

events = Table(
    "twophase_events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("sink", String(64), nullable=False),
    Column("lineage", String(128), nullable=False),
    Column("checkpoint", Integer, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("at", Float, nullable=False),
    Column("kind", String(16), nullable=False),
    Column("branch", String(96), nullable=True),
    Column("detail", Text, nullable=True),
    Column("state", String(16), nullable=False),  # state after the event
    Index("twophase_events_txn", "sink", "lineage", "checkpoint", "attempt"),
)
