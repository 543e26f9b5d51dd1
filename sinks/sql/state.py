"""What a server holds of twophase's branches: its prepared transactions that are
twophase's, which branch each is (readable xid, or hashed and looked up), and a branch's
marker row. Read by prepare, commit, abort, status and ``in_doubt`` alike."""

from __future__ import annotations

from contextlib import suppress

import sqlalchemy as sa

from twophase.errors import InvalidRequest
from twophase.participant import BranchRef
from twophase.sinks.sql.xid import HASHED_ROOT, is_ours, parse_readable

__all__ = ["branches_of", "marker_attempt", "prepared_xids"]


def prepared_xids(conn: sa.Connection, backend: str) -> list[str]:
    """twophase's prepared transactions in this server (PostgreSQL: this database,
    whose gids alone it can commit)."""
    if backend == "postgresql":
        rows = conn.execute(sa.text(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
        )).scalars().all()
    else:
        rows = conn.recover_twophase()
    xids = [x.decode() if isinstance(x, (bytes, bytearray)) else str(x) for x in rows]
    return [x for x in xids if is_ours(x)]


def marker_attempt(conn: sa.Connection, markers: sa.Table, branch: BranchRef) -> int | None:
    """The attempt whose marker row is committed for the branch; None when none."""
    m = markers
    try:
        row = conn.execute(sa.select(m.c.attempt).where(
            m.c.sink == branch.sink, m.c.lineage == branch.lineage,
            m.c.checkpoint == branch.batch_id, m.c.participant == branch.participant,
            m.c.partition == branch.partition)).first()
    except sa.exc.ProgrammingError:
        return None  # no marker table yet: nothing committed
    return None if row is None else int(row[0])


def branches_of(conn: sa.Connection, xid_table: sa.Table, xids: list[str]
                ) -> dict[str, BranchRef]:
    """Which branch each of ``xids`` is (readable, or hashed and recorded)."""
    out: dict[str, BranchRef] = {}
    hashed = []
    for x in xids:
        b = parse_readable(x)
        if b is not None:
            out[x] = b
        elif x.startswith(HASHED_ROOT):
            hashed.append(x)
    if hashed:
        t = xid_table
        for r in conn.execute(sa.select(t).where(t.c.xid.in_(hashed))).mappings():
            with suppress(InvalidRequest):
                out[r["xid"]] = BranchRef(r["sink"], r["lineage"], int(r["checkpoint"]),
                                          int(r["attempt"]), r["participant"],
                                          int(r["partition"]))
    return out
