"""PostgreSQL helpers shared by test modules (the server itself is the ``pg`` fixture)."""

from __future__ import annotations

import uuid

import psycopg
from psycopg import sql


def fresh_pg_db(dsn: str, prefix: str) -> str:
    """A new, empty database on the suite's server; returns its DSN."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return dsn.rsplit("/", 1)[0] + "/" + name
