"""PostgresParticipant modes (append, upsert, complete), delete_when and on_schema_change,
against the suite's real PostgreSQL server. Each option: it works, and bad input is a clear
error with nothing written and nothing left prepared."""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql

from twophase.errors import InvalidRequest
from twophase.participant import BranchRef, BranchStatus, ParticipantError, PrepareRefused
from twophase.sinks.postgres import PostgresParticipant

COUNTS = pa.schema([("customer", pa.string()), ("n", pa.int64())])


@pytest.fixture
def admin(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def table() -> str:
    return f"m_{uuid.uuid4().hex[:12]}"


def _rows(admin: psycopg.Connection[Any], table: str, order: str = "1") -> list[tuple[Any, ...]]:
    return admin.execute(
        sql.SQL("SELECT * FROM {} ORDER BY {}").format(sql.Identifier(table), sql.SQL(order))
    ).fetchall()


def _branch(p: PostgresParticipant, batch_id: int = 0, partition: int = 0) -> BranchRef:
    return BranchRef(sink="m", lineage="lin", batch_id=batch_id, attempt=1,
                     participant=p.name, partition=partition)


def _batch(schema: pa.Schema, rows: list[dict[str, Any]]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(rows, schema=schema)


def _land(p: PostgresParticipant, schema: pa.Schema, rows: list[dict[str, Any]],
          batch_id: int, partition: int = 0) -> None:
    b = _branch(p, batch_id, partition)
    handle = p.prepare(b, schema, [_batch(schema, rows)])
    p.commit(b, handle)


def _no_litter(admin: psycopg.Connection[Any]) -> None:
    """No prepared transaction of these tests, no staging table left anywhere."""
    assert admin.execute(
        "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'tp:m:%'").fetchall() == []
    assert admin.execute(
        "SELECT relname FROM pg_class WHERE relname LIKE '\\_twophase\\_stage\\_%'"
    ).fetchall() == []


# ------------------------------------------------------------------------------ upsert


def test_upsert_creates_keyed_table_and_replaces_rows_by_key(
    pg_dsn: str, admin: Any, table: str
) -> None:
    p = PostgresParticipant(pg_dsn, table, mode="upsert", key="customer")
    p.check(COUNTS)
    pk = admin.execute(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
        "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s::regclass AND i.indisprimary",
        (table,),
    ).fetchall()
    assert pk == [("customer",)]
    _land(p, COUNTS, [{"customer": "a", "n": 1}, {"customer": "b", "n": 2}], 0)
    # batch 1: "a" updated, "c" new, "b" untouched
    b = _branch(p, 1)
    h = p.prepare(b, COUNTS, [_batch(COUNTS, [{"customer": "a", "n": 5},
                                              {"customer": "c", "n": 1}])])
    assert _rows(admin, table) == [("a", 1), ("b", 2)]  # prepared: invisible
    p.commit(b, h)
    assert _rows(admin, table) == [("a", 5), ("b", 2), ("c", 1)]
    _no_litter(admin)


def test_upsert_abort_leaves_the_old_rows(pg_dsn: str, admin: Any, table: str) -> None:
    p = PostgresParticipant(pg_dsn, table, mode="upsert", key="customer")
    p.check(COUNTS)
    _land(p, COUNTS, [{"customer": "a", "n": 1}], 0)
    b = _branch(p, 1)
    h = p.prepare(b, COUNTS, [_batch(COUNTS, [{"customer": "a", "n": 9}])])
    p.abort(b, h)
    assert p.status(b) is BranchStatus.ABSENT
    assert _rows(admin, table) == [("a", 1)]
    _no_litter(admin)


def test_upsert_composite_key_and_key_only_table(pg_dsn: str, admin: Any, table: str) -> None:
    schema = pa.schema([("day", pa.string()), ("shop", pa.int32()), ("total", pa.float64())])
    p = PostgresParticipant(pg_dsn, table, mode="upsert", key=["day", "shop"])
    p.check(schema)
    _land(p, schema, [{"day": "d1", "shop": 1, "total": 1.5},
                      {"day": "d1", "shop": 2, "total": 2.0}], 0)
    _land(p, schema, [{"day": "d1", "shop": 2, "total": 7.0}], 1)
    assert _rows(admin, table, "1, 2") == [("d1", 1, 1.5), ("d1", 2, 7.0)]
    only = pa.schema([("word", pa.string())])  # every column is the key: DO NOTHING
    q = PostgresParticipant(pg_dsn, table + "_k", mode="upsert", key="word")
    q.check(only)
    _land(q, only, [{"word": "x"}], 0)
    _land(q, only, [{"word": "x"}, {"word": "y"}], 1)
    assert _rows(admin, table + "_k") == [("x",), ("y",)]
    _no_litter(admin)


def test_upsert_branches_of_one_batch_prepare_concurrently(
    pg_dsn: str, admin: Any, table: str
) -> None:
    """Two branches with disjoint keys (the driver hashes by key) both prepare while the
    other holds its locks: neither waits for the other's decision."""
    p = PostgresParticipant(pg_dsn, table, mode="upsert", key="customer")
    p.check(COUNTS)
    _land(p, COUNTS, [{"customer": "a", "n": 1}, {"customer": "b", "n": 1}], 0)
    q = pickle.loads(pickle.dumps(p))  # another process's copy: its own connection
    b0, b1 = _branch(p, 1, 0), _branch(q, 1, 1)
    h0 = p.prepare(b0, COUNTS, [_batch(COUNTS, [{"customer": "a", "n": 2},
                                                {"customer": "x", "n": 1}])])
    h1 = q.prepare(b1, COUNTS, [_batch(COUNTS, [{"customer": "b", "n": 3},
                                                {"customer": "y", "n": 1}])])
    p.commit(b0, h0)
    q.commit(b1, h1)
    assert _rows(admin, table) == [("a", 2), ("b", 3), ("x", 1), ("y", 1)]
    q.close()
    _no_litter(admin)


def test_upsert_refuses_duplicate_and_null_keys_before_writing(
    pg_dsn: str, admin: Any, table: str
) -> None:
    p = PostgresParticipant(pg_dsn, table, mode="upsert", key="customer")
    p.check(COUNTS)
    _land(p, COUNTS, [{"customer": "a", "n": 1}], 0)
    for rows, words in (
        ([{"customer": "a", "n": 2}, {"customer": "b", "n": 1}, {"customer": "a", "n": 3}],
         ("1 key(s) occur more than once", "customer='a'", "x2", "dropDuplicates")),
        ([{"customer": None, "n": 2}], ("key column 'customer' is null in 1 row(s)",)),
    ):
        b = _branch(p, 1)
        with pytest.raises(PrepareRefused) as info:
            p.prepare(b, COUNTS, [_batch(COUNTS, rows)])
        for w in words:
            assert w in str(info.value), str(info.value)
        assert p.status(b) is BranchStatus.ABSENT
    assert _rows(admin, table) == [("a", 1)]
    _no_litter(admin)


def test_upsert_existing_table_needs_unique_index_on_key(
    pg_dsn: str, admin: Any, table: str
) -> None:
    admin.execute(sql.SQL("CREATE TABLE {} (customer text, n bigint)").format(
        sql.Identifier(table)))
    p = PostgresParticipant(pg_dsn, table, mode="upsert", key="customer")
    with pytest.raises(ParticipantError, match=r"no primary key or unique index on the key "
                       r"\(customer\).*CREATE UNIQUE INDEX ON public\." + table):
        p.check(COUNTS)
    admin.execute(sql.SQL("CREATE UNIQUE INDEX ON {} (customer)").format(sql.Identifier(table)))
    p.check(COUNTS)
    _land(p, COUNTS, [{"customer": "a", "n": 1}], 0)
    assert _rows(admin, table) == [("a", 1)]


def test_upsert_option_errors(pg_dsn: str, table: str) -> None:
    with pytest.raises(InvalidRequest, match="mode='upsert' needs key="):
        PostgresParticipant(pg_dsn, table, mode="upsert")
    with pytest.raises(InvalidRequest, match="mode must be one of append, upsert, complete"):
        PostgresParticipant(pg_dsn, table, mode="merge")
    with pytest.raises(InvalidRequest, match="key lists a column twice"):
        PostgresParticipant(pg_dsn, table, mode="upsert", key=["a", "a"])
    with pytest.raises(InvalidRequest, match="key must be a column name"):
        PostgresParticipant(pg_dsn, table, mode="upsert", key=[])
    p = PostgresParticipant(pg_dsn, table, mode="upsert", key="client")
    with pytest.raises(ParticipantError, match="key column 'client' is not in the data"):
        p.check(COUNTS)


# ------------------------------------------------------------------------- delete_when

CDC = pa.schema([("customer", pa.string()), ("n", pa.int64()), ("gone", pa.bool_())])


def test_delete_when_deletes_flagged_keys_and_upserts_the_rest(
    pg_dsn: str, admin: Any, table: str
) -> None:
    p = PostgresParticipant(pg_dsn, table, mode="upsert", key="customer", delete_when="gone")
    p.check(CDC)
    cols = [r[0] for r in admin.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = %s "
        "ORDER BY ordinal_position", (table,)).fetchall()]
    assert cols == ["customer", "n"]  # the flag is not stored
    _land(p, CDC, [{"customer": "a", "n": 1, "gone": False},
                   {"customer": "b", "n": 1, "gone": None}], 0)
    _land(p, CDC, [{"customer": "a", "n": 0, "gone": True},
                   {"customer": "b", "n": 4, "gone": False},
                   {"customer": "z", "n": 0, "gone": True}], 1)  # deleting a missing key: no-op
    assert _rows(admin, table) == [("b", 4)]
    _no_litter(admin)


def test_delete_when_bad_input(pg_dsn: str, table: str) -> None:
    with pytest.raises(InvalidRequest, match="delete_when is only used by mode='upsert'"):
        PostgresParticipant(pg_dsn, table, delete_when="gone")
    with pytest.raises(InvalidRequest, match="also a key column"):
        PostgresParticipant(pg_dsn, table, mode="upsert", key="gone", delete_when="gone")
    p = PostgresParticipant(pg_dsn, table, mode="upsert", key="customer", delete_when="gone")
    with pytest.raises(ParticipantError, match="delete_when column 'gone' is not in the data"):
        p.check(COUNTS)
    bad = pa.schema([("customer", pa.string()), ("gone", pa.int32())])
    with pytest.raises(ParticipantError, match="'gone' is int32, not boolean"):
        p.check(bad)


# ---------------------------------------------------------------------------- complete


def test_complete_replaces_every_row_atomically(pg_dsn: str, admin: Any, table: str) -> None:
    p = PostgresParticipant(pg_dsn, table, mode="complete", key="customer")
    assert p.single_branch() and p.partition_columns() is None
    p.check(COUNTS)
    _land(p, COUNTS, [{"customer": "a", "n": 1}, {"customer": "b", "n": 1}], 0)
    b = _branch(p, 1)
    h = p.prepare(b, COUNTS, [_batch(COUNTS, [{"customer": "a", "n": 2},
                                              {"customer": "c", "n": 1}])])
    # prepared: readers still see the whole old table (DELETE, not TRUNCATE: no lock on
    # readers while the branch waits for its decision)
    with psycopg.connect(pg_dsn, autocommit=True) as reader:
        reader.execute("SET lock_timeout = '2s'")
        assert _rows(reader, table) == [("a", 1), ("b", 1)]
    p.commit(b, h)
    assert _rows(admin, table) == [("a", 2), ("c", 1)]
    b2 = _branch(p, 2)
    h2 = p.prepare(b2, COUNTS, [_batch(COUNTS, [{"customer": "q", "n": 1}])])
    p.abort(b2, h2)
    assert _rows(admin, table) == [("a", 2), ("c", 1)]
    _no_litter(admin)


def test_complete_refuses_duplicate_keys(pg_dsn: str, admin: Any, table: str) -> None:
    p = PostgresParticipant(pg_dsn, table, mode="complete", key="customer")
    p.check(COUNTS)
    _land(p, COUNTS, [{"customer": "a", "n": 1}], 0)
    with pytest.raises(PrepareRefused, match="occur more than once"):
        p.prepare(_branch(p, 1), COUNTS,
                  [_batch(COUNTS, [{"customer": "b", "n": 1}, {"customer": "b", "n": 2}])])
    assert _rows(admin, table) == [("a", 1)]
    _no_litter(admin)


# ------------------------------------------------------------------- on_schema_change

WIDER = pa.schema([("customer", pa.string()), ("n", pa.int64()), ("region", pa.string())])


def test_add_columns_adds_nullable_columns_then_writes(
    pg_dsn: str, admin: Any, table: str
) -> None:
    p = PostgresParticipant(pg_dsn, table, mode="upsert", key="customer",
                            on_schema_change="add_columns")
    p.check(COUNTS)
    _land(p, COUNTS, [{"customer": "a", "n": 1}], 0)
    p.check(WIDER)
    _land(p, WIDER, [{"customer": "b", "n": 1, "region": "eu"}], 1)
    assert _rows(admin, table) == [("a", 1, None), ("b", 1, "eu")]


def test_schema_change_fail_names_the_columns_and_the_fix(
    pg_dsn: str, admin: Any, table: str
) -> None:
    p = PostgresParticipant(pg_dsn, table)
    p.check(COUNTS)
    with pytest.raises(ParticipantError) as info:
        p.check(WIDER)
    msg = str(info.value)
    assert "column 'region' is missing from the table" in msg, msg
    assert "on_schema_change='add_columns'" in msg, msg
    with pytest.raises(InvalidRequest, match="on_schema_change must be one of fail, add_columns"):
        PostgresParticipant(pg_dsn, table, on_schema_change="evolve")


def test_add_columns_still_refuses_a_type_change_and_alters_nothing(
    pg_dsn: str, admin: Any, table: str
) -> None:
    p = PostgresParticipant(pg_dsn, table, on_schema_change="add_columns")
    p.check(COUNTS)
    changed = pa.schema([("customer", pa.string()), ("n", pa.string()),
                         ("region", pa.string())])
    with pytest.raises(ParticipantError, match="column 'n' is bigint in the table"):
        p.check(changed)
    cols = [r[0] for r in admin.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = %s "
        "ORDER BY ordinal_position", (table,)).fetchall()]
    assert cols == ["customer", "n"]  # 'region' was not added: the check failed first


def test_descriptor_carries_the_mode_options(pg_dsn: str, table: str) -> None:
    p = PostgresParticipant(pg_dsn, table, mode="upsert", key=["a", "b"], delete_when="gone",
                            on_schema_change="add_columns")
    q = PostgresParticipant.from_descriptor(p.descriptor(), {})
    assert (q.mode, q.key, q.delete_when, q.on_schema_change) == (
        "upsert", ("a", "b"), "gone", "add_columns")
    r = PostgresParticipant.from_descriptor(PostgresParticipant(pg_dsn, table).descriptor(), {})
    assert (r.mode, r.key, r.delete_when, r.on_schema_change) == ("append", (), None, "fail")
