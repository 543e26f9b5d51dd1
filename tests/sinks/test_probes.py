"""Each table and SQL participant tries its target before the first batch (``probe``,
run on the driver and on every executor): a target that refuses is named with its cause
and fix in the first line, classified permanent, and nothing is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from twophase.errors import Failure, TargetProblem
from twophase.sinks.delta import DeltaParticipant
from twophase.sinks.iceberg import IcebergParticipant
from twophase.sinks.sql import SqlAlchemyParticipant


def test_delta_probe_names_an_unwritable_folder() -> None:
    p = DeltaParticipant("/proc/forbidden/lake/orders", name="dl")
    with pytest.raises(TargetProblem) as err:
        p.probe()
    first = str(err.value).splitlines()[0]
    assert first.startswith("delta participant 'dl' (table /proc/forbidden/lake/orders): "
                            "cannot write a file in the table's folder: missing object"), first
    assert "Fix: pass a path (or bucket and storage_options) this user can write" in first
    assert err.value.kind is Failure.MISSING


def test_delta_probe_passes_and_leaves_nothing(tmp_path: Path) -> None:
    p = DeltaParticipant(str(tmp_path / "orders"), name="dl")
    p.probe()
    assert [f for f in (tmp_path / "orders").rglob("*") if f.is_file()] == []


def test_iceberg_probe_names_an_unreachable_catalog() -> None:
    p = IcebergParticipant("shop.orders", {"type": "sql", "uri": "sqlite:////proc/forbidden/c.db",
                                           "warehouse": "file:///proc/forbidden/wh"}, name="ice")
    with pytest.raises(TargetProblem, match=r"^iceberg participant 'ice' \(table shop\.orders\): "
                       r"cannot reach the catalog: .* Fix: check the catalog properties"):
        p.probe()


def test_sql_probe_says_authentication_at_once(pg_dsn: str) -> None:
    host_port = pg_dsn.split("@", 1)[1].split("/", 1)[0]
    p = SqlAlchemyParticipant(f"postgresql+psycopg://nobody@{host_port}/postgres", "orders")
    with pytest.raises(TargetProblem) as err:
        p.probe()
    first = str(err.value).splitlines()[0]
    assert "cannot connect: authentication: " in first and 'role "nobody"' in first, first
    assert "Fix: check the URL's host, port, database, user and password" in first
    assert err.value.kind is Failure.AUTHENTICATION
    p.close()


def _role_without_create(pg_dsn: str) -> tuple[str, str]:
    """A login role whose schema (its search_path) it may use but not create in."""
    import uuid

    import psycopg

    role = f"nocreate_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"CREATE SCHEMA s_{role}")
        conn.execute(f"GRANT USAGE ON SCHEMA s_{role} TO {role}")
        conn.execute(f"ALTER ROLE {role} SET search_path = s_{role}")
    host_port = pg_dsn.split("@", 1)[1].split("/", 1)[0]
    return role, f"postgresql+psycopg://{role}@{host_port}/postgres"


def test_sql_probe_names_a_missing_create_right(pg_dsn: str) -> None:
    role, url = _role_without_create(pg_dsn)
    p = SqlAlchemyParticipant(url, "orders")
    with pytest.raises(TargetProblem) as err:
        p.probe()
    text = str(err.value)
    assert "may not create tables in the current schema" in text, text
    assert "orders, twophase_markers, twophase_markers_xids do not exist yet" in text, text
    assert f'Fix: GRANT CREATE ON SCHEMA "s_{role}" TO "{role}", or create the tables' in text
    assert err.value.kind is Failure.AUTHORIZATION
    p.close()
    p = SqlAlchemyParticipant(url, "orders", create=False)
    with pytest.raises(TargetProblem, match=r"do not exist and create=False"):
        p.probe()
    p.close()


def test_sql_probe_names_a_server_without_two_phase_commit(tmp_path: Path) -> None:
    from twophase.testing.localpg import LocalPostgres

    with LocalPostgres(max_prepared_transactions=0, fsync=False) as server:
        p = SqlAlchemyParticipant(server.dsn.replace("postgresql://", "postgresql+psycopg://"),
                                  "orders")
        with pytest.raises(TargetProblem, match=r"refuses PREPARE TRANSACTION "
                           r"\(max_prepared_transactions=0\).*Fix: set "
                           r"max_prepared_transactions in postgresql.conf"):
            p.probe()
        p.close()


def test_sql_probe_passes_mariadb_xa_and_names_a_missing_create_right(
    mariadb_server: Any,
) -> None:
    """A MariaDB user lacking CREATE is refused before the first write with the exact
    GRANT (its account and database), and that very statement lets the probe pass. XA
    needs no grant on MariaDB (sql/xa.cc checks none for XA RECOVER): a user holding
    nothing but its login runs XA START/END/ROLLBACK and XA RECOVER, so the XA refusal
    cannot be provoked by withholding a privilege here (it is tested on PostgreSQL)."""
    import re
    import uuid

    import pymysql

    user = f"nc{uuid.uuid4().hex[:8]}"
    bare = f"nx{uuid.uuid4().hex[:8]}"
    root = pymysql.connect(unix_socket=str(mariadb_server.socket_path), user="root",
                           autocommit=True)
    try:
        with root.cursor() as cur:
            cur.execute(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'")
            cur.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON "
                        f"{mariadb_server.database}.* TO '{user}'@'%'")
            cur.execute(f"CREATE USER '{bare}'@'%' IDENTIFIED BY 'pw'")  # USAGE only
        ok = SqlAlchemyParticipant(mariadb_server.url, f"probe_{user}")
        ok.probe()  # root: XA START/END/ROLLBACK and XA RECOVER work, CREATE allowed
        ok.close()
        url = mariadb_server.url.replace("://root@", f"://{user}:pw@")
        p = SqlAlchemyParticipant(url, f"probe_{user}")
        with pytest.raises(TargetProblem) as err:
            p.probe()
        text = str(err.value)
        assert "XA" not in text, text
        grant = f"GRANT CREATE ON `{mariadb_server.database}`.* TO '{user}'@'%'"
        assert re.search(r"may not create tables in this database \(\(1142, \"CREATE command "
                         rf"denied to user '{user}'.*Fix: {re.escape(grant)}, or create the "
                         r"tables beforehand", text), text
        assert err.value.kind is Failure.AUTHORIZATION
        p.close()
        with root.cursor() as cur:
            cur.execute(grant)  # the fix as printed (a database grant reaches new sessions)
        p = SqlAlchemyParticipant(url, f"probe_{user}")
        p.probe()  # without DROP (not a right the participant needs): nothing left behind
        p.close()
        with root.cursor() as cur:
            cur.execute(f"SHOW TABLES FROM `{mariadb_server.database}` "
                        "LIKE 'twophase\\_probe\\_%'")
            assert cur.fetchall() == ()
        xa = pymysql.connect(host="127.0.0.1", port=mariadb_server.port, user=bare,
                             password="pw", autocommit=True)
        try:
            with xa.cursor() as cur:
                cur.execute("SHOW GRANTS")
                [(only,)] = cur.fetchall()  # the login alone: no privilege at all
                assert only.startswith(f"GRANT USAGE ON *.* TO `{bare}`@`%`"), only
                cur.execute("XA RECOVER")
                cur.fetchall()
                cur.execute(f"XA START 'probe-{bare}'")
                cur.execute(f"XA END 'probe-{bare}'")
                cur.execute(f"XA ROLLBACK 'probe-{bare}'")
        finally:
            xa.close()
    finally:
        root.close()

