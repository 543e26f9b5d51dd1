"""What the SQL participant's probe checks beyond a login: two-phase commit (XA on
MySQL/MariaDB, ``max_prepared_transactions`` on PostgreSQL) and, when a table it needs
is missing, the right to create it.

Why before the first batch: without XA RECOVER a restarted job cannot find its prepared
branches, without CREATE the first ``check`` fails, and both are a grant away; named here,
the fix is one line instead of a failed batch.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Sequence

import sqlalchemy as sa

from twophase.errors import Failure, TargetProblem

__all__ = ["check_rights"]


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return str(orig).strip().splitlines()[0][:300] if str(orig).strip() else type(exc).__name__


def _two_phase(conn: sa.Connection, backend: str, user: str) -> list[tuple[str, str]]:
    if backend == "postgresql":
        n = conn.execute(sa.text("SELECT current_setting('max_prepared_transactions')::int")
                         ).scalar()
        if not n:
            return [("the server refuses PREPARE TRANSACTION (max_prepared_transactions=0)",
                     "set max_prepared_transactions in postgresql.conf to at least the "
                     "number of partitions writing at once, and restart the server")]
        return []
    out: list[tuple[str, str]] = []
    try:
        conn.execute(sa.text("XA RECOVER")).fetchall()
    except sa.exc.DBAPIError as exc:
        out.append((f"XA RECOVER is refused ({_first_line(exc)}): a restarted job could not "
                    "find its prepared branches",
                    f"GRANT XA_RECOVER_ADMIN ON *.* TO {user} (MySQL 8 and later)"))
    xid = f"twophase-probe-{uuid.uuid4().hex[:12]}"
    try:
        conn.execute(sa.text(f"XA START '{xid}'"))
        conn.execute(sa.text(f"XA END '{xid}'"))
        conn.execute(sa.text(f"XA ROLLBACK '{xid}'"))
    except sa.exc.DBAPIError as exc:
        out.append((f"XA transactions are refused ({_first_line(exc)})",
                    "use a server and user that allow XA START/PREPARE/COMMIT (a proxy or "
                    "managed service may disable XA)"))
    return out


def _create(conn: sa.Connection, backend: str, user: str, missing: Sequence[str],
            create: bool) -> list[tuple[str, str]]:
    where = ("this database" if backend == "mysql" else "the current schema")
    if not create:
        return [(f"table(s) {', '.join(missing)} do not exist and create=False",
                 "create them beforehand, or pass create=True with the CREATE right")]
    probe = f"twophase_probe_{uuid.uuid4().hex[:12]}"
    try:
        conn.execute(sa.text(f"CREATE TABLE {probe} (x INTEGER)"))
    except sa.exc.DBAPIError as exc:
        grant = ("GRANT CREATE ON <database>.* TO " + user if backend == "mysql"
                 else f"GRANT CREATE ON SCHEMA <schema> TO {user}")
        return [(f"the user may not create tables in {where} ({_first_line(exc)}), and "
                 f"table(s) {', '.join(missing)} do not exist yet",
                 f"{grant}, or create the tables beforehand")]
    conn.execute(sa.text(f"DROP TABLE {probe}"))
    return []


def check_rights(who: str, conn: sa.Connection, backend: str, tables: Sequence[str],
                 create: bool) -> None:
    """Raise :class:`TargetProblem` naming every missing right and its grant.
    ``conn`` is an autocommit connection; ``tables`` those the participant writes."""
    user = conn.engine.url.username or "<user>"
    problems = _two_phase(conn, backend, user)
    inspector = sa.inspect(conn)
    missing = [t for t in tables if not inspector.has_table(t)]
    if missing:
        problems += _create(conn, backend, user, missing, create)
    if problems:
        raise TargetProblem(who, "; ".join(p for p, _ in problems),
                            "; ".join(f for _, f in problems), host=socket.gethostname(),
                            kind=Failure.AUTHORIZATION)
