"""PostgresParticipant against the real test server: types, table fit, bad input, names."""

from __future__ import annotations

import datetime as dt
import decimal
import math
import pickle
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql

from twophase.participant import BranchRef, BranchStatus, ParticipantError, PrepareRefused
from twophase.sinks.postgres import GID_MAX_BYTES, PostgresParticipant, gid_for, parse_gid
from twophase.testing.localpg import LocalPostgres


def _q(conn: psycopg.Connection[Any], query: str, *args: Any) -> list[tuple[Any, ...]]:
    return conn.execute(query, args).fetchall()


@pytest.fixture
def admin(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SET TIME ZONE 'UTC'")
        yield conn


@pytest.fixture
def table() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


def _branch(p: PostgresParticipant, **kw: Any) -> BranchRef:
    args: dict[str, Any] = {"sink": "s", "lineage": "lin", "batch_id": 0, "attempt": 0,
                            "participant": p.name, "partition": 0}
    args.update(kw)
    return BranchRef(**args)


def _nothing_left(admin: psycopg.Connection[Any], p: PostgresParticipant, table: str) -> None:
    assert _q(admin, "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s",
              f"%:{p.name}:%") == []
    exists = _q(admin, "SELECT to_regclass(%s)", table)[0][0]
    if exists:
        assert _q(admin, sql.SQL("SELECT count(*) FROM {}").format(
            sql.Identifier(table)).as_string(admin))[0][0] == 0


def _refused(p: PostgresParticipant, schema: pa.Schema, batch: pa.RecordBatch, *words: str) -> str:
    b = _branch(p)
    with pytest.raises(PrepareRefused) as info:
        p.prepare(b, schema, [batch])
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert p.status(b) is BranchStatus.ABSENT
    assert p.in_doubt("s") == []
    return msg


ALL_TYPES = pa.schema([
    ("i64", pa.int64()), ("i32", pa.int32()), ("f64", pa.float64()), ("s", pa.string()),
    ("b", pa.bool_()), ("ts", pa.timestamp("us", tz="UTC")), ("d", pa.date32()),
    ("dec", pa.decimal128(12, 3)), ("bin", pa.binary()),
])


def test_every_mapped_type_round_trips_through_copy(pg_dsn: str, admin: Any, table: str) -> None:
    rows = [
        {"i64": 2**62, "i32": -7, "f64": 0.1, "s": 'q"uo,te\nline\\back\ttab', "b": True,
         "ts": dt.datetime(2024, 2, 29, 23, 59, 59, 999999, tzinfo=dt.timezone.utc),
         "d": dt.date(2024, 2, 29), "dec": decimal.Decimal("-123456789.125"),
         "bin": b"\x00\x01\xff,\"\n"},
        {"i64": None, "i32": None, "f64": None, "s": None, "b": None, "ts": None, "d": None,
         "dec": None, "bin": None},
        {"i64": 0, "i32": 0, "f64": float("nan"), "s": "", "b": False,
         "ts": dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc), "d": dt.date(1, 1, 1),
         "dec": decimal.Decimal("0.000"), "bin": b""},
        {"i64": -1, "i32": 1, "f64": float("-inf"), "s": "NULL", "b": True, "ts": None,
         "d": None, "dec": None, "bin": None},
    ]
    p = PostgresParticipant(pg_dsn, table)
    p.check(ALL_TYPES)
    types = dict(_q(admin, "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
                           " WHERE attrelid = %s::regclass AND attnum > 0", table))
    assert types == {"i64": "bigint", "i32": "integer", "f64": "double precision", "s": "text",
                     "b": "boolean", "ts": "timestamp with time zone", "d": "date",
                     "dec": "numeric(12,3)", "bin": "bytea"}
    b = _branch(p)
    p.commit(b, p.prepare(b, ALL_TYPES, [pa.RecordBatch.from_pylist(rows, schema=ALL_TYPES)]))
    got = _q(admin, sql.SQL("SELECT * FROM {} ORDER BY i32 NULLS LAST, i64").format(
        sql.Identifier(table)).as_string(admin))
    back = [dict(zip(ALL_TYPES.names, r, strict=True)) for r in got]
    for r in back:
        if r["bin"] is not None:
            r["bin"] = bytes(r["bin"])
    want = sorted(rows, key=lambda r: (r["i32"] is None, r["i32"] or 0, r["i64"] or 0))
    assert math.isnan(back[1]["f64"]) and math.isnan(want[1]["f64"])
    back[1]["f64"] = want[1]["f64"] = None
    assert back == want
    p.close()


def test_handle_names_the_gid_and_participant(pg_dsn: str, table: str) -> None:
    p = PostgresParticipant(pg_dsn, table)
    schema = pa.schema([("x", pa.int64())])
    p.check(schema)
    b = _branch(p, batch_id=12, attempt=3, partition=4)
    h = p.prepare(b, schema, [pa.record_batch({"x": [1, 2]})])
    assert dict(h) == {"kind": "postgres", "participant": p.name, "gid": gid_for(b),
                       "rows": "2", "state": "prepared"}
    assert gid_for(b) == f"tp:s:lin:12:3:{p.name}:4"
    assert parse_gid(gid_for(b)) == b
    p.abort(b, h)
    with pytest.raises(ParticipantError, match="handle names"):
        p.commit(b, {"gid": "tp:s:other"})


def test_existing_table_with_missing_column_is_refused_before_writing(
    pg_dsn: str, admin: Any, table: str
) -> None:
    admin.execute(sql.SQL("CREATE TABLE {} (id bigint)").format(sql.Identifier(table)))
    p = PostgresParticipant(pg_dsn, table)
    with pytest.raises(ParticipantError, match=r"column 'label' is missing from the table"):
        p.check(pa.schema([("id", pa.int64()), ("label", pa.string())]))
    _nothing_left(admin, p, table)


def test_existing_table_with_wrong_types_names_column_and_types(
    pg_dsn: str, admin: Any, table: str
) -> None:
    admin.execute(sql.SQL("CREATE TABLE {} (id integer, price numeric(5,1), t text, "
                          "must text NOT NULL)").format(sql.Identifier(table)))
    p = PostgresParticipant(pg_dsn, table)
    schema = pa.schema([("id", pa.int64()), ("price", pa.decimal128(10, 2)), ("t", pa.bool_())])
    with pytest.raises(ParticipantError) as info:
        p.check(schema)
    msg = str(info.value)
    assert "column 'id' is integer in the table but the data is Arrow int64" in msg
    assert "column 'price' is numeric(5,1)" in msg
    assert "column 't' is text" in msg and "expected boolean" in msg
    assert "'must' is NOT NULL without a default" in msg


def test_compatible_existing_table_is_accepted(pg_dsn: str, admin: Any, table: str) -> None:
    admin.execute(sql.SQL("CREATE TABLE {} (id numeric, v varchar(10), extra text, "
                          "made timestamptz NOT NULL DEFAULT now())").format(sql.Identifier(table)))
    p = PostgresParticipant(pg_dsn, table)
    schema = pa.schema([("id", pa.int32()), ("v", pa.string())])
    p.check(schema)
    b = _branch(p)
    p.commit(b, p.prepare(b, schema, [pa.record_batch({"id": pa.array([5], pa.int32()),
                                                        "v": ["ok"]})]))
    assert _q(admin, sql.SQL("SELECT id, v FROM {}").format(
        sql.Identifier(table)).as_string(admin)) == [(5, "ok")]


def test_missing_table_with_create_false_is_an_error(pg_dsn: str, table: str) -> None:
    p = PostgresParticipant(pg_dsn, table, create=False)
    with pytest.raises(ParticipantError, match="does not exist"):
        p.check(pa.schema([("id", pa.int64())]))


def test_unsupported_arrow_type_is_refused_by_check(pg_dsn: str, table: str) -> None:
    p = PostgresParticipant(pg_dsn, table)
    with pytest.raises(ParticipantError, match=r"column 'span' has Arrow type duration"):
        p.check(pa.schema([("span", pa.duration("s"))]))


def test_wrong_value_type_at_prepare_votes_no(pg_dsn: str, admin: Any, table: str) -> None:
    admin.execute(sql.SQL("CREATE TABLE {} (id bigint)").format(sql.Identifier(table)))
    p = PostgresParticipant(pg_dsn, table)
    p.check(pa.schema([("id", pa.int64())]))
    schema = pa.schema([("id", pa.string())])  # the data drifted after check
    _refused(p, schema, pa.record_batch({"id": ["1", "abc"]}, schema=schema),
             "invalid input syntax for type bigint", "column id")
    _nothing_left(admin, p, table)


def test_null_in_not_null_column_votes_no(pg_dsn: str, admin: Any, table: str) -> None:
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("v", pa.string())])
    p = PostgresParticipant(pg_dsn, table)
    p.check(schema)
    loose = pa.schema([("id", pa.int64()), ("v", pa.string())])
    batch = pa.record_batch({"id": [1, None], "v": ["a", "b"]}, schema=loose)
    _refused(p, loose, batch, 'null value in column "id"', "not-null")
    _nothing_left(admin, p, table)


def test_constraint_violation_inside_the_batch_votes_no(
    pg_dsn: str, admin: Any, table: str
) -> None:
    admin.execute(sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, qty int CHECK (qty > 0))")
                  .format(sql.Identifier(table)))
    p = PostgresParticipant(pg_dsn, table)
    schema = pa.schema([("id", pa.int64()), ("qty", pa.int32())])
    p.check(schema)
    dup = pa.record_batch({"id": [1, 2, 1], "qty": pa.array([1, 1, 1], pa.int32())})
    _refused(p, schema, dup, "duplicate key", f"constraint {table}_pkey")
    neg = pa.record_batch({"id": [1, 2], "qty": pa.array([1, -1], pa.int32())})
    _refused(p, schema, neg, "check constraint", f"{table}_qty_check")
    _nothing_left(admin, p, table)


def test_value_the_server_cannot_store_votes_no(pg_dsn: str, admin: Any, table: str) -> None:
    schema = pa.schema([("s", pa.string())])
    p = PostgresParticipant(pg_dsn, table)
    p.check(schema)
    _refused(p, schema, pa.record_batch({"s": ["fine", "nul\x00byte"]}), "0x00")
    _nothing_left(admin, p, table)


def test_batch_not_matching_declared_schema_votes_no(pg_dsn: str, table: str) -> None:
    schema = pa.schema([("id", pa.int64())])
    p = PostgresParticipant(pg_dsn, table)
    p.check(schema)
    _refused(p, schema, pa.record_batch({"other": [1]}), "batch has schema")


def test_prepare_without_check_names_the_missing_table(pg_dsn: str, table: str) -> None:
    p = PostgresParticipant(pg_dsn, table, marker_table=f"{table}_m")
    schema = pa.schema([("id", pa.int64())])
    _refused(p, schema, pa.record_batch({"id": [1]}), "does not exist", "check(schema)")


@pytest.mark.parametrize("kw", [
    {"table": 'x"; DROP TABLE y; --'}, {"table": "a b"}, {"table": ""}, {"table": "1abc"},
    {"table": "t" * 64}, {"table": "ok", "schema": "pg_catalog; x"},
    {"table": "ok", "marker_table": "m-1"}, {"table": "ok", "name": "../etc"},
    {"table": "ok", "name": "a:b"}, {"table": "ok", "connect_timeout": 0},
])
def test_hostile_or_bad_names_are_refused_at_construction(pg_dsn: str, kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"invalid|connect_timeout"):
        PostgresParticipant(pg_dsn, **kw)


def test_gid_longer_than_the_server_allows_is_a_clear_error(pg_dsn: str) -> None:
    p = PostgresParticipant(pg_dsn, "t", name="p" * 64)
    b = BranchRef("s" * 64, "l" * 64, 10**12, 0, p.name, 0)
    with pytest.raises(ValueError, match=f"PostgreSQL allows at most {GID_MAX_BYTES}"):
        p.status(b)
    with pytest.raises(ValueError, match="belongs to participant"):
        p.status(BranchRef("s", "l", 0, 0, "someone-else", 0))


def test_unreachable_server_fails_check_and_votes_no(table: str) -> None:
    from twophase.testing.servers import free_port

    dsn = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    p = PostgresParticipant(dsn, table, connect_timeout=1)
    schema = pa.schema([("id", pa.int64())])
    with pytest.raises(ParticipantError, match="server unreachable after 3 tries"):
        p.check(schema)
    with pytest.raises(PrepareRefused, match="unreachable"):
        p.prepare(_branch(p), schema, [pa.record_batch({"id": [1]})])
    assert "127.0.0.1" in p.describe()


def test_max_prepared_transactions_zero_is_detected_up_front(table: str) -> None:
    with LocalPostgres(max_prepared_transactions=0, fsync=False) as server:
        p = PostgresParticipant(server.dsn, table)
        with pytest.raises(ParticipantError) as info:
            p.check(pa.schema([("id", pa.int64())]))
        msg = str(info.value)
        assert "max_prepared_transactions = 0" in msg
        assert "postgresql.conf" in msg and "restart" in msg
        p.close()


def test_lost_connection_is_retried_for_idempotent_calls(
    pg_dsn: str, admin: Any, table: str
) -> None:
    schema = pa.schema([("id", pa.int64())])
    p = PostgresParticipant(pg_dsn, table)
    p.check(schema)
    b = _branch(p)
    h = p.prepare(b, schema, [pa.record_batch({"id": [1]})])
    killed = _q(admin, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                       " WHERE application_name = %s", f"twophase-{p.name}")
    assert killed == [(True,)]
    assert p.status(b) is BranchStatus.PREPARED  # reconnects
    _q(admin, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
              " WHERE application_name = %s", f"twophase-{p.name}")
    p.commit(b, h)
    assert p.status(b) is BranchStatus.COMMITTED


def test_new_attempt_is_refused_while_an_earlier_one_is_prepared(
    pg_dsn: str, admin: Any, table: str
) -> None:
    schema = pa.schema([("id", pa.int64())])
    p = PostgresParticipant(pg_dsn, table)
    p.check(schema)
    first = _branch(p, attempt=0)
    h = p.prepare(first, schema, [pa.record_batch({"id": [1]})])
    with pytest.raises(PrepareRefused, match=r"earlier attempt \(tp:s:lin:0:0:"):
        p.prepare(_branch(p, attempt=1), schema, [pa.record_batch({"id": [1]})])
    p.abort(first, h)
    second = _branch(p, attempt=1)
    p.commit(second, p.prepare(second, schema, [pa.record_batch({"id": [1]})]))
    with pytest.raises(ParticipantError, match="already committed"):
        p.abort(second, None)
    p.abort(first, None)  # another attempt landed the data: aborting the old one is success
    with pytest.raises(ParticipantError, match="not prepared and no marker"):
        p.commit(_branch(p, batch_id=99), None)


def test_in_doubt_sees_only_this_database_and_participant(
    pg: LocalPostgres, pg_dsn: str, admin: Any, table: str
) -> None:
    other_db = f"db_{uuid.uuid4().hex[:8]}"
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(other_db)))
    schema = pa.schema([("id", pa.int64())])
    here = PostgresParticipant(pg_dsn, table)
    there = PostgresParticipant(pg_dsn.rsplit("/", 1)[0] + f"/{other_db}", table)
    neighbour = PostgresParticipant(pg_dsn, table, name="neighbour")
    for p in (here, there, neighbour):
        p.check(schema)
    # gids are unique per server, not per database: the other database's branch differs
    # by lineage here (same sink, same participant name).
    branches = {here: _branch(here), there: _branch(there, lineage="other"),
                neighbour: _branch(neighbour)}
    handles = {p: p.prepare(b, schema, [pa.record_batch({"id": [1]})])
               for p, b in branches.items()}
    try:
        assert here.in_doubt("s") == [branches[here]]
        assert there.in_doubt("s") == [branches[there]]
        assert neighbour.in_doubt("s") == [branches[neighbour]]
        assert here.in_doubt("s2") == []
    finally:
        for p, h in handles.items():
            p.abort(branches[p], h)
            p.close()


def test_pickled_participant_carries_no_connection(pg_dsn: str, table: str) -> None:
    p = PostgresParticipant(pg_dsn, table)
    p.check(pa.schema([("id", pa.int64())]))
    assert p._conn is not None
    clone = pickle.loads(pickle.dumps(p))
    assert clone._conn is None and clone.dsn == pg_dsn and clone.name == f"postgres-{table}"
    p.close()
