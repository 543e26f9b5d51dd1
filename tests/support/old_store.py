"""A decision log as twophase 0.2 left it (schema version 3, or 2), for migration tests."""

from __future__ import annotations

import json
import time

from sqlalchemy import create_engine, text

from twophase.coordinator.db import normalize_url

__all__ = ["COMMITTING", "OLD_DDL", "PREPARING", "old_store"]

# Version 3's tables as twophase 0.2 created them (SQLAlchemy's DDL for PostgreSQL; on
# SQLite the events' key is INTEGER, which autoincrements there). Saved here, not built
# from the code, so that the test keeps the old layout whatever schema.py becomes.
OLD_DDL = """
CREATE TABLE twophase_meta (
    "key" VARCHAR(64) NOT NULL, value VARCHAR(256) NOT NULL, PRIMARY KEY ("key"));
CREATE TABLE twophase_sinks (
    name VARCHAR(64) NOT NULL, epoch BIGINT NOT NULL, lineage VARCHAR(128),
    last_committed BIGINT, version BIGINT NOT NULL, PRIMARY KEY (name));
CREATE TABLE twophase_txns (
    sink VARCHAR(64) NOT NULL, lineage VARCHAR(128) NOT NULL, checkpoint BIGINT NOT NULL,
    attempt BIGINT NOT NULL, epoch BIGINT NOT NULL, partitions BIGINT NOT NULL,
    branch_count BIGINT NOT NULL, branches TEXT NOT NULL, state VARCHAR(16) NOT NULL,
    reason TEXT, deadline FLOAT NOT NULL, created FLOAT NOT NULL, decided_at FLOAT,
    finished_at FLOAT, updated FLOAT NOT NULL, alert BOOLEAN NOT NULL,
    version BIGINT NOT NULL, PRIMARY KEY (sink, lineage, checkpoint, attempt));
CREATE INDEX twophase_txns_created ON twophase_txns (created);
CREATE INDEX twophase_txns_sink_created ON twophase_txns (sink, created);
CREATE INDEX twophase_txns_alert ON twophase_txns (alert);
CREATE INDEX twophase_txns_state ON twophase_txns (state, deadline);
CREATE INDEX twophase_txns_finished ON twophase_txns (finished_at);
CREATE TABLE twophase_events (
    id {id_type} NOT NULL, sink VARCHAR(64) NOT NULL, lineage VARCHAR(128) NOT NULL,
    checkpoint BIGINT NOT NULL, attempt BIGINT NOT NULL, at FLOAT NOT NULL,
    kind VARCHAR(16) NOT NULL, branch VARCHAR(96), detail TEXT,
    state VARCHAR(16) NOT NULL, PRIMARY KEY (id));
CREATE INDEX twophase_events_txn ON twophase_events (sink, lineage, checkpoint, attempt);
CREATE TABLE twophase_participants (
    sink VARCHAR(64) NOT NULL, name VARCHAR(64) NOT NULL, descriptor TEXT NOT NULL,
    updated FLOAT NOT NULL, PRIMARY KEY (sink, name));
INSERT INTO twophase_meta ("key", value) VALUES ('schema_version', '3');
"""

# COMMITTING: every branch voted YES, one acknowledged; "pg/1" as rows written before
# the store used wire's layout (null keys left out). Key order is branch order.
COMMITTING = {
    "pg/0": {"vote": "COMMIT", "handle": {"gid": "g0"}, "reason": None, "ack": "COMMIT",
             "digest": "d0"},
    "pg/1": {"vote": "COMMIT", "handle": {"gid": "g1"}},
    "files/0": {"vote": "COMMIT", "handle": {"path": "f0"}, "reason": None, "ack": None,
                "digest": None, "task": "0.1"},
}
# PREPARING: one YES in, one branch still to vote
PREPARING = {
    "pg/0": {"vote": "COMMIT", "handle": {"gid": "h0"}, "reason": None, "ack": None},
    "pg/1": {"vote": None, "handle": None, "reason": None, "ack": None},
}


def old_store(url: str, version: str = "3") -> None:
    """Version 3's tables (2's: without the participants'), with sink "a" in COMMITTING
    and sink "b" in PREPARING (checkpoint 0, attempt 1, lineage "L", epoch 3)."""
    engine = create_engine(normalize_url(url))
    id_type = "INTEGER" if engine.dialect.name == "sqlite" else "BIGSERIAL"
    now = time.time()
    ddl = OLD_DDL.format(id_type=id_type).replace("'3'", repr(version))
    with engine.begin() as conn:
        for stmt in ddl.split(";"):
            if stmt.strip() and not (version == "2" and "twophase_participants" in stmt):
                conn.execute(text(stmt))
        for sink, state, branches, decided in (("a", "COMMITTING", COMMITTING, now),
                                               ("b", "PREPARING", PREPARING, None)):
            conn.execute(text(
                "INSERT INTO twophase_sinks VALUES (:s, 3, 'L', NULL, 4)"), {"s": sink})
            conn.execute(text(
                "INSERT INTO twophase_txns VALUES (:s, 'L', 0, 1, 3, 2, :n, :b, :st, NULL, "
                ":dl, :now, :dec, NULL, :now, :alert, 7)"),
                {"s": sink, "n": len(branches), "b": json.dumps(branches), "st": state,
                 "dl": now + 3600, "now": now, "dec": decided, "alert": False})
    engine.dispose()
