"""The decision log's tables (SQLAlchemy Core), shared by SQLite and PostgreSQL.

One row per sink, one per transaction attempt, one per branch of an attempt (so that a
chunk of votes or acks writes only the rows it changed: O(chunk), not O(branches)), and
an append-only event history.
``txns.version`` is the compare-and-set counter that every change checks; ``sinks.version``
does the same for the sink row. ``meta`` records the schema version, which the store checks
at start so that an old daemon never writes into a newer layout (or the reverse).

Version 2 moved the branches from their own table into ``txns.branches``; version 1
stores are refused with a clear error (there is no migration: none was deployed).
Version 3 (this one) adds ``twophase_participants``: each sink's participant descriptors,
recorded at register, so ``twophase resolve`` can rebuild the participants from the log
alone. The change is one new table, so a version 2 store is upgraded in place at start
(the table is created, the version bumped, nothing rewritten); a version 2 daemon refuses
a version 3 store, so roll every replica forward together.
Version 4 (this one) moves the branches from ``txns.branches`` (one JSON value, loaded and
rewritten whole by every chunk of votes or acks: 12 MiB of JSON per batch at 4,096
branches) into ``twophase_branches``, a row per branch keyed by the transaction's key and
the branch's position. A version 2 or 3 store is migrated at start, in the one
transaction that checks the version (:mod:`~twophase.coordinator.migrate`): every
transaction, in-doubt ones included, keeps its branches exactly.
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    insert,
    inspect,
    select,
    update,
)

from twophase.errors import SchemaMismatch

SCHEMA_VERSION: Final = 4
_UPGRADABLE: Final = {"2", "3"}  # versions upgraded in place at start (migrate.py)

# 64-bit everywhere: Spark's batch ids are longs, and the service accepts any integer up to
# wire.MAX_INT (PostgreSQL INTEGER would overflow at 2**31). SQLite's INTEGER is already
# 64-bit; its autoincrement needs the exact type name INTEGER, hence the variant.
_ID = BigInteger().with_variant(Integer, "sqlite")

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
    Column("epoch", BigInteger, nullable=False),
    Column("lineage", String(128), nullable=True),
    Column("last_committed", BigInteger, nullable=True),
    Column("version", BigInteger, nullable=False),
)

_TXN_KEY = ("sink", "lineage", "checkpoint", "attempt")

txns = Table(
    "twophase_txns",
    metadata,
    Column("sink", String(64), primary_key=True),
    Column("lineage", String(128), primary_key=True),
    Column("checkpoint", BigInteger, primary_key=True, autoincrement=False),
    Column("attempt", BigInteger, primary_key=True, autoincrement=False),
    Column("epoch", BigInteger, nullable=False),
    Column("partitions", BigInteger, nullable=False),
    Column("branch_count", BigInteger, nullable=False),
    Column("state", String(16), nullable=False),
    Column("reason", Text, nullable=True),
    Column("deadline", Float, nullable=False),
    Column("created", Float, nullable=False),
    Column("decided_at", Float, nullable=True),
    Column("finished_at", Float, nullable=True),
    Column("updated", Float, nullable=False),
    # operational flag, not protocol state: decided long ago and branches still not acked
    Column("alert", Boolean, nullable=False, default=False),
    Column("version", BigInteger, nullable=False),
    Index("twophase_txns_state", "state", "deadline"),
    Index("twophase_txns_finished", "finished_at"),
    # the console's and the API's listings: newest first, of one sink or of all
    Index("twophase_txns_created", "created"),
    Index("twophase_txns_sink_created", "sink", "created"),
    Index("twophase_txns_alert", "alert"),  # /metrics and the console's alert count
)

# indexes added after version 3 was deployed: created at start where missing (no version
# bump: an older daemon ignores them)
_LATER_INDEXES: Final = ("twophase_txns_created", "twophase_txns_sink_created",
                         "twophase_txns_alert")

branches = Table(
    "twophase_branches",
    metadata,
    Column("sink", String(64), primary_key=True),
    Column("lineage", String(128), primary_key=True),
    Column("checkpoint", BigInteger, primary_key=True, autoincrement=False),
    Column("attempt", BigInteger, primary_key=True, autoincrement=False),
    # the branch's position in the transaction (the order begin made them in)
    Column("idx", Integer, primary_key=True, autoincrement=False),
    # "participant/partition" (twophase.protocol.parse_branch_id)
    Column("branch", String(96), nullable=False),
    # wire.BranchOut as JSON: {"vote", "handle", "reason", "ack", "digest", "task"}; it is
    # written only with a compare-and-set of its transaction's row in the same database
    # transaction, so txns.version versions the branches too
    Column("state", Text, nullable=False),
)

events = Table(
    "twophase_events",
    metadata,
    Column("id", _ID, primary_key=True, autoincrement=True),
    Column("sink", String(64), nullable=False),
    Column("lineage", String(128), nullable=False),
    Column("checkpoint", BigInteger, nullable=False),
    Column("attempt", BigInteger, nullable=False),
    Column("at", Float, nullable=False),
    Column("kind", String(16), nullable=False),
    Column("branch", String(96), nullable=True),
    Column("detail", Text, nullable=True),
    Column("state", String(16), nullable=False),  # state after the event
    Index("twophase_events_txn", "sink", "lineage", "checkpoint", "attempt"),
)

participants = Table(
    "twophase_participants",
    metadata,
    Column("sink", String(64), primary_key=True),
    Column("name", String(64), primary_key=True),
    # JSON: {"kind", "name", "target", "options"}; non-secret by construction
    # (twophase.participant.Participant.descriptor); secrets are never stored
    Column("descriptor", Text, nullable=False),
    Column("updated", Float, nullable=False),
)


def ensure(conn: Connection, *, create: bool, where: str) -> None:
    """Create the tables in an empty database (if ``create``), or check that the version
    found is this one; ``where`` names the store in the error."""
    if not inspect(conn).has_table(meta.name):
        if not create:
            raise SchemaMismatch(f"store {where} has no twophase schema")
        metadata.create_all(conn)
        conn.execute(insert(meta).values(key="schema_version", value=str(SCHEMA_VERSION)))
        return
    # FOR UPDATE (PostgreSQL): replicas starting together migrate once, one after the other
    version = select(meta.c.value).where(meta.c.key == "schema_version")
    row = conn.execute(version.with_for_update() if create else version).first()
    found = row[0] if row else None
    if found in _UPGRADABLE and create:
        from twophase.coordinator.migrate import upgrade

        upgrade(conn, found, SCHEMA_VERSION)
        conn.execute(
            update(meta).where(meta.c.key == "schema_version").values(value=str(SCHEMA_VERSION))
        )
        found = str(SCHEMA_VERSION)
    if found in _UPGRADABLE:
        raise SchemaMismatch(
            f"store {where} has schema version {found}; a read-only tool does not upgrade "
            f"it: start this version's coordinator on it once (twophase serve, or any job) "
            f"to upgrade it in place to version {SCHEMA_VERSION}"
        )
    if found != str(SCHEMA_VERSION):
        raise SchemaMismatch(
            f"store {where} has schema version {found}, this coordinator "
            f"needs {SCHEMA_VERSION}; use a matching twophase version"
        )
    if create:
        have = {ix["name"] for ix in inspect(conn).get_indexes(txns.name)}
        for ix in txns.indexes:
            if ix.name in _LATER_INDEXES and ix.name not in have:
                ix.create(conn)
