"""``df.writeStream.format("twophase")``: the sink as Spark's own Python data source.

Spark runs the writer's ``write`` in each task (the task begins or joins the batch's
attempt and prepares its branches: :mod:`twophase.engine.door`), and ``commit(messages,
batchId)`` or ``abort`` on the driver, in a Python process of its own. Declare the sink
in code (``twophase.register(spark, sink)``, then ``.option("sink", name)``) or from
options alone (``participants`` as JSON descriptors or a ``config`` file, a
``coordinator`` daemon URL, its token by reference: ``token_env`` or ``token_file``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from pyspark.sql.datasource import DataSource, DataSourceStreamWriter, WriterCommitMessage

from twophase.engine.door import (
    DoorSpec,
    Message,
    abort_batch,
    adopt_zone,
    commit_batch,
    prepare_partition,
    spec_for,
    spec_of_engine,
)
from twophase.errors import InvalidRequest
from twophase.spark.compat import arrow_schema_of
from twophase.spark.session import read_app

try:  # Spark 4.1+: Arrow record batches in, no Python rows
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _Writer
except ImportError:  # pragma: no cover - Spark 4.0
    _Writer = DataSourceStreamWriter  # type: ignore[misc, assignment]

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

    from twophase.doors.foreachbatch import TransactionalSink

__all__ = ["BATCH_ID_PROPERTY", "TwophaseDataSource", "register"]

BATCH_ID_PROPERTY = "streaming.sql.batchId"  # set by Spark on each micro-batch's jobs


class DoorMessage(WriterCommitMessage):
    """A task's vote(s), as Spark carries commit messages to the driver."""

    def __init__(self, message: Message) -> None:
        self.message = message


class TwophaseWriter(_Writer):
    def __init__(self, spec: DoorSpec, schema: pa.Schema) -> None:
        self.spec, self.schema = spec, schema

    def write(self, iterator: Iterator[Any]) -> DoorMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        assert ctx is not None, "Spark calls write() in a task"
        batch = ctx.getLocalProperty(BATCH_ID_PROPERTY)
        if batch is None:
            raise InvalidRequest("the twophase data source writes streams only: use "
                                 "df.writeStream.format('twophase')")
        schema = self.schema
        if not isinstance(self, _ArrowIn):
            iterator = _rows_to_batches(iterator, schema)
        else:  # Spark's batches carry the session's zone: prepare in it
            first = next(iterator, None)
            if first is not None:
                schema = adopt_zone(self.spec, schema, first.schema)
                iterator = itertools.chain([first], iterator)
        return DoorMessage(prepare_partition(
            self.spec, int(batch), ctx.getLocalProperty("sql.streaming.queryId"),
            ctx.partitionId(), f"{ctx.stageId()}/{ctx.taskAttemptId()}", schema, iterator))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        commit_batch(self.spec, _unwrap(messages), batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        abort_batch(self.spec, _unwrap(messages), batchId)


_ArrowIn: tuple[type, ...] = (() if _Writer is DataSourceStreamWriter else (_Writer,))


def _unwrap(messages: list[WriterCommitMessage | None]) -> list[Message | None]:
    return [m.message if isinstance(m, DoorMessage) else None for m in messages]


def _rows_to_batches(rows: Iterator[Any], schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """Spark 4.0's data source writer hands rows (4.1+: Arrow batches, no Python
    rows): back to Arrow, 10,000 at a time."""
    import pyarrow as pa

    chunk: list[dict[str, Any]] = []
    for row in rows:
        chunk.append(row.asDict())
        if len(chunk) == 10_000:
            yield pa.RecordBatch.from_pylist(chunk, schema=schema)
            chunk = []
    if chunk:
        yield pa.RecordBatch.from_pylist(chunk, schema=schema)


class TwophaseDataSource(DataSource):
    """The ``twophase`` format. ``specs``: the sinks declared in code (by name)."""

    specs: ClassVar[Mapping[str, DoorSpec]] = {}
    _checked: ClassVar[set[tuple[str, str]]] = set()

    @classmethod
    def name(cls) -> str:
        return "twophase"

    def streamWriter(self, schema: Any, overwrite: bool) -> TwophaseWriter:
        spec = self._spec()
        arrow = arrow_schema_of(schema, spec.tz or "UTC")  # the tasks adopt the batches' zone
        if (spec.name, str(arrow)) not in self._checked:  # once per process and schema
            for p in spec.participants:
                p.check(arrow)
            self._checked.add((spec.name, str(arrow)))
        return TwophaseWriter(spec, arrow)

    def _spec(self) -> DoorSpec:
        return spec_for({k.lower(): v for k, v in self.options.items()}, self.specs)


_SINKS: dict[str, tuple[TransactionalSink, DoorSpec]] = {}


def register(spark: SparkSession, sink: TransactionalSink | None = None) -> None:
    """Register the ``twophase`` format with ``spark`` (once per application run), and
    ``sink`` under its name: this starts its coordinator connection (an embedded
    coordinator listens in this process) and takes the sink's writer epoch, which fences
    every earlier run's writer."""
    if sink is not None:
        # where its tasks reach the coordinator, its writer epoch, the targets, what a
        # crashed run left open, the executors' Python (its choice also picks the
        # interpreter of the data source's driver-side processes)
        app = read_app(spark, sink.settings.coordinator_host)
        shuffle = int(spark.conf.get("spark.sql.shuffle.partitions") or 200)
        _SINKS[sink.name] = (sink, spec_of_engine(sink._engine, app, shuffle))
    from twophase.spark.preflight import choose_worker_python

    # the data source's Python processes run the interpreter registered here: in local
    # mode with none set, the driver's own, as for the foreachBatch door (under Spark
    # Connect the server chooses)
    if not type(spark).__module__.startswith("pyspark.sql.connect"):
        choose_worker_python(spark.sparkContext)
    specs = {n: s for n, (_, s) in _SINKS.items()}
    spark.dataSource.register(type("TwophaseDataSource", (TwophaseDataSource,),
                                   {"specs": specs, "_checked": set()}))
