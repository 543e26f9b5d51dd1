"""``twophase resolve SINK`` settles a dead job's lakehouse tables as a whole batch: the
job prepared two branches of an Iceberg table and of a Delta table (both voted YES:
COMMIT decided), then died before the driver's batch commit; another batch was prepared
with no record at all. resolve, a separate process given only the sink name and the
coordinator, rebuilds both participants by kind, commits each table's batch once (one
snapshot, one version, both branches in it) and sweeps the unrecorded batch's files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable

from tests.sinks.iceberg.iceberg_support import local_catalog
from twophase.client.connection import connect
from twophase.client.wire import VoteIn
from twophase.participant import BranchRef, descriptor_of
from twophase.protocol import Decision, TxnKey
from twophase.sinks.delta import DeltaParticipant
from twophase.sinks.iceberg import IcebergParticipant

SINK, LINEAGE = "lake", "L-resolve-tables"
SCHEMA = pa.schema([("id", pa.int64()), ("item", pa.string())])


def _rows(ids: list[int]) -> list[pa.RecordBatch]:
    return [pa.RecordBatch.from_pylist([{"id": i, "item": f"i{i}"} for i in ids],
                                       schema=SCHEMA)]


def test_resolve_commits_each_tables_batch_once_and_sweeps_the_rest(tmp_path: Path) -> None:
    ice = IcebergParticipant("lake.orders", local_catalog(tmp_path / "ice"), name="ice")
    delta = DeltaParticipant(str(tmp_path / "delta"), name="dl")
    parts = [ice, delta]
    for p in parts:
        p.check(SCHEMA)
    coordinator = f"sqlite:///{tmp_path / 'coord.db'}"
    batch0 = {0: [1, 2], 1: [3]}
    with connect(coordinator) as conn:
        client = conn.client()
        epoch = client.register(SINK, [descriptor_of(p) for p in parts])  # type: ignore[misc]
        client.begin(SINK, LINEAGE, 0, epoch, [p.name for p in parts], 2, 60)
        votes = [VoteIn(f"{p.name}/{i}", True,
                        p.prepare(BranchRef(SINK, LINEAGE, 0, 1, p.name, i), SCHEMA, _rows(ids)))
                 for p in parts for i, ids in batch0.items()]
        txn = client.vote(TxnKey(SINK, LINEAGE, 0, 1), epoch, votes)
        assert txn.decision == Decision.COMMIT
        # batch 1: files written, never begun: no record, presumed abort
        for p in parts:
            p.prepare(BranchRef(SINK, LINEAGE, 1, 1, p.name, 0), SCHEMA, _rows([10]))
    assert all(len(p.in_doubt(SINK)) == 3 for p in parts)
    assert ice.read_back("id").values == () and delta.read_back("id").values == ()

    env = {k: v for k, v in os.environ.items() if not k.startswith("TWOPHASE_")}
    out = subprocess.run(
        [sys.executable, "-m", "twophase.cli", "resolve", SINK, "--coordinator", coordinator,
         "--json"], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    report = json.loads(out.stdout)
    assert report["ok"] and not report["unresolved"], report
    done = sorted((a["txn"].split("/")[2], a["branch"], a["action"]) for a in report["actions"])
    assert done == [
        ("0", "dl/0", "commit-batch"), ("0", "dl/1", "commit-batch"),
        ("0", "ice/0", "commit-batch"), ("0", "ice/1", "commit-batch"),
        ("1", "dl/0", "abort"), ("1", "ice/0", "abort"),
    ], done

    for p in parts:
        back = p.read_back("id")
        assert sorted(back.values) == [1, 2, 3], p.describe()
        assert (back.commits, back.extra_commits, back.prepared) == (1, 0, 0), back
        assert p.in_doubt(SINK) == []
    assert DeltaTable(delta.path).version() == 1  # the create, then the one batch commit
    # a second resolve finds nothing to do
    again = subprocess.run(
        [sys.executable, "-m", "twophase.cli", "resolve", SINK, "--coordinator", coordinator,
         "--json"], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert again.returncode == 0 and json.loads(again.stdout)["actions"] == [], again.stdout
