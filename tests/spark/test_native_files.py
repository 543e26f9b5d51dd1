"""The native data path under real Spark (local[2]), in this process: a files-only sink
has Spark's own Parquet writer write its branches (no row through Python: the
participant's ``prepare`` is never called) and reads back the same rows, files and
schema as the Python path; beside a Python participant a files participant stays on the
Python path unless it asks (``native=True``), and then both are written, the batch
computed once (persisted)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from twophase import TransactionalSink
from twophase.participant import BranchRef, Handle
from twophase.sinks.files import STAGING_DIR, StagedFileParticipant

pytestmark = pytest.mark.spark

QUERY = ("SELECT id, CAST(id AS STRING) AS name, timestamp_seconds(id) AS ts, "
         "CAST(id AS DECIMAL(10, 2)) AS amount, array(id, id) AS pair "
         "FROM range(0, {n}, 1, 3)")


class NoPythonRows(StagedFileParticipant):
    """A files participant whose rows must never reach Python."""

    def prepare(self, branch: BranchRef, schema: pa.Schema,
                batches: Iterable[pa.RecordBatch]) -> Handle:
        raise AssertionError("the native path handed rows to Python")


def _write(spark: Any, tmp: Path, parts: list[StagedFileParticipant], tag: str) -> list[Any]:
    sink = TransactionalSink("nat", parts, f"sqlite:///{tmp / f'{tag}.db'}",
                             lineage="lin-1", preflight=False)
    try:
        sink(spark.sql(QUERY.format(n=300)), 0)
        sink(spark.sql(QUERY.format(n=300)).where("id < 0"), 1)  # no rows at all
        sink(spark.sql(QUERY.format(n=20)).repartition(3, "id"), 2)  # a shuffled batch
        return [(r.outcome, r.rows, r.partitions) for r in sink.history]
    finally:
        sink.close()


def _folder(p: StagedFileParticipant) -> tuple[list[str], pa.Table]:
    names = sorted(f.name for f in p.path.iterdir() if f.is_file())
    assert list((p.path / STAGING_DIR).iterdir()) == []  # nothing staged or written left
    return names, ds.dataset(str(p.path), format="parquet").to_table().sort_by("id")


def test_native_reads_back_as_the_python_path(spark: Any, tmp_path: Path) -> None:
    # a subclass with its own prepare stays on the Python path unless it asks
    assert StagedFileParticipant.native_format(NoPythonRows(str(tmp_path / "a"))) is None
    native = NoPythonRows(str(tmp_path / "native"), name="files-out", native=True)
    python = StagedFileParticipant(str(tmp_path / "python"), name="files-out", native=False)
    history = _write(spark, tmp_path, [native], "n")
    assert history == _write(spark, tmp_path, [python], "p")
    assert history == [("committed", 300, 3), ("committed", 0, 3), ("committed", 20, 3)]
    (n_names, n_rows), (p_names, p_rows) = _folder(native), _folder(python)
    assert n_names == p_names  # the same files: one per partition with rows, same names
    assert n_rows.num_rows == 320
    # the same values; timestamps are the same instants (the native files name no zone)
    assert n_rows.schema.field("ts").type == pa.timestamp("us", tz="UTC")
    assert n_rows.cast(p_rows.schema).equals(p_rows)
    assert native.in_doubt("nat") == []
    # a second run of the sink sees the native files fit its schema (on_schema_change)
    native.check(p_rows.schema)


def test_native_and_python_participants_in_one_sink(spark: Any, tmp_path: Path) -> None:
    auto = StagedFileParticipant(str(tmp_path / "auto"))
    python = StagedFileParticipant(str(tmp_path / "python"), native=False)
    # beside a Python participant the automatic choice is the Python path for both
    assert _write(spark, tmp_path, [auto, python], "a")[0] == ("committed", 300, 3)
    native = NoPythonRows(str(tmp_path / "native"), native=True)  # asked for: native
    python = StagedFileParticipant(str(tmp_path / "python2"), native=False)
    history = _write(spark, tmp_path, [native, python], "m")
    assert history == [("committed", 300, 3), ("committed", 0, 3), ("committed", 20, 3)]
    (n_names, n_rows), (p_names, p_rows) = _folder(native), _folder(python)
    assert len(n_names) == len(p_names) == 6
    assert n_rows.column("id").to_pylist() == p_rows.column("id").to_pylist()
    assert spark.sparkContext._jsc.sc().getPersistentRDDs().size() == 0  # unpersisted


class SeesPersisted(StagedFileParticipant):
    """A native files participant that counts, at ``adopt`` (on the driver, after Spark's
    write, before the batch is unpersisted), the RDDs Spark holds persisted."""

    seen: list[int]

    def adopt(self, key: Any, partitions: int) -> dict[int, Handle]:
        from pyspark import SparkContext

        sc = SparkContext._active_spark_context
        assert sc is not None
        self.seen.append(sc._jsc.sc().getPersistentRDDs().size())
        return super().adopt(key, partitions)


def test_the_persist_policy_and_its_override(spark: Any, tmp_path: Path) -> None:
    """Two consumers (the native write and the Python job): the batch is persisted; one
    (files alone) or the override ``persist = False``: not (bench/persist.py measures
    both)."""
    seen = []
    for tag, persist, beside in (("both", None, True), ("over", False, True),
                                 ("alone", None, False)):
        native = SeesPersisted(str(tmp_path / f"n-{tag}"), native=True)
        native.seen = []
        parts: list[StagedFileParticipant] = [native]
        if beside:
            parts.append(StagedFileParticipant(str(tmp_path / f"p-{tag}"), native=False))
        sink = TransactionalSink("nat", parts, f"sqlite:///{tmp_path / f'{tag}.db'}",
                                 lineage="lin-1", preflight=False)
        if persist is not None:
            sink._engine.job.persist = persist
        try:
            sink(spark.sql(QUERY.format(n=30)), 0)
            assert sink.history[-1].outcome == "committed"
        finally:
            sink.close()
        seen.append(native.seen)
    assert seen == [[1], [0], [0]]
    assert spark.sparkContext._jsc.sc().getPersistentRDDs().size() == 0  # unpersisted
