"""Exactly-once into Iceberg and Delta on the native data path when the driver dies: the
reference job (its own driver process, real Spark local[2]) writes one sink of a Delta
table and an Iceberg table, both partitioned by ``customer`` (Spark's ``partitionBy``
folders, about 20 values a branch, a file each; Iceberg's over a derived column, the
source kept in the files), both prepared by Spark's own Parquet writer.
The driver is SIGKILLed with COMMIT decided, after the Delta table's commit and before the Iceberg
table's (the restart commits Iceberg and finds Delta's marker); the slow case adds a
kill after Spark wrote the attempt's folders (no vote: swept by name), one before any
table's commit and one after the last table's commit, ack not sent. Each run restarts
from its checkpoint with one more batch. Then every id is in each table once, one
snapshot and one version per batch, nothing left in doubt, and Spark's own Delta and
Iceberg connectors, delta-rs, pyiceberg and DuckDB read the same rows."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from tests.sinks.iceberg.iceberg_support import local_catalog
from tests.support.spark_connectors import spark_read
from tests.support.user import run_reference_job
from twophase import failpoints
from twophase.sinks.delta import DeltaParticipant, app_id
from twophase.sinks.iceberg import IcebergParticipant
from twophase.testing.job import JobConfig, build_participants, expected_ids, write_input
from twophase.testing.verify import verify

pytestmark = pytest.mark.spark

ROWS = 40
DELTA, ICE = "delta-orders", "iceberg-shop.orders"  # the reference job's participant names
# (failpoint, where a write folder of the killed attempt must be left)
AROUND_COMMIT = ((f"after_batch_commit@{DELTA}=kill*1", False),)
EVERY = ((f"after_prepare@{ICE}=kill*1", True),  # both written, not adopted, no vote
         (f"before_batch_commit@{DELTA}=kill*1", False),  # COMMIT decided, no table commit
         *AROUND_COMMIT,
         (f"after_batch_commit@{ICE}=kill*1", False))  # both committed, no ack


def _write_dirs(root: Path) -> list[Path]:
    return [d for d in root.rglob("_spark-*") if d.is_dir()]


@pytest.mark.parametrize("kills", [
    pytest.param(AROUND_COMMIT, id="around-the-commit"),  # 73-99 s (load 2.5-4); 87 s
    # with the Delta table partitioned (2026-11-26)
    pytest.param(EVERY, id="every-window", marks=pytest.mark.slow),  # 142 s: CI time
])
def test_tables_driver_killed_on_the_native_path(
        tmp_path: Path, kills: tuple[tuple[str, bool], ...]) -> None:
    catalog = {**local_catalog(tmp_path / "ice"), "name": "lake"}
    cfg = JobConfig(
        input_dir=str(tmp_path / "in"), checkpoint=str(tmp_path / "ckpt"),
        coordinator=f"sqlite:///{tmp_path / 'coord.db'}", sink=f"nt{secrets.token_hex(3)}",
        delta_path=str(tmp_path / "lake" / "orders"), delta_partition_by=["customer"],
        iceberg_table="shop.orders", iceberg_partition_by=["customer"],
        iceberg_catalog=catalog, partitions=2, vote_timeout=60.0, max_attempts=4,
    )
    delta, ice = build_participants(cfg)
    assert isinstance(delta, DeltaParticipant) and isinstance(ice, IcebergParticipant)
    assert (delta.name, ice.name) == (DELTA, ICE)
    assert delta.native_format() == ice.native_format() == "parquet"
    cfg_path, log = tmp_path / "job.json", tmp_path / "job.log"
    cfg.dump(cfg_path)
    write_input(cfg.input_dir, 1, ROWS)
    batches = 1
    for i, (spec, folders) in enumerate(kills):
        once = tmp_path / f"once{i}"
        run = run_reference_job(cfg_path, {failpoints.ENV: spec,
                                           failpoints.ONCE_DIR_ENV: str(once)}, log)
        assert len(failpoints.fired(str(once))) == 1, log.read_text()[-3000:]
        assert run.returncode == -9, log.read_text()[-3000:]
        assert bool(_write_dirs(tmp_path / "lake")) == folders, spec
        write_input(cfg.input_dir, 1, ROWS, first=batches)
        batches += 1
    last = run_reference_job(cfg_path, {}, log)
    assert last.returncode == 0, log.read_text()[-3000:]
    assert [json.loads(x) for x in last.stdout.splitlines() if x.startswith("{")][-1] == \
        {"done": True}
    want = expected_ids(batches, ROWS)
    report = verify([delta, ice], want, sink=cfg.sink)
    assert report.ok, report.lines()
    assert _write_dirs(tmp_path / "lake") == _write_dirs(tmp_path / "ice") == []
    _one_commit_per_batch(delta, ice, cfg.sink, batches)
    _read_by_spark_and_duckdb(tmp_path, delta, ice, cfg.sink, sorted(want), catalog)


def _one_commit_per_batch(delta: DeltaParticipant, ice: IcebergParticipant, sink: str,
                          batches: int) -> None:
    from deltalake import DeltaTable

    dt = DeltaTable(delta.path)
    assert [int(h["twophase.batch"]) for h in reversed(dt.history())
            if h.get("twophase.sink") == sink] == list(range(batches))
    tbl = ice._load()
    assert [int(str(s.summary["twophase.batch"]))  # type: ignore[index]
            for s in tbl.metadata.snapshots] == list(range(batches))


def _read_by_spark_and_duckdb(tmp_path: Path, delta: DeltaParticipant,
                              ice: IcebergParticipant, sink: str, want: list[int],
                              catalog: dict[str, str]) -> None:
    from deltalake import DeltaTable

    dt = DeltaTable(delta.path)
    [lineage] = {h["twophase.lineage"] for h in dt.history() if h.get("twophase.sink") == sink}
    files = {"delta": dt.file_uris(),
             "iceberg": [t.file.file_path for t in ice._load().scan().plan_files()]}
    for kind, uris in files.items():
        ids = duckdb.connect().execute("SELECT id FROM read_parquet(?)",
                                       [[u.removeprefix("file://") for u in uris]]).fetchall()
        assert sorted(r[0] for r in ids) == want, kind
    assert sorted(dt.to_pyarrow_table().column("id").to_pylist()) == want
    adds = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    assert len(adds) == len(want)  # one customer a row: a file each, in its partition
    assert {a["partition.customer"] for a in adds} == {f"customer-{i % 97}" for i in want}
    for r in dt.to_pyarrow_table(columns=["id", "customer"]).to_pylist():  # from the log
        assert r["customer"] == f"customer-{r['id'] % 97}"
    assert sorted(ice._load().scan().to_arrow().column("id").to_pylist()) == want
    ice_files = [t.file for t in ice._load().scan().plan_files()]
    assert len(ice_files) == len(want)  # a file each, in its partition, as for Delta
    assert {f.partition[0] for f in ice_files} == {f"customer-{i % 97}" for i in want}
    fives = len([i for i in want if i % 97 == 5])
    row = {"customer": "spark", "amount": 1.5, "ts": "2026-02-01 00:00:00"}
    got: dict[str, Any] = spark_read({
        "delta": {"path": delta.path, "filters": {"id": f"id = {want[5]}"},
                  "app_id": app_id(sink, lineage), "committed_batch": len(want) // ROWS - 1,
                  "replay_id": 100_000, "new_id": 200_000, "row": row},
        "iceberg": {"catalog": "lake", "table": "shop.orders",
                    "uri": f"jdbc:sqlite:{tmp_path / 'ice' / 'catalog.db'}",
                    "warehouse": catalog["warehouse"],
                    "filters": {"id": f"id = {want[5]}", "customer": "customer = 'customer-5'"}},
    }, tmp_path / "spark-reader.log")
    assert [r[0] for r in got["iceberg"]["rows"]] == want
    assert [r[0] for r in got["delta"]["rows"]] == want
    assert len(got["iceberg"]["snapshots"]) == len(want) // ROWS
    pruned = got["iceberg"]["scans"]["customer"]  # Spark reads only customer-5's files
    assert pruned["metrics"]["resultDataFiles"] == fives > 0, pruned
    # Spark's Delta writer skips the batch twophase committed last, applies the next
    skipped, applied = got["delta"]["txn_writes"]
    assert (skipped["rows"], applied["rows"]) == (len(want), len(want) + 3)
