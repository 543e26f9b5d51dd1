"""The PostgreSQL participant's target, checked on the driver before the first batch:
the server's settings and the role's rights (the probe, on every executor too), the
marker table, and the data table created, compared with the data or widened.

Functions of the participant (its names, mode and policies), kept apart from the branch's
prepare/commit path: what a misfit target looks like is one concern, writing a branch
another.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import psycopg
import pyarrow as pa
from psycopg import errors as pgerr
from psycopg import sql

from twophase.errors import Failure, TargetProblem
from twophase.participant import ParticipantError
from twophase.sinks.postgres.arrow import ExistingColumn, pg_type_for, table_misfits

if TYPE_CHECKING:
    from twophase.sinks.postgres.participant import PostgresParticipant

__all__ = ["check_table", "no_prepared", "probe_role"]


def probe_role(p: PostgresParticipant, conn: psycopg.Connection[Any]) -> None:
    row = conn.execute("SELECT current_setting('max_prepared_transactions')::int").fetchone()
    if row is None or row[0] <= 0:
        raise no_prepared(p, row[0] if row else None)
    missing: list[str] = []  # what the role lacks, and the GRANTs that fix it
    grants: dict[str, None] = {}
    schema_ok = conn.execute(
        "SELECT has_schema_privilege(n.oid, 'USAGE'), has_schema_privilege(n.oid, 'CREATE')"
        " FROM pg_namespace n WHERE nspname = %s", (p.schema,)).fetchone()
    if schema_ok is None:
        raise TargetProblem(p.describe(), f"schema {p.schema!r} does not exist",
                            f"create it (CREATE SCHEMA {p.schema}) or pass schema=",
                            host=socket.gethostname(), kind=Failure.MISSING)
    if not schema_ok[0]:
        missing.append(f"USAGE on schema {p.schema}")
        grants[f"USAGE ON SCHEMA {p.schema}"] = None
    for table, needs in ((p.table, ("SELECT", "INSERT", "UPDATE", "DELETE")),
                         (p.marker_table, ("SELECT", "INSERT"))):
        name = f"{p.schema}.{table}"
        regclass = f'"{p.schema}"."{table}"'
        found = conn.execute("SELECT to_regclass(%s)", (regclass,)).fetchone()
        if found is None or found[0] is None:
            if not schema_ok[1]:
                missing.append(f"CREATE on schema {p.schema} (to create {name})")
                grants[f"CREATE ON SCHEMA {p.schema}"] = None
            continue
        lacking = [priv for priv in needs if not (conn.execute(
            "SELECT has_table_privilege(to_regclass(%s), %s)", (regclass, priv)
        ).fetchone() or (False,))[0]]
        if lacking:
            missing.append(f"{', '.join(lacking)} on {name}")
            grants[f"{', '.join(lacking)} ON {name}"] = None
    if missing:
        row = conn.execute("SELECT current_user").fetchone()
        user = str(row[0]) if row else "?"
        raise TargetProblem(
            p.describe(), f"role {user!r} lacks " + "; ".join(missing),
            "; ".join(f"GRANT {g} TO {user}" for g in grants) + " (as the owner)",
            host=socket.gethostname(), kind=Failure.AUTHORIZATION)


def no_prepared(p: PostgresParticipant, value: object) -> TargetProblem:
    return TargetProblem(
        p.describe(),
        f"the server has max_prepared_transactions = {value if value is not None else '?'}"
        ", so PREPARE TRANSACTION is refused",
        "set max_prepared_transactions in postgresql.conf to at least the number of "
        "concurrent branches (Spark tasks writing at once, over all sinks), then "
        "restart the server", host=socket.gethostname(), kind=Failure.CONFIGURATION)


def check_table(p: PostgresParticipant, conn: psycopg.Connection[Any], schema: pa.Schema) -> None:
    row = conn.execute("SELECT current_setting('max_prepared_transactions')::int").fetchone()
    if row is None or row[0] <= 0:
        raise no_prepared(p, row[0] if row else None)
    ensure_marker_table(p, conn)
    columns = existing_columns(p, conn)
    if not columns:
        if not p.create:
            raise ParticipantError(
                f"{p.describe()}: table {p.schema}.{p.table} does not exist "
                "(and create=False)"
            )
        create_table(p, conn, schema)
        return
    have = {c.name for c in columns}
    new = [f for f in schema if f.name not in have]
    fitting = schema
    if p.on_schema_change == "add_columns":
        fitting = pa.schema([f for f in schema if f.name in have])
    problems = table_misfits(fitting, columns, p.nested)
    if new and p.on_schema_change == "fail":
        problems.append(
            "to add new columns to the table as they appear, pass "
            "on_schema_change='add_columns'"
        )
    if p.mode == "upsert" and not has_unique_index(p, conn, p.key):
        problems.append(
            f"no primary key or unique index on the key ({', '.join(p.key)}), which "
            "INSERT ... ON CONFLICT needs; create one, e.g. CREATE UNIQUE INDEX ON "
            f"{p.schema}.{p.table} ({', '.join(p.key)})"
        )
    if problems:
        raise ParticipantError(
            f"{p.describe()}: table {p.schema}.{p.table} does not fit the data: "
            + "; ".join(problems)
        )
    if new:
        add_columns(p, conn, new)


def has_unique_index(
    p: PostgresParticipant, conn: psycopg.Connection[Any], key: Sequence[str]
) -> bool:
    """Is there a unique, non-partial index on exactly the key's columns?"""
    rows = conn.execute(
        """
        SELECT array_agg(a.attname::text ORDER BY a.attname)
        FROM pg_index i
        JOIN pg_class c ON c.oid = i.indrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
        WHERE n.nspname = %s AND c.relname = %s AND i.indisunique
          AND i.indpred IS NULL AND i.indexprs IS NULL
        GROUP BY i.indexrelid
        """,
        (p.schema, p.table),
    ).fetchall()
    want = sorted(key)
    return any(list(r[0]) == want for r in rows)


def add_columns(
    p: PostgresParticipant, conn: psycopg.Connection[Any], fields: list[pa.Field]
) -> None:
    """``on_schema_change='add_columns'``: new nullable columns, in one transaction.

    Run here, on the driver before the batch's branches, not inside each prepared
    branch: ``ADD COLUMN`` takes an ACCESS EXCLUSIVE lock, which a prepared branch
    would hold until the decision, blocking every reader and the batch's other
    branches (see docs/decisions.md). A nullable column without a default is a
    catalog-only change: existing rows read NULL."""
    with conn.transaction():
        for f in fields:
            conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                    p._table_sql(), sql.Identifier(f.name),
                    sql.SQL(pg_type_for(f, p.nested)),  # from a fixed vocabulary
                )
            )


def existing_columns(p: PostgresParticipant, conn: psycopg.Connection[Any]) -> list[ExistingColumn]:
    rows = conn.execute(
        """
        SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull, a.atthasdef
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped
          AND c.relkind IN ('r', 'p')
        ORDER BY a.attnum
        """,
        (p.schema, p.table),
    ).fetchall()
    return [ExistingColumn(r[0], r[1], bool(r[2]), bool(r[3])) for r in rows]


def create_table(p: PostgresParticipant, conn: psycopg.Connection[Any], schema: pa.Schema) -> None:
    cols = [
        sql.SQL("{} {}{}").format(
            sql.Identifier(f.name),
            sql.SQL(pg_type_for(f, p.nested)),  # a fixed vocabulary, not user input
            sql.SQL("" if f.nullable else " NOT NULL"),
        )
        for f in schema
    ]
    if p.key:
        cols.append(sql.SQL("PRIMARY KEY ({})").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in p.key)))
    stmt = sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
        p._table_sql(), sql.SQL(", ").join(cols)
    )
    with suppress(pgerr.UniqueViolation, pgerr.DuplicateTable):
        conn.execute(stmt)  # a concurrent creator winning the race is fine


def ensure_marker_table(p: PostgresParticipant, conn: psycopg.Connection[Any]) -> None:
    stmt = sql.SQL(
        """
        CREATE TABLE IF NOT EXISTS {} (
            sink text NOT NULL,
            lineage text NOT NULL,
            checkpoint bigint NOT NULL,
            participant text NOT NULL,
            partition integer NOT NULL,
            attempt integer NOT NULL,
            committed_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (sink, lineage, checkpoint, participant, partition)
        )
        """
    ).format(p._marker_sql())
    with suppress(pgerr.UniqueViolation, pgerr.DuplicateTable):
        conn.execute(stmt)
