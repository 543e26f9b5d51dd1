"""What exactly-once costs per micro-batch: the same streaming query, written at-least-once
by a careful ``foreachBatch`` (A) and by ``TransactionalSink`` (B), side by side in one run.

Reproduce (from the repository root, in the README's venv, ``bash scripts/test.sh`` made it)::

    .venv/bin/python bench/e2e.py                               # full: 7 pairs, 10k/100k/1M + empty
                                                                # + Kafka section: 3 pairs, 100k
    .venv/bin/python bench/e2e.py --no-kafka-section            # without Kafka
    .venv/bin/python bench/e2e.py --pairs 2 --sizes 10000,100000 --batches 3   # quick look
    .venv/bin/python bench/e2e.py --kafka --sizes 10000 --pairs 2   # + a Kafka topic
    .venv/bin/python bench/e2e.py --sizes 1000000 --pairs 2 --batches 2 --no-empty \\
        --fresh-workers                                          # peak RSS per task at 1M

A private PostgreSQL server (``twophase.testing.localpg``, fsync on) and one Spark session
(local[2], 2 shuffle partitions, as the reference job) are started here and stopped at the
end; files and checkpoints go to a temporary folder (``--dir`` to choose the disk). With
``--kafka`` a private Apache Kafka broker (``twophase.testing.apachekafka``) too.

The query: a file source (one Parquet file per micro-batch, ``availableNow``) of the
reference job's events; each run a new query on fresh checkpoint, table, folder (and
topic); its first batch warms up, the next ``--batches`` are measured.

- A, at-least-once: ``foreachBatch`` runs ``mapInArrow`` over the batch as Spark gives
  it; each task streams its Arrow batches into psycopg ``COPY ... FROM STDIN (FORMAT
  csv)`` (the participant's own CSV encoder) and into one pyarrow Parquet file (fsync,
  rename, directory fsync), with ``--kafka`` also into a
  plain idempotent confluent_kafka producer (no transaction; one per worker process,
  kept for its next tasks; the row as JSON, no key, as ``KafkaParticipant`` encodes it;
  flushed, delivery reports checked), commits, reports its row count.
- B, exactly-once: ``TransactionalSink`` with ``PostgresParticipant`` and
  ``StagedFileParticipant`` (Parquet) (and ``KafkaParticipant``; ``--kafka-reuse``: with
  ``reuse_clients=True``) and an embedded SQLite coordinator.

Pairs alternate (A,B then B,A ...). Printed per size: rows/s ratio B/A per pair and its
median; added latency per batch (p50, p99 of B's batch time minus A's, batch for batch
within a pair; p99 is the maximum below 100 samples); peak RSS of a Python worker process
during each run (median over pairs; see ``WorkerRss``: with ``--fresh-workers`` Spark
starts a new worker for every task, so it is the peak of one task); and, once, the
restart cost: query ``start()`` to the end of the first batch, B minus A (the sink's
coordinator start, register and checks).

The empty section measures two things:

- the empty *file*: a micro-batch that reads one input file with no rows. Spark runs a
  job on both sides to find it empty (its emptiness is in the Parquet footer);
- the empty *relation*: after that query has run, each side's foreachBatch function (the
  very function Spark calls with each micro-batch) is called directly, for
  ``--empty-relations`` consecutive batch ids (on the query's lineage: this thread takes
  over the query id Spark sets on its stream thread), with
  ``spark.createDataFrame([], schema)``: no rows (an RDD of 2 empty partitions; the
  bench checks the sink sees 0). B settles it with two coordinator calls and no Spark
  job; A runs its ``mapInArrow`` + ``collect``, a job of 2 tasks. Each call timed alone.

Per size, B's batch is split by phase, as the sink measured it (``BatchReport.phases``,
p50 over the measured batches): the driver's frame (the job's DataFrame), split (its
planning and the split read from it), setup, begin, plan, job (Spark's part: the job minus
its slowest task; the slowest task's prepare, vote, wait, commit), relay (the tasks' acks
in one call), batch commit (tables), settle (an empty relation) and driver (the rest);
A's job is split the same way (its slowest task and Spark's part), beside it.

The Kafka section (by default; ``--no-kafka-section`` skips it, ``--kafka-sizes`` and
``--kafka-pairs`` size it): after the others, a private Apache Kafka broker starts
(``--kafka-tansu``: tansu) and both sides add a topic (A: a plain idempotent producer
kept per worker; B: ``KafkaParticipant`` with its defaults;
``--kafka-prepare``, ``--kafka-reuse`` change them), warm-ups
counted in the log.

The last line sums it up: ``ratio@100k``, ``ratio@1M``, ``added_p50@100k``,
``empty_batch_p50`` (B's p50 for the empty file), ``empty_relation_p50`` (B's p50 for the
empty relation), ``ratio@10k``, ``added_p50@10k``, ``empty_added_p50`` (B minus A for the
empty file, p50), ``kafka_ratio@100k`` and ``kafka_ratio@1M`` (the Kafka section's B/A,
``n/a`` for a size not in ``--kafka-sizes``; with ``--kafka`` the whole run's). The
goals: >= 0.95 at 100k and 1M, >= 0.90 at 10k, added p50 at 10k <= 20 ms, empty file
added <= 5 ms, Kafka >= 0.90 at 100k and >= 0.95 at 1M.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402

from bench.e2e_phases import phase_line  # noqa: E402
from bench.kafka_topics import committed_rows, drop_topic, new_topic  # noqa: E402
from bench.rss import WorkerRss  # noqa: E402
from twophase.cli.chaos import kafka_prepare  # noqa: E402
from twophase.sinks.kafka.staged import DEFAULT_PREPARE  # noqa: E402
from twophase.testing.job import EVENT_DDL, place_batch, spark_session, write_input  # noqa: E402
from twophase.testing.localpg import LocalPostgres  # noqa: E402

# --------------------------------------------------------------------------- A's task


def _at_least_once_writer(dsn: str, table: str, out_dir: str,
                          kafka: tuple[str, str] | None) -> Callable[..., Any]:
    """A's ``mapInArrow`` function: stream the partition into COPY, one Parquet file and,
    with ``kafka`` = (bootstrap, topic), a plain idempotent producer (at-least-once)."""

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import itertools

        import psycopg
        import pyarrow.parquet as pq
        from psycopg import sql
        from pyspark import TaskContext

        from twophase.sinks.postgres.arrow import csv_chunks

        started = time.perf_counter()
        ctx = TaskContext.get()
        part = ctx.partitionId() if ctx else 0
        report = pa.schema([("rows", pa.int64()), ("task_s", pa.float64())])
        it = iter(batches)
        first = next(it, None)
        rows = 0
        if first is not None:
            producer, errors = None, []
            if kafka is not None:
                from confluent_kafka import Producer

                from twophase.jsoncodec import json_rows

                # One producer per worker process, kept for the next tasks, as a careful
                # job keeps it: a new idempotent producer waits 0.5-1 s for its producer
                # id (librdkafka's timer) before its first flush returns.
                kept = sys.modules.setdefault("_e2e_kafka", types.ModuleType("_e2e_kafka"))
                producer = kept.__dict__.get(kafka[0])
                if producer is None:
                    producer = Producer({"bootstrap.servers": kafka[0],
                                         "enable.idempotence": True, "acks": "all"})
                    kept.__dict__[kafka[0]] = producer

            def delivered(err: Any, _msg: Any) -> None:
                if err is not None:
                    errors.append(err)

            final = Path(out_dir) / f"part-{uuid.uuid4().hex}-{part:05d}.parquet"
            tmp = final.with_name("." + final.name + ".tmp")
            stmt = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
                sql.Identifier(table),
                sql.SQL(", ").join(sql.Identifier(n) for n in first.schema.names))
            with psycopg.connect(dsn) as conn, conn.cursor() as cur:
                with cur.copy(stmt) as copy, open(tmp, "wb") as raw:
                    writer = pq.ParquetWriter(raw, first.schema)
                    for b in itertools.chain([first], it):  # streamed: nothing held
                        for chunk in csv_chunks(b):
                            copy.write(memoryview(chunk))
                        writer.write_batch(b)
                        if producer is not None:
                            assert kafka is not None
                            for value in json_rows(b):
                                while True:
                                    try:
                                        producer.produce(kafka[1], value, on_delivery=delivered)
                                        break
                                    except BufferError:  # local queue full: serve reports
                                        producer.poll(0.05)
                        rows += b.num_rows
                    writer.close()
                    raw.flush()
                    os.fsync(raw.fileno())
                if producer is not None:
                    left = producer.flush(60)
                    if errors or left:
                        raise RuntimeError(f"kafka: {left} not delivered, errors {errors[:1]}")
                if rows:
                    os.replace(tmp, final)
                    fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
                    os.fsync(fd)
                    os.close(fd)
                else:
                    tmp.unlink()
                conn.commit()
        yield pa.RecordBatch.from_pylist(
            [{"rows": rows, "task_s": time.perf_counter() - started}], schema=report)

    return write


# --------------------------------------------------------------------------- one run


@dataclass
class Run:
    """One query over one input folder with one writer; batch times from inside
    ``foreachBatch``."""

    times: list[float] = field(default_factory=list)  # per batch, seconds (warm-up first)
    rows: list[int] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    started: float = 0.0
    workers: list[int] = field(default_factory=list)  # peak RSS per worker process
    relation: list[float] = field(default_factory=list)  # empty-relation calls, seconds
    kafka_rows: int | None = None  # rows found in the topic's log (checked runs only)
    phases: list[dict[str, float]] = field(default_factory=list)  # B: per batch, measured

    @property
    def rss(self) -> int:
        return self.workers[0] if self.workers else 0


@dataclass
class Setup:
    """What every run shares."""

    spark: Any
    work: Path
    dsn: str
    rss: WorkerRss
    kafka: str | None = None  # bootstrap servers of the private broker
    kafka_reuse: bool = False
    kafka_prepare: str = DEFAULT_PREPARE  # B's KafkaParticipant(prepare=...)
    files_native: bool | None = None  # B's StagedFileParticipant(native=...)
    persist: bool | None = None  # B's persist policy (None: the sink's; bench/persist.py)
    where: str | None = None  # a filter both sides apply to the batch (bench/persist.py)


def _relation_partitions(df: Any) -> int | None:
    try:
        from twophase.spark.split import input_partitions as _input_partitions
    except ImportError:  # an older twophase: no such rule
        return None
    return _input_partitions(df)


def run_query(setup: Setup, input_dir: str, variant: str, *, empty_relations: int = 0,
              check_kafka: bool = False) -> Run:
    from twophase import TransactionalSink
    from twophase.sinks.files import StagedFileParticipant
    from twophase.sinks.postgres import PostgresParticipant

    spark, work, dsn = setup.spark, setup.work, setup.dsn
    tag = uuid.uuid4().hex[:10]
    table, out_dir, ckpt = f"e2e_{variant.lower()}_{tag}", work / f"out-{tag}", work / f"ck-{tag}"
    topic = f"e2e-{variant.lower()}-{tag}"
    out_dir.mkdir()
    if setup.kafka:
        new_topic(setup.kafka, topic, partitions=2)
    pg = PostgresParticipant(dsn=dsn, table=table)
    result = Run()
    sink: TransactionalSink | None = None
    last_batch: list[int] = []
    if variant == "A":
        from twophase.spark.session import arrow_schema as _arrow_schema

        writer = _at_least_once_writer(
            dsn, table, str(out_dir), (setup.kafka, topic) if setup.kafka else None)
        checked: list[bool] = []

        def write(df: Any, batch_id: int) -> int:
            if not checked:  # the same table as B's participant creates
                pg.check(_arrow_schema(df))
                pg.close()
                checked.append(True)
            t0 = time.perf_counter()
            out = df.mapInArrow(writer, "rows long, task_s double").collect()
            result.phases.append({"job_s": time.perf_counter() - t0,
                                  "task_s": max((r["task_s"] for r in out), default=0.0)})
            return sum(int(r["rows"]) for r in out)
    else:
        parts: list[Any] = [pg, StagedFileParticipant(str(out_dir), "parquet",
                                                      native=setup.files_native)]
        if setup.kafka:
            from twophase.sinks.kafka import KafkaParticipant

            parts.append(KafkaParticipant(topic, {"bootstrap.servers": setup.kafka},
                                          reuse_clients=setup.kafka_reuse,
                                          prepare=setup.kafka_prepare))
        sink = TransactionalSink(
            f"e2e{tag}", parts, coordinator=f"sqlite:///{work / f'coord-{tag}.db'}",
            vote_timeout=120.0,
        )
        if setup.persist is not None:
            sink._engine.job.persist = setup.persist  # the persist policy's override

        def write(df: Any, batch_id: int) -> int:
            assert sink is not None
            sink(df, batch_id)
            result.phases.append(dict(sink.history[-1].phases))
            return sink.history[-1].rows

    def timed(df: Any, batch_id: int) -> None:
        """What Spark calls per micro-batch: the writer, timed from inside."""
        t0 = time.perf_counter()
        result.rows.append(write(df if setup.where is None else df.where(setup.where),
                                 batch_id))
        t1 = time.perf_counter()
        result.starts.append(t0)
        result.ends.append(t1)
        result.times.append(t1 - t0)
        last_batch[:] = [batch_id]

    setup.rss.arm()
    result.started = time.perf_counter()
    try:
        q = (spark.readStream.schema(EVENT_DDL).option("maxFilesPerTrigger", 1)
             .parquet(input_dir).writeStream.foreachBatch(timed)
             .option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start())
        q.awaitTermination()
        result.workers = setup.rss.disarm()
        if empty_relations:
            empty = spark.createDataFrame([], EVENT_DDL)
            n_in = _relation_partitions(empty)
            if n_in not in (0, None):
                raise RuntimeError(f"the empty relation has {n_in} input partitions, not 0")
            # Spark's stream thread carries the query's id (the sink's lineage) as a local
            # property; this thread takes it over for the batch ids Spark would give next.
            sc = spark.sparkContext
            sc.setLocalProperty("sql.streaming.queryId", str(q.id))
            try:
                for i in range(empty_relations):
                    t0 = time.perf_counter()
                    write(empty, last_batch[0] + 1 + i)
                    result.relation.append(time.perf_counter() - t0)
            finally:
                sc.setLocalProperty("sql.streaming.queryId", None)
            del result.phases[len(result.times):]  # the batches' phases, not the calls'
        if check_kafka and setup.kafka:
            result.kafka_rows = committed_rows(setup.kafka, topic)
    finally:
        setup.rss.disarm()
        if sink is not None:
            sink.close()
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(ckpt, ignore_errors=True)
        if setup.kafka:
            drop_topic(setup.kafka, topic)
        try:
            import psycopg
            from psycopg import sql

            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
        except Exception:  # cleanup only
            pass
    return result


def rate(r: Run) -> float:
    """Rows/s over the measured batches (first measured start to last end)."""
    rows = sum(r.rows[1:])
    return rows / max(1e-9, r.ends[-1] - r.starts[1]) if rows else 0.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[i]


def label(n: int) -> str:
    return "empty" if n == 0 else f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k"


def _warm_up(setup: Setup, work: Path, v: str) -> None:
    """One small run of side ``v`` (JIT, worker start, imports: not charged to the first
    pair); with Kafka, its rows are counted in the topic's log."""
    warm = work / "in-warmup"
    if not warm.exists():
        write_input(str(warm), batches=2, rows_per_batch=1000)
    r = run_query(setup, str(warm), v, check_kafka=True)
    if r.kafka_rows is not None:
        print(f"  warm-up {v}: {sum(r.rows)} rows written, {r.kafka_rows} committed "
              "records in the Kafka topic's log", flush=True)
        if r.kafka_rows < sum(r.rows):
            raise RuntimeError(f"kafka: {v} lost rows ({r.kafka_rows} < {sum(r.rows)})")


def measure_size(setup: Setup, work: Path, size: int, args: argparse.Namespace,
                 summary: dict[str, float], restart: dict[str, list[float]], *,
                 title: str = "") -> None:
    """``args.pairs`` alternating A/B pairs at ``size`` rows per batch (0: the empty
    section); prints the section and puts its figures in ``summary``."""
    mb = 1024 * 1024
    inp = work / f"in-{label(size)}"
    if size:
        write_input(str(inp), batches=args.batches + 1, rows_per_batch=size)
    else:
        write_input(str(inp), batches=1, rows_per_batch=1000)
        empty = pa.table({"id": pa.array([], pa.int64())})
        for i in range(1, args.empty_batches + 1):
            place_batch(inp, i, empty)
    ratios, added, times = [], [], {"A": [], "B": []}  # type: ignore[var-annotated]
    relation: dict[str, list[float]] = {"A": [], "B": []}
    peaks: dict[str, list[int]] = {"A": [], "B": []}
    procs: dict[str, int] = {"A": 0, "B": 0}
    all_runs: dict[str, list[Run]] = {"A": [], "B": []}
    for i in range(args.pairs):
        order = ("A", "B") if i % 2 == 0 else ("B", "A")
        runs = {v: run_query(setup, str(inp), v,
                             empty_relations=0 if size else args.empty_relations)
                for v in order}
        for v in runs:
            all_runs[v].append(runs[v])
        for v, r in runs.items():
            times[v].extend(r.times[1:])
            relation[v].extend(r.relation)
            peaks[v].append(r.rss)
            procs[v] += len(r.workers)
            restart[v].append(r.ends[0] - r.started)
        added.extend(b - a for a, b in zip(runs["A"].times[1:], runs["B"].times[1:],
                                           strict=True))
        if size:
            ratios.append(rate(runs["B"]) / rate(runs["A"]))
            print(f"  {title}{label(size)} pair {i + 1}: A {rate(runs['A']):,.0f} rows/s, "
                  f"B {rate(runs['B']):,.0f} rows/s, B/A {ratios[-1]:.2f}; peak "
                  f"worker RSS A {runs['A'].rss / mb:.0f} MB, B "
                  f"{runs['B'].rss / mb:.0f} MB", flush=True)
        else:
            print(f"  {title}empty pair {i + 1}: empty file A p50 "
                  f"{1000 * statistics.median(runs['A'].times[1:]):.0f} ms, B p50 "
                  f"{1000 * statistics.median(runs['B'].times[1:]):.0f} ms; relation "
                  f"A p50 {1000 * statistics.median(runs['A'].relation):.0f} ms, "
                  f"B p50 {1000 * statistics.median(runs['B'].relation):.0f} ms",
                  flush=True)
    a50, b50 = statistics.median(times["A"]), statistics.median(times["B"])
    what = "per task" if args.fresh_workers else "per worker"
    name = f"{title}{label(size) if size else 'empty file'}"
    line = (f"{name}: A batch p50 {1000 * a50:.0f} ms, "
            f"B batch p50 "
            f"{1000 * b50:.0f} ms; added p50 {1000 * pct(added, 0.5):.0f} ms, "
            f"p99 {1000 * pct(added, 0.99):.0f} ms; peak RSS {what} A "
            f"{statistics.median(peaks['A']) / mb:.0f} MB, B "
            f"{statistics.median(peaks['B']) / mb:.0f} MB (median over runs of the "
            f"highest; {procs['A']} / {procs['B']} worker processes)")
    if size:
        line = (f"{name}: B/A rows/s per pair "
                f"[{', '.join(f'{x:.2f}' for x in ratios)}] median "
                f"{statistics.median(ratios):.2f}\n" + line)
        summary[f"ratio@{label(size)}"] = statistics.median(ratios)
        summary[f"added_p50@{label(size)}"] = 1000 * pct(added, 0.5)
    else:
        summary["empty_batch_p50"] = 1000 * b50
        summary["empty_added_p50"] = 1000 * pct(added, 0.5)
        if relation["B"]:
            ra, rb = relation["A"], relation["B"]
            line += (f"\nempty relation ({len(rb)} calls per side, no row; B runs "
                     f"no Spark job, A a job of empty tasks): A p50 "
                     f"{1000 * pct(ra, 0.5):.1f} ms, p99 "
                     f"{1000 * pct(ra, 0.99):.1f} ms; B p50 {1000 * pct(rb, 0.5):.1f}"
                     f" ms, p99 {1000 * pct(rb, 0.99):.1f} ms")
            summary["empty_relation_p50"] = 1000 * pct(rb, 0.5)
    print(line, flush=True)
    phases = phase_line(name, all_runs, a50)
    if phases:
        print(phases, flush=True)


def _broker(args: argparse.Namespace, work: Path) -> Any:
    """The private broker of the Kafka runs, started: Apache Kafka (one KRaft node, jars
    from Maven) unless ``--kafka-tansu``."""
    if args.kafka_tansu:
        from twophase.testing.localkafka import LocalTansu

        return LocalTansu(base_dir=str(work)).start()
    from twophase.testing.apachekafka import LocalKafka

    return LocalKafka().start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000",
                    help="rows per batch, comma separated; 0 = the empty batch")
    ap.add_argument("--pairs", type=int, default=7, help="A/B pairs per size")
    ap.add_argument("--batches", type=int, default=5, help="measured batches per run")
    ap.add_argument("--empty-batches", type=int, default=10,
                    help="measured empty-file batches per run of the empty section")
    ap.add_argument("--empty-relations", type=int, default=10,
                    help="empty-relation calls per run of the empty section: each side's "
                         "foreachBatch function called directly with a DataFrame of no "
                         "row (spark.createDataFrame([], schema)), the function Spark "
                         "calls per micro-batch; B settles it with no Spark job, A runs its "
                         "job over the empty partitions")
    ap.add_argument("--no-empty", action="store_true", help="skip the empty section")
    ap.add_argument("--kafka", action="store_true",
                    help="add a Kafka topic on a private broker to both sides (A: a plain "
                         "idempotent producer; B: KafkaParticipant)")
    ap.add_argument("--kafka-tansu", action="store_true",
                    help="the private broker is tansu (the old stand-in), not Apache Kafka")
    ap.add_argument("--kafka-prepare", default=None, type=kafka_prepare,
                    metavar="{resumable,staged}",
                    help="B's KafkaParticipant(prepare=...) (default: the participant's "
                         "default; in_task was retired in 0.4)")
    ap.add_argument("--kafka-reuse", action="store_true",
                    help="with --kafka (implied): B's KafkaParticipant(reuse_clients=True)")
    ap.add_argument("--kafka-sizes", default="100000",
                    help="rows per batch of the Kafka section (comma separated)")
    ap.add_argument("--kafka-pairs", type=int, default=3, help="A/B pairs per Kafka size")
    ap.add_argument("--no-kafka-section", dest="kafka_section", action="store_false",
                    help="skip the Kafka section (run by default after the others: both "
                         "sides also write a topic on a private broker; its ratio is the "
                         "last line's kafka_ratio@100k)")
    ap.add_argument("--fresh-workers", action="store_true",
                    help="spark.python.worker.reuse=false: a new Python worker per task, so "
                         "the peak worker RSS is one task's")
    ap.add_argument("--dir", default=None, help="work folder (default: a temp folder)")
    args = ap.parse_args(argv)
    args.kafka = args.kafka or args.kafka_reuse
    args.kafka_sizes = [int(x) for x in args.kafka_sizes.split(",") if x.strip()]
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not args.no_empty and 0 not in sizes:
        sizes.append(0)

    work = Path(tempfile.mkdtemp(prefix="twophase-e2e-", dir=args.dir))
    pg = LocalPostgres(fsync=True).start()
    broker: Any = None
    summary: dict[str, float] = {}
    try:
        if args.kafka:
            broker = _broker(args, work)
        # A is a plain foreachBatch job: like any PySpark job using pyarrow on the
        # workers, it must name an interpreter that has it (pip-installed PySpark reads
        # only PYSPARK_PYTHON and otherwise runs `python3`; TransactionalSink chooses the
        # driver's own in local mode by itself).
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        conf = {"spark.python.worker.reuse": "false"} if args.fresh_workers else {}
        spark = spark_session(conf)
        setup = Setup(spark, work, pg.dsn, WorkerRss(), broker.bootstrap if broker else None,
                      args.kafka_reuse, args.kafka_prepare or DEFAULT_PREPARE)
        kafka = (f"Kafka ({'tansu' if args.kafka_tansu else 'Apache Kafka'}; B's prepare "
                 f"{setup.kafka_prepare}{', reuse_clients=True' if args.kafka_reuse else ''})")
        targets = "PostgreSQL + Parquet" + (f" + {kafka}" if args.kafka else "")
        workers = ("a fresh Python worker per task" if args.fresh_workers
                   else "Python workers reused")
        print(f"e2e: Spark {spark.version} local[2], {targets}, {args.pairs} pairs, "
              f"{args.batches} measured batches per run, {workers}, work dir {work}",
              flush=True)
        restart: dict[str, list[float]] = {"A": [], "B": []}
        for v in ("A", "B"):
            _warm_up(setup, work, v)
        for size in sizes:
            measure_size(setup, work, size, args, summary, restart)
        if args.kafka_section and not args.kafka:
            broker = _broker(args, work)
            ksetup = dataclasses.replace(setup, kafka=broker.bootstrap)
            print(f"kafka section: + a topic on both sides, {kafka}, {args.kafka_pairs} "
                  "pairs", flush=True)
            for v in ("A", "B"):
                _warm_up(ksetup, work, v)
            ksummary: dict[str, float] = {}
            for size in args.kafka_sizes:
                measure_size(ksetup, work, size, argparse.Namespace(
                    **{**vars(args), "pairs": args.kafka_pairs}), ksummary,
                    {"A": [], "B": []}, title="kafka ")
            summary.update({f"kafka_{k}": v for k, v in ksummary.items()})
        elif args.kafka:
            summary.update({f"kafka_{k}": v for k, v in summary.items()
                            if k.startswith("ratio@")})
        extra = 1000 * (statistics.median(restart["B"]) - statistics.median(restart["A"]))
        print(f"restart: start() to first batch done, B minus A (median over every run): "
              f"{extra:.0f} ms", flush=True)
        spark.stop()
    finally:
        if broker is not None:
            broker.stop()
        pg.stop()
        shutil.rmtree(work, ignore_errors=True)

    def fmt(key: str, unit: str = "", digits: int = 2) -> str:
        v = summary.get(key)
        return "n/a" if v is None else f"{v:.{digits}f}{unit}"

    print(f"e2e: ratio@100k={fmt('ratio@100k')} ratio@1M={fmt('ratio@1M')} "
          f"added_p50@100k={fmt('added_p50@100k', digits=0)} ms "
          f"empty_batch_p50={fmt('empty_batch_p50', digits=0)} ms "
          f"empty_relation_p50={fmt('empty_relation_p50', digits=0)} ms "
          f"ratio@10k={fmt('ratio@10k')} "
          f"added_p50@10k={fmt('added_p50@10k', digits=0)} ms "
          f"empty_added_p50={fmt('empty_added_p50', digits=0)} ms "
          f"kafka_ratio@100k={fmt('kafka_ratio@100k')} "
          f"kafka_ratio@1M={fmt('kafka_ratio@1M')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
