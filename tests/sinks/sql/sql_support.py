"""Targets of the SQL participant's tests: a fresh table per check, read by a plain reader."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa

from twophase.sinks.sql import SqlAlchemyParticipant


def pg_url(dsn: str) -> str:
    """The suite's PostgreSQL DSN as a SQLAlchemy URL through psycopg 3."""
    return "postgresql+psycopg://" + dsn.split("://", 1)[1]


class SqlTarget:
    def __init__(self, url: str, *, name: str | None = None, **options: Any) -> None:
        self.url = url
        self.table = f"t_{uuid.uuid4().hex[:12]}"
        self.name = name or f"sql-{self.table}"
        self.options = options
        self.engine = sa.create_engine(url, poolclass=sa.NullPool)

    def participant(self) -> SqlAlchemyParticipant:
        return SqlAlchemyParticipant(self.url, self.table, name=self.name, **self.options)

    def rows(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            t = sa.Table(self.table, sa.MetaData(), autoload_with=conn)
            for c in t.columns:  # MySQL's reflected DOUBLE reads as Decimal by default
                if isinstance(c.type, sa.Float):
                    c.type.asdecimal = False
            return [dict(r) for r in conn.execute(sa.select(t)).mappings()]

    def close(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {self.table}"))
        self.engine.dispose()
