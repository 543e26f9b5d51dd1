"""The SQL participant's tables and rows: the marker and hashed-xid tables, the data
table for a batch's schema, its INSERT (append or upsert per dialect), and a batch's
rows as INSERT parameters in chunks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql

from twophase.participant import PrepareRefused
from twophase.sinks.sql.schema import UnsupportedType, sql_type_for

__all__ = ["chunks", "data_table", "duplicate_key", "field_problems", "has_key",
           "insert_statement", "marker_table", "xid_table"]


def marker_table(name: str, md: sa.MetaData | None = None) -> sa.Table:
    """One row per committed branch, written inside the branch: the idempotency marker."""
    return sa.Table(
        name, md or sa.MetaData(),
        sa.Column("sink", sa.String(64), primary_key=True),
        sa.Column("lineage", sa.String(64), primary_key=True),
        sa.Column("checkpoint", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("participant", sa.String(64), primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("committed_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.current_timestamp()),
    )


def xid_table(marker: str, md: sa.MetaData | None = None) -> sa.Table:
    """Hashed xid -> branch (written outside the XA transaction, before it starts)."""
    return sa.Table(
        f"{marker}_xids", md or sa.MetaData(),
        sa.Column("xid", sa.String(64), primary_key=True),
        sa.Column("sink", sa.String(64), nullable=False),
        sa.Column("lineage", sa.String(64), nullable=False),
        sa.Column("checkpoint", sa.BigInteger, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("participant", sa.String(64), nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
    )


def data_table(name: str, schema: pa.Schema, key: Sequence[str]) -> sa.Table:
    """The table a batch of ``schema`` is written to (key columns: NOT NULL, primary)."""
    cols = [sa.Column(f.name, sql_type_for(f, key=f.name in key),
                      nullable=f.nullable and f.name not in key,
                      primary_key=f.name in key, autoincrement=False)
            for f in schema]
    return sa.Table(name, sa.MetaData(), *cols)


def field_problems(schema: pa.Schema, key: Sequence[str]) -> list[str]:
    """Why ``schema`` cannot be written (a missing key column, a type with no SQL type)."""
    problems = [f"key column {k!r} is not in the data (columns: {schema.names})"
                for k in key if k not in schema.names]
    for f in schema:
        try:
            sql_type_for(f, key=f.name in key)
        except UnsupportedType as exc:
            problems.append(str(exc))
    return problems


def has_key(inspector: sa.Inspector, table: str, key: Sequence[str]) -> bool:
    """The existing table has a primary key, unique constraint or unique index on exactly
    ``key`` (what an upsert's ON CONFLICT / ON DUPLICATE KEY needs)."""
    want = set(key)
    sets = [set(inspector.get_pk_constraint(table).get("constrained_columns") or [])]
    sets += [set(u["column_names"]) for u in inspector.get_unique_constraints(table)]
    sets += [set(c for c in i["column_names"] if c) for i in inspector.get_indexes(table)
             if i.get("unique")]
    return want in sets


def duplicate_key(batches: list[pa.RecordBatch], key: Sequence[str]
                  ) -> tuple[dict[str, Any], int] | None:
    """A key that appears more than once in the batch, with its count; None when none
    (an upsert writes each key once per batch)."""
    if not batches:
        return None
    keys = pa.Table.from_batches(batches).select(list(key))
    dup = keys.group_by(list(key)).aggregate([([], "count_all")])
    dup = dup.filter(pa.compute.greater(dup["count_all"], 1))
    if not dup.num_rows:
        return None
    return dup.slice(0, 1).drop_columns(["count_all"]).to_pylist()[0], dup["count_all"][0].as_py()


def insert_statement(table: sa.Table, key: Sequence[str], mode: str, backend: str) -> Any:
    """Append: a plain INSERT. Upsert: ``ON DUPLICATE KEY UPDATE`` (MySQL) or
    ``ON CONFLICT DO UPDATE`` (PostgreSQL; ``DO NOTHING`` when every column is key)."""
    if mode == "append":
        return table.insert()
    rest = [c.name for c in table.columns if c.name not in key]
    if backend == "mysql":
        ins = mysql.insert(table)
        first = key[0]
        return ins.on_duplicate_key_update(
            {c: ins.inserted[c] for c in rest} or {first: ins.inserted[first]})
    pg = postgresql.insert(table)
    if not rest:
        return pg.on_conflict_do_nothing(index_elements=list(key))
    return pg.on_conflict_do_update(index_elements=list(key),
                                    set_={c: pg.excluded[c] for c in rest})


def chunks(who: str, schema: pa.Schema, batches: Iterable[pa.RecordBatch], chunk_rows: int
           ) -> Iterator[list[dict[str, Any]]]:
    """The rows as INSERT parameters, ``chunk_rows`` at a time (one multi-row INSERT
    each). A batch of another schema is refused (``who``: the participant)."""
    names = schema.names
    for batch in batches:
        if not batch.schema.equals(schema):
            raise PrepareRefused(
                f"{who}: a batch has schema {batch.schema} but the branch "
                f"was declared with {schema}"
            )
        for start in range(0, batch.num_rows, chunk_rows):
            part = batch.slice(start, chunk_rows)
            cols = [_pylist(part.column(i)) for i in range(part.num_columns)]
            yield [dict(zip(names, values, strict=True)) for values in zip(*cols, strict=True)]


def _pylist(col: pa.Array | pa.ChunkedArray) -> list[Any]:
    """Python values of a column; aware timestamps in UTC (the session's time zone)."""
    t = col.type
    if pa.types.is_timestamp(t) and t.tz is not None and t.tz not in ("UTC", "+00:00"):
        col = col.cast(pa.timestamp(t.unit, "UTC"))
    return list(col.to_pylist())
