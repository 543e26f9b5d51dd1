"""Where an Iceberg batch's time goes, A (Spark's own sink) against B (the native path):
``bench/tables_vs_spark.py --phases`` (issue 32, wt-icebergspeed). Diagnostic only: it
wraps twophase's, pyiceberg's and pyspark's functions in this process with timers
(nothing of the sink changes) and reads Spark's own figures.

Per measured batch it keeps
- Spark's streaming progress ``durationMs`` (``addBatch``, ``walCommit``, ...), both
  sides;
- the wall time of the Spark jobs the batch ran (the live status store, which exists
  with the UI off), both sides: for A the write job, so ``addBatch`` minus it is
  Iceberg's driver commit and the sink's planning;
- B: the sink's ``BatchReport.phases`` and ``seconds``, and the wrapped calls' time
  (``w.*``; nested ones are inside their caller's).

and prints the p50 of each per variant and size."""

from __future__ import annotations

import inspect
import statistics
import time
from collections import defaultdict
from typing import Any

__all__ = ["Phases"]


class Phases:
    """Timers and per-batch records for one bench process."""

    def __init__(self) -> None:
        self.cur: dict[str, float] = defaultdict(float)
        self.rows: dict[str, list[dict[str, float]]] = defaultdict(list)
        self.reports: list[Any] = []
        self._install()

    # ------------------------------------------------------------------ wrapping
    def _wrap(self, owner: Any, attr: str, label: str) -> None:
        static = inspect.getattr_static(owner, attr)
        orig = getattr(owner, attr)
        cur = self.cur

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                cur[label] += time.perf_counter() - t

        setattr(owner, attr, staticmethod(timed) if isinstance(static, staticmethod)
                else timed)

    def _install(self) -> None:
        import os

        import pyarrow.parquet as pq
        import pyiceberg.io.pyarrow as pio
        import pyiceberg.table as ptable
        from pyspark.sql.readwriter import DataFrameWriter

        import twophase.engine.native as native
        import twophase.sinks.iceberg.native as inative
        from twophase.client.api import CoordinatorClient
        from twophase.sinks.iceberg.participant import IcebergParticipant as P

        # variant B2: B with these write options too (k=v,k=v), beside B in one run
        extra = os.environ.get("PHASES_B2_OPTIONS", "")
        self.b2 = dict(kv.split("=", 1) for kv in extra.split(",") if kv)
        self.write_options = native._WRITE_OPTIONS
        self.plain = dict(self.write_options)
        w = self._wrap
        w(native, "settle_all_earlier", "settle")
        w(DataFrameWriter, "save", "spark_save")
        save = DataFrameWriter.save
        cur = self.cur

        def saved(*a: Any, **k: Any) -> Any:  # its wall clock, for the jobs' times
            start = time.time() * 1000
            try:
                return save(*a, **k)
            finally:
                cur["saves"] = (start, time.time() * 1000)  # type: ignore[assignment]

        DataFrameWriter.save = saved  # type: ignore[method-assign]
        for name in ("native_options", "native_location", "adopt", "commit_batch",
                     "_load", "_markers", "_commit_files", "_commit_snapshot", "check"):
            w(P, name, name.strip("_"))
        for name in ("begin", "vote", "ack", "get"):
            w(CoordinatorClient, name, f"coord_{name}")
        w(pio, "parquet_file_to_data_file", "footer_stats")
        w(ptable.Transaction, "commit_transaction", "iceberg_commit")
        w(pq, "read_metadata", "adopt_footer")
        w(inative, "write_record", "adopt_record")
        w(inative, "fsync_dir", "adopt_fsync_dir")
        w(inative, "_fits", "adopt_fits")

    def variant(self, name: str) -> None:
        """The write options of the next query (B2's, or the sink's own)."""
        self.write_options.clear()
        self.write_options.update({**self.plain, **(self.b2 if name == "B2" else {})})

    # ------------------------------------------------------------------ records
    def on_batch(self, report: Any) -> None:
        """The sink's callback: keep its report and this batch's timers."""
        self.reports.append((report, dict(self.cur)))
        self.cur.clear()

    def take(self, key: str, q: Any, spark: Any, variant: str) -> None:
        """After a query: its measured batches' figures (the first batch skipped;
        nothing kept for a warm-up run, ``key`` empty)."""
        if not key:
            self.reports.clear()
            self.cur.clear()
            return
        jobs = _jobs(spark, str(q.runId))
        progress = [p for p in q.recentProgress if p["numInputRows"]]
        reports = [r for r in self.reports if r[0].rows] if variant != "A" else []
        for i, p in enumerate(progress):
            if i == 0:
                continue
            row = {f"d.{k}": float(v) for k, v in p["durationMs"].items()}
            # what the trigger spent outside every phase Spark names
            row["d.rest"] = 2 * row["d.triggerExecution"] - sum(row.values())
            job = jobs.get(int(p["batchId"]), {})
            row.update({k: v for k, v in job.items() if k not in ("first_sub", "last_end")})
            if reports and i < len(reports):
                rep, timers = reports[i]
                saves = timers.pop("saves", None)
                if saves and job.get("first_sub"):  # the save's time before/after its job
                    row["save_before_job"] = job["first_sub"] - saves[0]
                    row["save_after_job"] = saves[1] - job["last_end"]
                row["sink"] = rep.seconds * 1000
                row.update({f"p.{k}": v * 1000 for k, v in rep.phases.items()})
                row.update({f"w.{k}": v * 1000 for k, v in timers.items()})
            self.rows[f"{key} {variant}"].append(row)
        self.reports.clear()
        self.cur.clear()

    def print(self) -> None:
        import json

        for name, rows in self.rows.items():
            print(f"phases-raw {name} {json.dumps(rows)}", flush=True)
            keys = sorted({k for r in rows for k in r})
            med = {k: statistics.median([r.get(k, 0.0) for r in rows]) for k in keys}
            print(f"phases {name} ({len(rows)} batches, p50 ms): " + ", ".join(
                f"{k} {v:.1f}" for k, v in med.items()), flush=True)


_WARNED: list[str] = []


def _batch_of(desc: Any, run_id: str) -> int | None:
    """The streaming batch a job's or stage's description names (None: not this run)."""
    if desc.isEmpty():
        return None
    text = str(desc.get())
    if run_id not in text or "batch = " not in text:
        return None
    batch = text.rsplit("batch = ", 1)[-1].split()[0]
    return int(batch) if batch.isdigit() else None


def _jobs(spark: Any, run_id: str) -> dict[int, dict[str, float]]:
    """Per streaming batch of run ``run_id``, from the driver's live status store: the
    wall ms of its Spark jobs, the first job's submission and the last one's end (epoch
    ms), and its stages' run and CPU time (ms) and output bytes."""
    store = spark.sparkContext._jsc.sc().statusStore()
    out: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    it = store.jobsList(None).iterator()  # a Scala Seq
    while it.hasNext():
        j = it.next()
        batch = _batch_of(j.description(), run_id)
        if batch is None or j.submissionTime().isEmpty() or j.completionTime().isEmpty():
            continue
        sub, end = j.submissionTime().get().getTime(), j.completionTime().get().getTime()
        o = out[batch]
        o["spark_jobs"] += end - sub
        o["first_sub"] = min(o.get("first_sub") or sub, sub)
        o["last_end"] = max(o.get("last_end", 0.0), end)
        try:  # its stages' task metrics
            ids = j.stageIds().iterator()
            while ids.hasNext():
                st = store.lastStageAttempt(ids.next())
                o["stage_run"] += st.executorRunTime()
                o["stage_cpu"] += st.executorCpuTime() / 1e6
                o["stage_out_mb"] += st.outputBytes() / 1e6
        except Exception as exc:  # diagnostics only: say so once, keep the rest
            if not _WARNED:
                _WARNED.append(str(exc)[:200])
                print(f"iceberg_phases: no stage metrics: {_WARNED[0]}", flush=True)
    return out
