"""Nested columns into PostgreSQL (issue 26): structs and maps as ``jsonb``, lists of a
scalar type as that type's array, other lists as ``jsonb``; ``nested='refuse'`` refuses
them before anything is written. Against the suite's real server, through the
participant's own COPY path (prepare, commit), read back with plain SQL."""

from __future__ import annotations

import datetime as dt
import decimal
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from twophase.errors import InvalidRequest
from twophase.participant import BranchRef, ParticipantError
from twophase.sinks.postgres import PostgresParticipant

NESTED = pa.schema([
    ("id", pa.int64()),
    ("attrs", pa.struct([("colour", pa.string()), ("size", pa.int32()),
                         ("price", pa.decimal128(8, 2)), ("seen", pa.date32())])),
    ("labels", pa.map_(pa.string(), pa.float64())),
    ("tags", pa.list_(pa.string())),
    ("scores", pa.list_(pa.int64())),
    ("stamps", pa.list_(pa.timestamp("us", tz="UTC"))),
    ("blobs", pa.list_(pa.binary())),
    ("points", pa.list_(pa.struct([("x", pa.float64()), ("y", pa.float64())]))),
    ("grid", pa.list_(pa.list_(pa.int32()))),
])

ROWS: list[dict[str, Any]] = [
    {"id": 1,
     "attrs": {"colour": 'red "dark", \\ odd', "size": 3,
               "price": decimal.Decimal("12.50"), "seen": dt.date(2026, 1, 2)},
     "labels": [("a", 1.5), ("b,c", float("nan"))],
     "tags": ["x", 'q"uote', "back\\slash", "com,ma", "{brace}", None, "", "NULL"],
     "scores": [1, None, -3],
     "stamps": [dt.datetime(2026, 5, 1, 12, 0, tzinfo=dt.timezone.utc)],
     "blobs": [b"\x00\xff", None],
     "points": [{"x": 1.0, "y": float("inf")}],
     "grid": [[1, 2], [], None]},
    {"id": 2, "attrs": None, "labels": None, "tags": [], "scores": None, "stamps": [],
     "blobs": [], "points": None, "grid": []},
]


@pytest.fixture
def admin(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SET TIME ZONE 'UTC'")
        yield conn


@pytest.fixture
def table() -> str:
    return f"n_{uuid.uuid4().hex[:12]}"


def _write(p: PostgresParticipant, schema: pa.Schema, rows: list[dict[str, Any]]) -> None:
    p.check(schema)
    branch = BranchRef("s", "lin", 0, 1, p.name, 0)
    handle = p.prepare(branch, schema, [pa.RecordBatch.from_pylist(rows, schema=schema)])
    p.commit(branch, handle)


def test_structs_maps_and_lists_land_as_jsonb_and_arrays(
    pg_dsn: str, admin: psycopg.Connection[Any], table: str
) -> None:
    p = PostgresParticipant(pg_dsn, table)
    _write(p, NESTED, ROWS)
    types = dict(admin.execute(
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = %s::regclass AND attnum > 0", (table,)).fetchall())
    assert types == {
        "id": "bigint", "attrs": "jsonb", "labels": "jsonb", "tags": "text[]",
        "scores": "bigint[]", "stamps": "timestamp with time zone[]", "blobs": "bytea[]",
        "points": "jsonb", "grid": "jsonb",
    }
    got = admin.execute(f"SELECT * FROM {table} ORDER BY id").fetchall()
    one, two = got
    assert one[1] == {"colour": 'red "dark", \\ odd', "size": 3, "price": "12.50",
                      "seen": "2026-01-02"}
    assert one[2] == {"a": 1.5, "b,c": "NaN"}
    assert one[3] == ["x", 'q"uote', "back\\slash", "com,ma", "{brace}", None, "", "NULL"]
    assert one[4] == [1, None, -3]
    assert one[5] == [dt.datetime(2026, 5, 1, 12, 0, tzinfo=dt.timezone.utc)]
    assert one[6] == [b"\x00\xff", None]
    assert one[7] == [{"x": 1.0, "y": "Infinity"}]
    assert one[8] == [[1, 2], [], None]
    assert two[1:] == (None, None, [], None, [], [], None, [])
    # jsonb is queryable as such
    assert admin.execute(f"SELECT attrs->>'colour' FROM {table} WHERE id = 1"
                         ).fetchone() == ('red "dark", \\ odd',)
    p.close()


def test_an_existing_json_column_takes_a_struct(
    pg_dsn: str, admin: psycopg.Connection[Any], table: str
) -> None:
    admin.execute(f"CREATE TABLE {table} (id bigint, attrs json)")
    schema = pa.schema([("id", pa.int64()), ("attrs", pa.struct([("k", pa.string())]))])
    p = PostgresParticipant(pg_dsn, table)
    _write(p, schema, [{"id": 1, "attrs": {"k": "v"}}])
    assert admin.execute(f"SELECT attrs::text FROM {table}").fetchone() == (
        '{"k": "v"}',)
    p.close()


def test_a_list_into_a_text_column_is_refused_naming_the_array_type(
    pg_dsn: str, admin: psycopg.Connection[Any], table: str
) -> None:
    admin.execute(f"CREATE TABLE {table} (id bigint, tags text)")
    schema = pa.schema([("id", pa.int64()), ("tags", pa.list_(pa.string()))])
    p = PostgresParticipant(pg_dsn, table)
    with pytest.raises(ParticipantError, match=r"column 'tags' is text .* \(expected text\[\]\)"):
        p.check(schema)
    p.close()


def test_nested_refuse_refuses_before_writing(
    pg_dsn: str, admin: psycopg.Connection[Any], table: str
) -> None:
    p = PostgresParticipant(pg_dsn, table, nested="refuse")
    schema = pa.schema([("id", pa.int64()), ("attrs", pa.map_(pa.string(), pa.int64()))])
    with pytest.raises(ParticipantError) as info:
        p.check(schema)
    msg = str(info.value)
    assert "column 'attrs' has the nested Arrow type map<string, int64>" in msg
    assert "nested='refuse'" in msg and "nested='json'" in msg
    assert admin.execute("SELECT to_regclass(%s)", (table,)).fetchone() == (None,)
    p.close()


def test_nested_policy_is_checked_and_survives_the_descriptor(pg_dsn: str) -> None:
    with pytest.raises(InvalidRequest, match=r"nested must be one of json, refuse; got 'yaml'"):
        PostgresParticipant(pg_dsn, "t", nested="yaml")  # type: ignore[arg-type]
    p = PostgresParticipant(pg_dsn, "t", nested="refuse")
    again = PostgresParticipant.from_descriptor(p.descriptor(), {})
    assert again.nested == "refuse"
