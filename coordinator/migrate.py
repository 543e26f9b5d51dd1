"""Upgrades of an older store's schema, run at start inside the version check's transaction.

Version 2 to 3 adds the participants table. Version 3 to 4 moves each transaction's
branches out of its ``txns.branches`` JSON value into ``twophase_branches``, a row per
branch in the value's order, then drops the column. Each transaction's branches are
decoded and re-encoded with :mod:`twophase.client.wire` (rows written before the store used
wire's layout omit null keys), so an in-doubt transaction comes out exactly as it went
in and the new daemon finishes it. All of it is one database transaction: a crash
mid-way leaves the old layout, and the next start migrates again.
"""

from __future__ import annotations

import json
import logging
from typing import Final

from sqlalchemy import Connection, insert, text

from twophase.client import wire
from twophase.coordinator import schema as s

__all__ = ["upgrade"]

log = logging.getLogger("twophase.coordinator.migrate")

_FETCH: Final = 500  # transactions read at once while moving branches


def upgrade(conn: Connection, found: str, to: int) -> None:
    """Bring a version ``found`` store to version ``to`` (the caller records ``to``)."""
    if found == "2":
        s.metadata.create_all(conn, tables=[s.participants])
    if int(found) < 4 <= to:
        _branches_to_rows(conn)
    log.info("store schema upgraded", extra={"from": found, "to": to})


def _branches_to_rows(conn: Connection) -> None:
    s.metadata.create_all(conn, tables=[s.branches])
    t = s.txns.name
    rows = conn.execute(text(
        f"SELECT sink, lineage, checkpoint, attempt, branches FROM {t} "
        "ORDER BY sink, lineage, checkpoint, attempt"
    ))
    moved = 0
    while batch := rows.fetchmany(_FETCH):
        out = []
        for sink, lineage, checkpoint, attempt, raw in batch:
            where = f"{t}.branches of {sink}/{lineage}/{checkpoint}/{attempt}"
            decoded = wire.decode_branches(json.loads(raw), where)
            for idx, (bid, st) in enumerate(decoded.items()):
                out.append({
                    "sink": sink, "lineage": lineage, "checkpoint": checkpoint,
                    "attempt": attempt, "idx": idx, "branch": bid,
                    "state": json.dumps(wire.encode_branch(st), separators=(",", ":")),
                })
        if out:
            conn.execute(insert(s.branches), out)
        moved += len(batch)
    rows.close()
    conn.execute(text(f"ALTER TABLE {t} DROP COLUMN branches"))
    log.info("branches moved to rows", extra={"transactions": moved})
