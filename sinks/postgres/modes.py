"""Write modes of the PostgreSQL participant: append, upsert, complete.

- ``append``: ``COPY`` the rows into the table (the original behaviour).
- ``upsert``: ``COPY`` into a per-branch staging table created inside the transaction
  that will be prepared, then ``INSERT ... SELECT ... ON CONFLICT (key) DO UPDATE`` (and a
  ``DELETE ... USING`` for rows flagged by ``delete_when``); the staging table is dropped
  before ``PREPARE``. PostgreSQL refuses to prepare a transaction that touched a
  *temporary* table, so the staging table is a regular ``UNLOGGED`` one whose name is
  derived from the gid (unique per branch attempt): created and dropped in the same
  transaction, it never becomes visible to anyone, and a killed prepare leaves nothing.
- ``complete``: ``DELETE FROM`` the table, then ``COPY`` the batch: the table's rows are
  replaced atomically at ``COMMIT PREPARED``. It needs the whole batch in one branch
  (see :meth:`PostgresParticipant.single_branch` and docs/decisions.md).

Everything here builds SQL from :mod:`psycopg.sql` objects; names reach it already
validated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat
from psycopg import sql

from twophase.errors import InvalidRequest
from twophase.sinks.postgres.arrow import NESTED_POLICIES

__all__ = [
    "MODES",
    "SCHEMA_POLICIES",
    "batch_key_problems",
    "check_options",
    "delete_sql",
    "normalize_key",
    "stage_name",
    "stage_sql",
    "upsert_sql",
]

MODES: Final = ("append", "upsert", "complete")
SCHEMA_POLICIES: Final = ("fail", "add_columns")
_SHOWN: Final = 3
"""Duplicate keys quoted in an error message."""


def normalize_key(key: str | Sequence[str] | None) -> tuple[str, ...]:
    """``key=`` as a tuple of column names (``"a"`` or ``["a", "b"]``)."""
    if key is None:
        return ()
    cols = (key,) if isinstance(key, str) else tuple(key) if isinstance(key, (list, tuple)) else ()
    if not cols or not all(isinstance(c, str) and c for c in cols):
        raise InvalidRequest(f"key must be a column name or a list of column names, got {key!r}")
    if len(set(cols)) != len(cols):
        raise InvalidRequest(f"key lists a column twice: {list(cols)}")
    return cols


def stage_name(gid: str) -> str:
    """The branch attempt's staging table: unique per gid, a plain identifier."""
    return "_twophase_stage_" + hashlib.sha256(gid.encode()).hexdigest()[:32]


def stage_sql(
    table: sql.Composable, stage: sql.Composable, columns: Sequence[str], flag: str | None
) -> sql.Composed:
    """An empty UNLOGGED table with the target's column types (plus the delete flag)."""
    cols: list[sql.Composable] = [sql.Identifier(c) for c in columns]
    if flag is not None:
        cols.append(sql.SQL("NULL::boolean AS {}").format(sql.Identifier(flag)))
    return sql.SQL("CREATE UNLOGGED TABLE {} AS SELECT {} FROM {} WITH NO DATA").format(
        stage, sql.SQL(", ").join(cols), table
    )


def upsert_sql(
    table: sql.Composable,
    stage: sql.Composable,
    columns: Sequence[str],
    key: Sequence[str],
    flag: str | None,
) -> sql.Composed:
    """Insert the staged rows; a row whose key exists replaces the non-key columns."""
    names = sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    rest = [c for c in columns if c not in key]
    action = (
        sql.SQL("DO UPDATE SET {}").format(
            sql.SQL(", ").join(
                sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c))
                for c in rest
            )
        )
        if rest
        else sql.SQL("DO NOTHING")
    )
    where = (
        sql.SQL(" WHERE {} IS NOT TRUE").format(sql.Identifier(flag)) if flag else sql.SQL("")
    )
    return sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {}{} ON CONFLICT ({}) {}").format(
        table, names, names, stage, where,
        sql.SQL(", ").join(sql.Identifier(c) for c in key), action,
    )


def delete_sql(
    table: sql.Composable, stage: sql.Composable, key: Sequence[str], flag: str
) -> sql.Composed:
    """Delete the table rows whose key a staged row flags for deletion."""
    match = sql.SQL(" AND ").join(
        sql.SQL("t.{} = s.{}").format(sql.Identifier(c), sql.Identifier(c)) for c in key
    )
    return sql.SQL("DELETE FROM {} AS t USING {} AS s WHERE s.{} AND {}").format(
        table, stage, sql.Identifier(flag), match
    )


def batch_key_problems(
    batches: Sequence[pa.RecordBatch], key: Sequence[str]
) -> list[str]:
    """Null keys and keys present more than once in the batch (empty: the keys are fine).

    Which of several rows for one key should win is not defined by the batch (Spark gives
    no row order within a partition after a shuffle), so the batch is refused instead of
    guessing. Computed column-wise by Arrow, before anything is written.
    """
    if not batches or not key:
        return []
    table = pa.Table.from_batches(batches).select(list(key))
    if table.num_rows == 0:
        return []
    problems = []
    for col in key:
        nulls = table.column(col).null_count
        if nulls:
            problems.append(f"key column {col!r} is null in {nulls} row(s)")
    if problems:
        return problems
    counts = table.group_by(list(key)).aggregate([([], "count_all")])
    dup = counts.filter(pc.greater(counts.column("count_all"), 1))
    if dup.num_rows:
        shown = [
            "(" + ", ".join(f"{c}={row[c]!r}" for c in key) + f") x{row['count_all']}"
            for row in dup.slice(0, _SHOWN).to_pylist()
        ]
        more = f" and {dup.num_rows - _SHOWN} more" if dup.num_rows > _SHOWN else ""
        problems.append(
            f"{dup.num_rows} key(s) occur more than once in the batch: "
            + ", ".join(shown) + more
        )
    return problems


def is_bool(field: pa.Field) -> bool:
    return bool(pat.is_boolean(field.type))


def check_options(mode: str, key: str | Sequence[str] | None, delete_when: str | None,
                  on_schema_change: str, nested: str) -> tuple[str, ...]:
    """Refuse a combination of options that cannot work (a message naming the fix);
    returns the key, normalised."""
    if nested not in NESTED_POLICIES:
        raise InvalidRequest(
            f"nested must be one of {', '.join(NESTED_POLICIES)}; got {nested!r} ('json' "
            "stores structs and maps as jsonb and lists as arrays, 'refuse' refuses them)"
        )
    if mode not in MODES:
        raise InvalidRequest(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if on_schema_change not in SCHEMA_POLICIES:
        raise InvalidRequest(
            f"on_schema_change must be one of {', '.join(SCHEMA_POLICIES)}; "
            f"got {on_schema_change!r}"
        )
    norm = normalize_key(key)
    if mode == "upsert" and not norm:
        raise InvalidRequest(
            "mode='upsert' needs key=: the column(s) that identify a row, e.g. "
            "key='customer' for groupBy('customer').count()"
        )
    if delete_when is not None:
        if mode != "upsert":
            raise InvalidRequest(
                f"delete_when is only used by mode='upsert' (got mode={mode!r})"
            )
        if not isinstance(delete_when, str) or not delete_when:
            raise InvalidRequest(f"delete_when must be a column name, got {delete_when!r}")
        if delete_when in norm:
            raise InvalidRequest(f"delete_when column {delete_when!r} is also a key column")
    return norm
