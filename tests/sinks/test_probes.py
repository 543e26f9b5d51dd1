"""Each table and SQL participant tries its target before the first batch (``probe``,
run on the driver and on every executor): a target that refuses is named with its cause
and fix in the first line, classified permanent, and nothing is written."""

from __future__ import annotations

from pathlib import Path

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
