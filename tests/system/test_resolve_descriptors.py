"""``twophase resolve SINK`` settles any sink from what its coordinator recorded at
register: here two PostgreSQL tables in different schemas (one with its own marker
table) and a files participant with a non-default layout (jsonl, nested folder, own
name). The "job" prepares with the public participant API and dies; resolve runs as a
user runs it, a separate process given only the sink name and the coordinator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from tests.support.pg import fresh_pg_db
from twophase.client.connection import connect
from twophase.client.wire import VoteIn
from twophase.coordinator.store import Store
from twophase.participant import BranchRef, rebuild
from twophase.protocol import Decision, State, TxnKey
from twophase.sinks.files import STAGING_DIR, StagedFileParticipant
from twophase.sinks.postgres import PostgresParticipant

SINK = "orders"
LINEAGE = "L-resolve"
SCHEMA = pa.schema([("id", pa.int64()), ("item", pa.string())])


def _rows(ids: list[int]) -> list[pa.RecordBatch]:
    return [pa.RecordBatch.from_pylist([{"id": i, "item": f"i{i}"} for i in ids],
                                       schema=SCHEMA)]


def _ids(dsn: str, schema: str) -> list[int]:
    with psycopg.connect(dsn) as c:
        return sorted(r[0] for r in c.execute(f'SELECT id FROM "{schema}".orders'))


def _prepared(dsn: str) -> int:
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT count(*) FROM pg_prepared_xacts WHERE database = "
                        "current_database()").fetchone()
        assert row is not None
        return int(row[0])


def test_resolve_rebuilds_every_participant_from_the_coordinator(
    pg_dsn: str, tmp_path: Path
) -> None:
    dsn = fresh_pg_db(pg_dsn, "resolve_desc")
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE SCHEMA sales")
        c.execute("CREATE SCHEMA audit")
    lake = tmp_path / "lake" / "orders-v2"
    parts = [
        PostgresParticipant(dsn, "orders", schema="sales", name="pg-sales"),
        PostgresParticipant(dsn, "orders", schema="audit", name="pg-audit",
                            marker_table="audit_markers"),
        StagedFileParticipant(str(lake), format="jsonl", name="lake"),
    ]
    for part in parts:
        part.check(SCHEMA)
    coordinator = f"sqlite:///{tmp_path / 'coord.db'}"
    batch0 = {0: [1, 2], 1: [3]}
    with connect(coordinator) as conn:
        client = conn.client()
        epoch = client.register(SINK, [p.descriptor() for p in parts])  # type: ignore[misc]
        # batch 0: every branch prepared and voted YES (COMMIT); the job dies before commit
        client.begin(SINK, LINEAGE, 0, epoch, [p.name for p in parts], 2, 60)
        votes = []
        for part in parts:
            for partition, ids in batch0.items():
                ref = BranchRef(SINK, LINEAGE, 0, 1, part.name, partition)
                votes.append(VoteIn(ref.branch_id, True, part.prepare(ref, SCHEMA, _rows(ids))))
        assert client.vote(TxnKey(SINK, LINEAGE, 0, 1), epoch, votes).decision == Decision.COMMIT
        # batch 1: prepared, the votes never sent: undecided, presumed abort
        client.begin(SINK, LINEAGE, 1, epoch, [p.name for p in parts], 1, 60)
        for part in parts:
            part.prepare(BranchRef(SINK, LINEAGE, 1, 1, part.name, 0), SCHEMA, _rows([10, 11]))
    for part in parts:
        part.close()
    assert _prepared(dsn) == 2 * 2 + 2  # two tables x two partitions, and batch 1
    assert len(list((lake / STAGING_DIR).iterdir())) == 3

    # the job is gone: only the sink name and the coordinator are given
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWOPHASE_")}
    out = subprocess.run(
        [sys.executable, "-m", "twophase.cli", "resolve", SINK, "--coordinator", coordinator,
         "--json"], capture_output=True, text=True, timeout=120, env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:] + out.stdout[-2000:]
    report = json.loads(out.stdout)
    assert report["ok"] and not report["unresolved"]
    done = sorted((a["txn"].split("/")[2], a["action"]) for a in report["actions"])
    assert done.count(("0", "commit")) == 6 and ("1", "abort") in done

    assert _ids(dsn, "sales") == [1, 2, 3] and _ids(dsn, "audit") == [1, 2, 3]
    assert _prepared(dsn) == 0
    finals = sorted(p.name for p in lake.iterdir() if p.is_file())
    assert len(finals) == 2 and all(n.endswith(".jsonl") for n in finals)
    assert list((lake / STAGING_DIR).iterdir()) == []
    store = Store(coordinator, create=False)
    try:
        states = {r.txn.batch_id: r.txn.state for r in store.list(sink=SINK)}
    finally:
        store.close()
    assert states == {0: State.COMMITTED, 1: State.ABORTED}


def test_descriptors_keep_no_secret_and_take_it_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pg = PostgresParticipant("postgresql://app:s3cret-pw@db.example:5433/shop", "orders",
                             schema="sales", name="pg-sales")
    store = Store(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        store.register(SINK, [pg.descriptor()])
        with store.db.read() as conn:
            raw = conn.exec_driver_sql("SELECT descriptor FROM twophase_participants").all()
        recorded = store.participants(SINK)
    finally:
        store.close()
    assert "s3cret-pw" not in repr(raw)
    assert recorded[0]["options"]["secrets"] == "password"
    again = rebuild(recorded[0])
    assert isinstance(again, PostgresParticipant)
    assert (again.schema, again.table, again.name) == ("sales", "orders", "pg-sales")
    assert "s3cret-pw" not in again.dsn  # libpq's PGPASSWORD / ~/.pgpass apply then
    monkeypatch.setenv("TWOPHASE_SECRET_PG_SALES_PASSWORD", "s3cret-pw")
    assert "password=s3cret-pw" in rebuild(recorded[0]).dsn  # type: ignore[attr-defined]


def test_a_kafka_descriptor_names_its_secrets_and_never_carries_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from twophase.errors import InvalidRequest
    from twophase.sinks.kafka import KafkaParticipant

    kafka = KafkaParticipant("orders", {"bootstrap.servers": "broker:9092",
                                        "security.protocol": "SASL_SSL",
                                        "sasl.username": "app", "sasl.password": "pw-123"},
                             key="id", name="kafka-orders", transaction_timeout_ms=120_000)
    d = kafka.descriptor()
    assert "pw-123" not in json.dumps(d) and d["options"]["secrets"] == "sasl.password"
    for var in [k for k in os.environ if k.startswith("TWOPHASE_SECRET_")]:
        monkeypatch.delenv(var)
    with pytest.raises(InvalidRequest, match="TWOPHASE_SECRET_KAFKA_ORDERS_SASL_PASSWORD"):
        rebuild(d)
    monkeypatch.setenv("TWOPHASE_SECRET_KAFKA_ORDERS_SASL_PASSWORD", "pw-123")
    again = rebuild(d)
    assert isinstance(again, KafkaParticipant)
    assert again.config == kafka.config and again.key == "id"
    assert again.transaction_timeout_ms == 120_000
