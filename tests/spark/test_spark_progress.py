"""Spark-side visibility: each batch's twophase outcome reachable from the query's
progress (a ``StreamingQueryListener``) and as a JSON log line (``json_logs=True``), and
the sink's participants recorded with the coordinator at register (what ``twophase
resolve SINK`` rebuilds them from)."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from twophase.coordinator.store import Store
from twophase.doors.foreachbatch import BatchReport, TransactionalSink
from twophase.sinks.files import StagedFileParticipant
from twophase.testing.job import EVENT_DDL, write_input

pytestmark = pytest.mark.spark


def test_each_batch_outcome_reaches_a_streaming_query_listener(
    spark: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    write_input(str(tmp_path / "in"), batches=2, rows_per_batch=30)
    coordinator = f"sqlite:///{tmp_path / 'coord.db'}"
    lake = StagedFileParticipant(str(tmp_path / "out"), format="jsonl", name="lake")
    top = logging.getLogger("twophase")
    saved = (top.handlers[:], top.level, top.propagate)
    sink = TransactionalSink("progress", [lake], coordinator, partitions=2, vote_timeout=60,
                             json_logs=True)
    seen: list[tuple[int, BatchReport | None]] = []
    got = threading.Event()

    def on_progress(progress: Any, report: BatchReport | None) -> None:
        seen.append((int(progress.batchId), report))
        if len(seen) >= 2:
            got.set()

    listener = sink.progress_listener(on_progress)
    spark.streams.addListener(listener)
    try:
        query = (
            spark.readStream.schema(EVENT_DDL).option("maxFilesPerTrigger", 1)
            .parquet(str(tmp_path / "in")).writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(availableNow=True).start()
        )
        query.awaitTermination()
        assert sink.console_url is not None and "/ui#token=" in sink.console_url
        got.wait(60)  # listener events arrive on Spark's listener bus, after the batch
    finally:
        spark.streams.removeListener(listener)
        sink.close()
        top.handlers[:], top.level, top.propagate = saved
    by_batch = dict(seen)
    assert sorted(by_batch) == [0, 1]
    for batch_id, report in by_batch.items():
        assert report is not None, f"no twophase report for batch {batch_id}"
        assert (report.outcome, report.decision, report.rows) == ("committed", "COMMIT", 30)
        assert report.txn.startswith("progress/") and report.txn.endswith(f"/{batch_id}/1")
        assert report.as_dict()["phases"]["prepare_s"] >= 0
    logged = [json.loads(line) for line in capfd.readouterr().err.splitlines()
              if line.startswith("{") and "twophase_batch" in line]
    assert [x["twophase_batch"]["batch_id"] for x in logged] == [0, 1]
    assert all(x["twophase_batch"]["decision"] == "COMMIT" for x in logged)
    store = Store(coordinator, create=False)
    try:
        (recorded,) = store.participants("progress")
    finally:
        store.close()
    assert recorded["kind"] == "files" and recorded["options"]["format"] == "jsonl"
    assert recorded["options"]["path"] == str(lake.path)
