"""The Delta section of bench/participants.py: DeltaParticipant against plain
``write_deltalake(mode="append")`` of the same rows into a Delta table on local disk.

- participant (B): ``DeltaParticipant``: P branch prepares (each writes its slice of the
  batch as Parquet files nobody references; run one after the other here, in parallel on
  a cluster) and one ``commit_batch`` (one Delta commit of every branch's add actions with
  the app transaction);
- raw, one commit (A): ``write_deltalake(table, batch, mode="append")`` of the whole batch,
  what an at-least-once ``foreachBatch`` on the driver does: one Delta commit per batch;
- raw, P commits (A'): P ``write_deltalake`` appends, one per slice, as an at-least-once
  per-partition writer would: P Delta commits per batch.

Fresh table per run (created untimed, as the sink's check does once per query), A/B
alternating, median; once as a new table and once with 90 earlier versions (a running
stream between two checkpoints: whoever opens the table afresh replays them).
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from twophase.participant import BranchRef
from twophase.protocol import TxnKey
from twophase.sinks.delta import DeltaParticipant, delta_schema

P = 2  # branches per batch, as local[2]
HISTORY = 90  # versions since the last checkpoint in the "running stream" rows


def _slices(batch: pa.RecordBatch, parts: int) -> list[pa.RecordBatch]:
    step = -(-batch.num_rows // parts)
    return [batch.slice(i * step, step) for i in range(parts)]


def _new_table(root: Path, schema: pa.Schema, history: int) -> str:
    """A fresh table with ``history`` earlier one-row versions (a stream that has been
    running: a reader that opens it replays the log since its last checkpoint)."""
    path = str(root / uuid.uuid4().hex)
    DeltaTable.create(path, schema=delta_schema(schema))
    if history:
        row = pa.Table.from_batches([], schema=delta_schema(schema))
        for _ in range(history):
            write_deltalake(path, row, mode="append")
    return path


def _participant_run(root: Path, batch: pa.RecordBatch, history: int) -> float:
    path = _new_table(root, batch.schema, history)
    p = DeltaParticipant(path, name="bench")
    p.check(batch.schema)  # once per query on the driver: not part of the timed write
    key = TxnKey("bench", uuid.uuid4().hex[:16], 0, 0)
    t0 = time.perf_counter()
    handles = {i: p.prepare(BranchRef(*key, p.name, i), batch.schema, [piece])
               for i, piece in enumerate(_slices(batch, P))}
    p.commit_batch(key, handles)
    dt = time.perf_counter() - t0
    shutil.rmtree(path)
    return dt


def _raw_run(root: Path, batch: pa.RecordBatch, commits: int, history: int) -> float:
    path = _new_table(root, batch.schema, history)
    t0 = time.perf_counter()
    for piece in _slices(batch, commits):
        write_deltalake(path, pa.Table.from_batches([piece]), mode="append")
    dt = time.perf_counter() - t0
    shutil.rmtree(path)
    return dt


def bench_delta(
    root: Path, sizes: Iterable[int], repeats: int,
    make_batch: Callable[[int], pa.RecordBatch],
    alternate: Callable[..., tuple[list[float], list[float]]],
    median_rps: Callable[[int, list[float]], float],
) -> list[tuple[str, int, float, float]]:
    out: list[tuple[str, int, float, float]] = []
    for n in sizes:
        batch = make_batch(n)
        for history in (0, HISTORY):
            at = f", {history} versions" if history else ""
            tb, ta = alternate(repeats, partial(_participant_run, root, batch, history),
                               partial(_raw_run, root, batch, 1, history))
            out.append((f"delta P={P} vs write_deltalake 1 commit{at}", n,
                        median_rps(n, tb), median_rps(n, ta)))
            tb2, tp = alternate(repeats, partial(_participant_run, root, batch, history),
                                partial(_raw_run, root, batch, P, history))
            out.append((f"delta P={P} vs write_deltalake {P} commits{at}", n,
                        median_rps(n, tb2), median_rps(n, tp)))
    return out

