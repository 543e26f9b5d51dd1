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


def _account(conn: sa.Connection, backend: str, fallback: str) -> str:
    """The account as a GRANT names it: ``'user'@'host'`` (MySQL, MariaDB: the row of
    mysql.user the server matched, CURRENT_USER()) or the role (PostgreSQL)."""
    try:
        if backend == "postgresql":
            return f'"{conn.execute(sa.text("SELECT current_user")).scalar()}"'
        found = str(conn.execute(sa.text("SELECT CURRENT_USER()")).scalar())
    except sa.exc.DBAPIError:
        return fallback
    user, _, host = found.rpartition("@")
    return f"'{user}'@'{host}'" if user else fallback


def _create_grant(conn: sa.Connection, backend: str, user: str) -> str:
    """``GRANT CREATE`` on the database (MySQL, MariaDB) or the current schema."""
    query = "SELECT DATABASE()" if backend == "mysql" else "SELECT current_schema()"
    try:
        name = conn.execute(sa.text(query)).scalar()
    except sa.exc.DBAPIError:
        name = None
    if backend == "mysql":
        target = f"`{name}`.*" if name else "<database>.*"
        return f"GRANT CREATE ON {target} TO {user}"
    schema = f'"{name}"' if name else "<schema>"
    return f"GRANT CREATE ON SCHEMA {schema} TO {user}"


def _xa_recover_grant(conn: sa.Connection, user: str) -> str:
    """The grant that lets ``user`` run XA RECOVER on this server."""
    try:
        version = str(conn.execute(sa.text("SELECT VERSION()")).scalar())
    except sa.exc.DBAPIError:
        version = ""
    if "mariadb" in version.lower():  # sql/xa.cc: XA RECOVER checks no privilege
        return ("MariaDB requires no privilege for XA RECOVER: let the statement through "
                "whatever refused it (a proxy or a managed service's filter)")
    return f"GRANT XA_RECOVER_ADMIN ON *.* TO {user} (MySQL 8 and later)"


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
                    _xa_recover_grant(conn, user)))
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
    # MySQL/MariaDB: a table with a duplicate column fails (ER_DUP_FIELDNAME) after the
    # CREATE privilege check and before anything exists, so the probe needs no DROP
    # right (not one the participant needs); PostgreSQL: the creator owns and may drop it
    columns = "x INTEGER, x INTEGER" if backend == "mysql" else "x INTEGER"
    try:
        conn.execute(sa.text(f"CREATE TABLE {probe} ({columns})"))
    except sa.exc.DBAPIError as exc:
        if backend == "mysql" and _errno(exc) == _ER_DUP_FIELDNAME:
            return []
        grant = _create_grant(conn, backend, user)
        return [(f"the user may not create tables in {where} ({_first_line(exc)}), and "
                 f"table(s) {', '.join(missing)} do not exist yet",
                 f"{grant}, or create the tables beforehand")]
    conn.execute(sa.text(f"DROP TABLE {probe}"))
    return []


_ER_DUP_FIELDNAME = 1060


def _errno(exc: sa.exc.DBAPIError) -> int | None:
    args = getattr(exc.orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def check_rights(who: str, conn: sa.Connection, backend: str, tables: Sequence[str],
                 create: bool) -> None:
    """Raise :class:`TargetProblem` naming every missing right and its grant.
    ``conn`` is an autocommit connection; ``tables`` those the participant writes."""
    user = _account(conn, backend, conn.engine.url.username or "<user>")
    problems = _two_phase(conn, backend, user)
    inspector = sa.inspect(conn)
    missing = [t for t in tables if not inspector.has_table(t)]
    if missing:
        problems += _create(conn, backend, user, missing, create)
    if problems:
        raise TargetProblem(who, "; ".join(p for p, _ in problems),
                            "; ".join(f for _, f in problems), host=socket.gethostname(),
                            kind=Failure.AUTHORIZATION)
