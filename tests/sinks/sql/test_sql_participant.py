"""SqlAlchemyParticipant beyond the kit: bad inputs (exact messages), upsert, column types,
rebuild by kind, and a MariaDB server SIGKILLed with branches prepared and a commit in
flight."""

from __future__ import annotations

import datetime as dt
import os
import signal
import threading
import uuid
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest
import sqlalchemy as sa

from tests.sinks.sql.sql_support import SqlTarget, pg_url
from twophase.errors import InvalidRequest
from twophase.participant import (
    BranchStatus,
    ParticipantError,
    PrepareRefused,
    known_kinds,
    rebuild,
    secret_env_name,
)
from twophase.sinks.sql import SqlAlchemyParticipant
from twophase.testing.conformance import SCHEMA, batch_for, make_branch, rows_for
from twophase.testing.localmariadb import LocalMariaDB


@pytest.fixture(params=["mariadb", "postgresql"])
def url(request: pytest.FixtureRequest) -> str:
    if request.param == "mariadb":
        return str(request.getfixturevalue("mariadb"))
    return pg_url(request.getfixturevalue("pg_dsn"))


@pytest.fixture()
def target(url: str) -> Any:
    t = SqlTarget(url)
    yield t
    t.close()


# -- bad inputs -----------------------------------------------------------------------------


@pytest.mark.parametrize("table", ["t; DROP TABLE x", "orders`", "1abc", "a" * 61, ""])
def test_hostile_table_names_are_refused(mariadb: str, table: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        SqlAlchemyParticipant(mariadb, table)
    assert str(err.value) == (
        f"invalid table name {table!r}: use a letter or _ then up to 59 of A-Z a-z 0-9 _"
    )


def test_hostile_key_and_marker_names_are_refused(mariadb: str) -> None:
    with pytest.raises(InvalidRequest, match=r"^invalid key column 'k\)--'"):
        SqlAlchemyParticipant(mariadb, "t", mode="upsert", key="k)--")
    with pytest.raises(InvalidRequest, match=r"^invalid marker table name 'm m'"):
        SqlAlchemyParticipant(mariadb, "t", marker_table="m m")


def test_bad_options_are_refused(mariadb: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        SqlAlchemyParticipant("sqlite:///x.db", "t")
    assert str(err.value) == (
        "url 'sqlite:///x.db': dialect 'sqlite' has no two-phase commit twophase can use; "
        "use mysql+pymysql:// (MySQL, MariaDB) or postgresql+psycopg:// (PostgreSQL)"
    )
    with pytest.raises(InvalidRequest) as err:
        SqlAlchemyParticipant(mariadb, "t", mode="upsert")
    assert str(err.value) == (
        "mode='upsert' needs key=: the column(s) that identify a row (a primary or unique "
        "key of the table), e.g. key='customer'"
    )
    with pytest.raises(InvalidRequest, match=r"^mode must be one of append, upsert; got 'merge'$"):
        SqlAlchemyParticipant(mariadb, "t", mode="merge")
    with pytest.raises(InvalidRequest, match=r"^invalid SQLAlchemy url: "):
        SqlAlchemyParticipant("not a url", "t")


def test_unmapped_types_are_refused_before_anything_is_written(target: SqlTarget) -> None:
    schema = pa.schema([("id", pa.int64()), ("tags", pa.list_(pa.string())),
                        ("attrs", pa.struct([("a", pa.int32())]))])
    p = target.participant()
    with pytest.raises(ParticipantError) as err:
        p.check(schema)
    assert str(err.value) == (
        f"{p.describe()}: column 'tags' has Arrow type list<item: string>, which has no SQL "
        "column type here (supported: booleans, integers, floats, decimals, strings, binary, "
        "dates, timestamps); convert it before the sink, e.g. to_json(col) for lists, "
        "structs and maps, or cast(col as string); column 'attrs' has Arrow type "
        "struct<a: int32>, which has no SQL column type here (supported: booleans, "
        "integers, floats, decimals, strings, binary, dates, timestamps); convert it before "
        "the sink, e.g. to_json(col) for lists, structs and maps, or cast(col as string)"
    )
    with target.engine.connect() as conn:
        assert not sa.inspect(conn).has_table(target.table)


def test_misfit_table_is_refused_before_writing(target: SqlTarget) -> None:
    with target.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {target.table} (id DATE, other INT NOT NULL)"))
    p = target.participant()
    with pytest.raises(ParticipantError) as err:
        p.check(SCHEMA)
    assert str(err.value) == (
        f"{p.describe()}: table {target.table} does not fit the data: column 'id' is DATE in "
        "the table but int64 in the data; column 'label' is in the data but not in the "
        "table; column 'amount' is in the data but not in the table; table column 'other' "
        "is NOT NULL without a default and the data has no such column"
    )


def test_upsert_needs_a_key_on_an_existing_table(target: SqlTarget) -> None:
    with target.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {target.table} (id BIGINT, label TEXT, "
                             "amount DOUBLE PRECISION)"))
    p = SqlAlchemyParticipant(target.url, target.table, mode="upsert", key="id")
    with pytest.raises(ParticipantError) as err:
        p.check(SCHEMA)
    assert str(err.value) == (
        f"{p.describe()}: table {target.table} does not fit the data: mode='upsert' needs a "
        f"primary key or unique key on ['id'] (ALTER TABLE {target.table} ADD UNIQUE (id))"
    )


def test_too_long_value_is_refused_not_truncated(mariadb: str) -> None:
    t = SqlTarget(mariadb, mode="upsert", key="k")
    try:
        schema = pa.schema([("k", pa.string()), ("v", pa.int64())])
        p = t.participant()
        p.check(schema)
        b = make_branch(p)
        batch = pa.RecordBatch.from_pylist([{"k": "x" * 256, "v": 1}], schema=schema)
        with pytest.raises(PrepareRefused) as err:
            p.prepare(b, schema, [batch])
        assert str(err.value) == (
            f"{p.describe()}: rows refused during insert: (1406) Data too long for column "
            "'k' at row 1"
        )
        assert p.status(b) is BranchStatus.ABSENT
        assert p.in_doubt(b.sink) == []
        assert t.rows() == []
    finally:
        t.close()


def test_duplicate_keys_in_one_batch_are_refused(target: SqlTarget) -> None:
    p = SqlAlchemyParticipant(target.url, target.table, mode="upsert", key="id")
    p.check(SCHEMA)
    b = make_branch(p)
    rows = [{"id": 1, "label": "a", "amount": 1.0}, {"id": 1, "label": "b", "amount": 2.0}]
    with pytest.raises(PrepareRefused) as err:
        p.prepare(b, SCHEMA, [pa.RecordBatch.from_pylist(rows, schema=SCHEMA)])
    assert str(err.value) == (
        f"{p.describe()}: batch 0 refused before writing: key {{'id': 1}} appears 2 times. "
        "In mode='upsert' each key must appear once per batch; deduplicate before the sink "
        "(dropDuplicates(key) or a groupBy(key) aggregation)"
    )


# -- modes and types ------------------------------------------------------------------------


def test_upsert_updates_rows_by_key(target: SqlTarget) -> None:
    p = SqlAlchemyParticipant(target.url, target.table, mode="upsert", key="id",
                              name=target.name)
    p.check(SCHEMA)
    assert p.partition_columns() == ("id",)
    b0 = make_branch(p, batch_id=0)
    first = [{"id": i, "label": f"v0-{i}", "amount": float(i)} for i in range(5)]
    p.commit(b0, p.prepare(b0, SCHEMA, [pa.RecordBatch.from_pylist(first, schema=SCHEMA)]))
    b1 = make_branch(p, lineage=b0.lineage, batch_id=1)
    second = [{"id": i, "label": f"v1-{i}", "amount": None} for i in range(3, 8)]
    p.commit(b1, p.prepare(b1, SCHEMA, [pa.RecordBatch.from_pylist(second, schema=SCHEMA)]))
    got = sorted(target.rows(), key=lambda r: r["id"])
    assert got == sorted(first[:3] + second, key=lambda r: r["id"])
    p.close()


def test_column_types_round_trip(target: SqlTarget) -> None:
    schema = pa.schema([
        ("id", pa.int32()), ("flag", pa.bool_()), ("small", pa.int16()),
        ("big", pa.int64()), ("ratio", pa.float32()), ("price", pa.decimal128(12, 3)),
        ("day", pa.date32()), ("at", pa.timestamp("us", tz="Europe/Paris")),
        ("naive", pa.timestamp("us")), ("blob", pa.binary()), ("text", pa.large_string()),
    ])
    row = {"id": 1, "flag": True, "small": -7, "big": 2**62, "ratio": 0.5,
           "price": Decimal("1234.567"), "day": dt.date(2024, 2, 29),
           "at": dt.datetime(2024, 6, 1, 12, 0, 0, 123456, tzinfo=dt.timezone.utc),
           "naive": dt.datetime(2024, 6, 1, 1, 2, 3, 4), "blob": b"\x00\xffbin",
           "text": "ünïcødé ✓ 'quote'"}
    p = target.participant()
    p.check(schema)
    b = make_branch(p)
    p.commit(b, p.prepare(b, schema, [pa.RecordBatch.from_pylist([row], schema=schema)]))
    (got,) = target.rows()
    at = got.pop("at")
    want_at = row.pop("at")
    assert at.replace(tzinfo=dt.timezone.utc) == want_at  # MySQL DATETIME is naive UTC
    got["flag"] = bool(got["flag"])
    assert got == row
    p.close()


def test_large_branch_is_chunked_and_exact(target: SqlTarget) -> None:
    p = SqlAlchemyParticipant(target.url, target.table, name=target.name, chunk_rows=1000)
    p.check(SCHEMA)
    b = make_branch(p)
    batches = [batch_for(make_branch(p, lineage=b.lineage, batch_id=i), 2500)
               for i in range(3)]
    handle = p.prepare(b, SCHEMA, batches)
    assert handle["rows"] == "7500" and target.rows() == []
    p.commit(b, handle)
    assert len(target.rows()) == 7500
    p.close()


# -- rebuild by kind ------------------------------------------------------------------------


def test_rebuilt_by_kind_with_the_password_from_the_environment(
    mariadb_server: LocalMariaDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert known_kinds()["sql"] == "twophase.sinks.sql:SqlAlchemyParticipant"
    user = f"u{uuid.uuid4().hex[:8]}"
    mariadb_server.sql(f"CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY 'pw-s3cret'")
    mariadb_server.sql(f"GRANT ALL ON twophase.* TO '{user}'@'127.0.0.1'")
    url = f"mysql+pymysql://{user}:pw-s3cret@127.0.0.1:{mariadb_server.port}/twophase"
    t = SqlTarget(url, mode="upsert", key="id")
    try:
        p = t.participant()
        p.check(SCHEMA)
        d = p.descriptor()
        assert "s3cret" not in str(d)
        assert d["options"]["secrets"] == "password"
        b = make_branch(p)
        handle = p.prepare(b, SCHEMA, [batch_for(b)])
        p.close()
        blind = rebuild(d, {})  # no password: the server refuses it, clearly
        with pytest.raises(ParticipantError, match=r"cannot read the status of .*\(1045\) "
                           r"Access denied for user"):
            blind.status(b)
        blind.close()
        monkeypatch.setenv(secret_env_name(p.name, "password"), "pw-s3cret")
        again = rebuild(d)
        assert isinstance(again, SqlAlchemyParticipant) and again.key == ("id",)
        assert again.in_doubt(b.sink) == [b]
        again.commit(b, handle)
        assert sorted(r["id"] for r in t.rows()) == [r["id"] for r in rows_for(b)]
        again.close()
    finally:
        t.close()


def test_unreachable_server_votes_no_with_the_cause() -> None:
    from twophase.testing.servers import free_port

    port = free_port()
    p = SqlAlchemyParticipant(f"mysql+pymysql://root@127.0.0.1:{port}/x", "t")
    b = make_branch(p)
    with pytest.raises(PrepareRefused) as err:
        p.prepare(b, SCHEMA, [batch_for(b)])
    assert str(err.value) == (
        f"{p.describe()}: cannot read the branch state: server unreachable after 3 tries: "
        f"(2003) Can't connect to MySQL server on '127.0.0.1' ([Errno 111] Connection refused)"
    )
    with pytest.raises(ParticipantError, match=r"cannot read the status of .* unreachable"):
        p.status(b)
    p.close()


def test_missing_create_privilege_is_reported(mariadb_server: LocalMariaDB) -> None:
    user = f"r{uuid.uuid4().hex[:8]}"
    mariadb_server.sql(f"CREATE USER '{user}'@'127.0.0.1'")
    mariadb_server.sql(f"GRANT SELECT, INSERT ON twophase.* TO '{user}'@'127.0.0.1'")
    url = f"mysql+pymysql://{user}@127.0.0.1:{mariadb_server.port}/twophase"
    p = SqlAlchemyParticipant(url, f"t_{uuid.uuid4().hex[:8]}", marker_table="m_" + user)
    with pytest.raises(ParticipantError) as err:
        p.check(SCHEMA)
    assert str(err.value) == (
        f"{p.describe()}: cannot create table m_{user}, m_{user}_xids: (1142) CREATE command "
        f"denied to user '{user}'@'127.0.0.1' for table `twophase`.`m_{user}` (grant CREATE "
        "on the database, or create the tables beforehand)"
    )
    p.close()


# -- the server crashes -----------------------------------------------------------------------


@pytest.fixture()
def crashing_mariadb() -> Any:
    server = LocalMariaDB().start()
    yield server
    server.stop()


def test_server_sigkilled_after_prepare_and_during_commit(crashing_mariadb: LocalMariaDB) -> None:
    """Three branches prepared, one committed, one commit in flight when the server is
    SIGKILLed: after the restart XA RECOVER still lists the two unsettled branches, status
    reads them from the server, and they are committed and aborted from a new object."""
    server = crashing_mariadb
    t = SqlTarget(server.url)
    p = t.participant()
    p.check(SCHEMA)
    lineage = uuid.uuid4().hex[:16]
    done, in_flight, doomed = (make_branch(p, lineage=lineage, partition=i) for i in range(3))
    handles = {b: p.prepare(b, SCHEMA, [batch_for(b)]) for b in (done, in_flight, doomed)}
    p.commit(done, handles[done])

    # The commit of `in_flight` begins while the server is stopped, then the server dies.
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    outcome: list[BaseException | None] = []

    def commit() -> None:
        try:
            p.commit(in_flight, handles[in_flight])
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=commit)
    worker.start()
    worker.join(1.0)
    assert worker.is_alive(), "the commit should be waiting for the stopped server"
    server.kill()
    worker.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], ParticipantError), outcome
    p.close()

    server.restart()
    recovered = sorted(x[3].decode() for x in server.sql("XA RECOVER"))
    assert recovered == sorted(handles[b]["xid"] for b in (in_flight, doomed))
    fresh = t.participant()
    assert fresh.status(done) is BranchStatus.COMMITTED
    assert fresh.status(in_flight) is BranchStatus.PREPARED
    assert fresh.in_doubt(done.sink) == sorted([in_flight, doomed])
    assert sorted(r["id"] for r in t.rows()) == [r["id"] for r in rows_for(done)]
    fresh.commit(in_flight, None)
    fresh.commit(done, handles[done])  # unknown XID, but the marker proves it: success
    fresh.abort(doomed, None)
    assert server.sql("XA RECOVER") == []
    assert fresh.in_doubt(done.sink) == []
    want = sorted(r["id"] for b in (done, in_flight) for r in rows_for(b))
    assert sorted(r["id"] for r in t.rows()) == want
    with pytest.raises(ParticipantError, match="it is not prepared and no marker shows"):
        fresh.commit(doomed, None)  # aborted: committing it now must fail loudly
    fresh.close()
    t.close()
