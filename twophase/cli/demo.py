"""twophase demo: the main job, end to end, on a machine with no servers prepared.

Generated events (deterministic ids, one Parquet input file per micro-batch) stream
through a TransactionalSink with an embedded coordinator into staged Parquet files and a
PostgreSQL table (a private server started here when the binaries exist), optionally a
Kafka topic; live progress per batch; at the end every id is checked to have landed
exactly once in every system.

With --kafka, the pipeline users run: the events are produced to a Kafka topic, read by
Spark's own Kafka source (its jars resolved once through Maven) and written to a Kafka
topic and the PostgreSQL table through one sink.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from twophase.cli.common import add_kafka_config_flag, kafka_settings
from twophase.errors import InvalidRequest

EPILOG = """\
examples:
  twophase demo                               10 batches x 1,000 rows into files + PostgreSQL
  twophase demo --batches 50 --rows-per-batch 10000
  twophase demo --no-postgres                 files only
  twophase demo --coordinator-mode daemon     through a `twophase serve` daemon it starts
  twophase demo --kafka-bootstrap local       also a Kafka topic on a private Apache Kafka
  twophase demo --kafka-bootstrap host:9092   also a Kafka topic on your broker
  twophase demo --kafka                       Kafka in -> Spark -> Kafka + PostgreSQL, on a
                                              private Apache Kafka (or --kafka-bootstrap's)

Exit code 0 when every id landed exactly once in every judged system, 1 otherwise.
"""

MARKER = ".twophase-demo"  # marks a work folder this command created (and may empty)


class WorkdirRefused(InvalidRequest):
    """The work folder has content the demo did not create."""


def prepare_workdir(path: str | Path) -> Path:
    """Create the work folder, or empty one that an earlier demo run created (it holds the
    marker file). Never deletes anything else: a non-empty folder without the marker is
    refused."""
    work = Path(path).resolve()
    if work.exists() and not work.is_dir():
        raise WorkdirRefused(f"--workdir {work} is a file, not a folder")
    if work.exists() and any(work.iterdir()):
        if not (work / MARKER).is_file():
            raise WorkdirRefused(
                f"--workdir {work} is not empty and was not created by twophase demo; "
                "nothing was deleted. Pass a new or empty folder (e.g. --workdir "
                "twophase-demo-2), or empty this one yourself"
            )
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("created by twophase demo: this folder is emptied at the "
                               "next run\n")
    return work


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo",
        help="run the demo streaming job and prove exactly-once",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--batches", type=int, default=10, help="micro-batches (default 10)")
    p.add_argument("--rows-per-batch", type=int, default=1000, help="rows each (default 1000)")
    p.add_argument("--workdir", default="twophase-demo",
                   help="folder for input, checkpoint, output, coordinator log "
                   "(default ./twophase-demo); created by the demo, and emptied at the "
                   "next run only if the demo created it (a non-empty folder of yours "
                   "is refused)")
    p.add_argument("--partitions", type=int, default=None,
                   help="branches per participant per batch (default: Spark's parallelism)")
    p.add_argument("--no-postgres", action="store_true", help="files (and Kafka) only")
    p.add_argument("--pg-dsn", default=None,
                   help="use this PostgreSQL instead of starting a private one "
                   "(needs max_prepared_transactions > 0)")
    p.add_argument("--kafka-bootstrap", default=None, metavar="SERVERS",
                   help="add a Kafka topic; 'local' starts a private Apache Kafka broker "
                   "(jars resolved once through Maven; Kafka is judged from its partition "
                   "logs and a read_committed consumer)")
    add_kafka_config_flag(p)
    p.add_argument("--kafka", action="store_true",
                   help="read the events from a Kafka topic of this run (demo_events-ID) "
                   "with Spark's Kafka source and write Kafka (demo_orders) and PostgreSQL, "
                   "not files; the broker is --kafka-bootstrap's, else a private Apache Kafka")
    p.add_argument("--coordinator", default=None, metavar="URL",
                   help="a coordinator daemon (http://host:7070; token from $TWOPHASE_TOKEN) "
                   "instead of one the demo starts")
    p.add_argument("--coordinator-mode", choices=["embedded", "daemon"], default="embedded",
                   help="the coordinator the demo starts, on WORKDIR/coordinator.db: embedded "
                   "in the driver, or a `twophase serve` process (as in twophase chaos) "
                   "(default embedded)")
    p.add_argument("--json", action="store_true", help="print the final report as JSON")
    p.set_defaults(run=run)


def _produce_source(console: Any, bootstrap: str, topic: str, records: int) -> None:
    """The Kafka-in pipeline's input: ``records`` events in a 2-partition topic, and
    Spark's Kafka connector resolved now (Maven, once) rather than inside the job."""
    from twophase.testing.kafkasource import create_source_topic, produce_events
    from twophase.testing.sparkkafka import SPARK_KAFKA_VERSION, spark_kafka_jars

    create_source_topic(bootstrap, topic, partitions=2)
    produce_events(bootstrap, topic, 0, records)
    console.print(f"records in: {records:,} events (ids 0..{records - 1}) produced to Kafka "
                  f"topic {topic} (2 partitions); Spark reads them with its Kafka source "
                  f"(spark-sql-kafka-0-10 {SPARK_KAFKA_VERSION}, "
                  f"{len(spark_kafka_jars())} jars)")


@contextlib.contextmanager
def _jvm_stderr_to(path: Path) -> Iterator[None]:
    """Start the JVM inside this block: it inherits a standard error that is ``path``, so
    Spark's own warnings (log4j, NativeCodeLoader) land there for the whole run and never
    inside the demo's table; this process's standard error is back when the block ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _phase(r: Any, key: str) -> str:
    """One of the batch's phases (``BatchReport.prepare_s``, ``wait_s``, ``commit_s``:
    the tasks' and the driver's work together)."""
    return f"{getattr(r, key) * 1000:7.0f}ms"


def run(args: argparse.Namespace) -> int:
    import secrets

    from rich.console import Console

    console = Console(stderr=False, highlight=False, soft_wrap=True)
    if args.batches < 1 or args.rows_per_batch < 1:
        console.print("twophase demo: --batches and --rows-per-batch must be >= 1")
        return 2
    if args.kafka_config and (args.kafka or args.kafka_bootstrap in (None, "local")):
        console.print("twophase demo: --kafka-config (or $TWOPHASE_KAFKA_CONFIG) is for a "
                      "secured broker of yours: pass it with --kafka-bootstrap HOST:PORT and "
                      "without --kafka (Spark's Kafka source takes Java client settings, "
                      "not librdkafka's)")
        return 2
    try:
        kafka_settings(args)  # a bad file refused before any server starts
    except ValueError as exc:
        console.print(f"twophase demo: {exc}")
        return 2
    if args.coordinator and args.coordinator_mode == "daemon":
        console.print("twophase demo: pass --coordinator URL (a daemon of yours) or "
                      "--coordinator-mode daemon (one the demo starts), not both")
        return 2
    try:
        import pyspark  # noqa: F401
    except ImportError:
        console.print("twophase demo needs the spark extra: pip install 'twophase\\[all]'")
        return 2
    from twophase.testing.apachekafka import LocalKafka
    from twophase.testing.job import (
        JobConfig,
        build_participants,
        expected_ids,
        job_session,
        write_input,
    )
    from twophase.testing.job import run as run_job
    from twophase.testing.localpg import LocalPostgres, PostgresUnavailable, find_bindir
    from twophase.testing.verify import verify

    try:
        work = prepare_workdir(args.workdir)
    except WorkdirRefused as exc:
        console.print(f"twophase demo: {exc}")
        return 2
    servers: list[Any] = []
    conns: list[Any] = []
    try:
        pg_dsn = args.pg_dsn
        if not args.no_postgres and pg_dsn is None:
            if find_bindir() is None:
                console.print("[yellow]PostgreSQL server binaries not found "
                              "(apt-get install postgresql): files only.[/]")
            else:
                try:
                    servers.append(LocalPostgres(max_prepared_transactions=64).start())
                    pg_dsn = servers[-1].dsn
                    console.print(f"private PostgreSQL on {pg_dsn}")
                except PostgresUnavailable as exc:
                    console.print(f"[yellow]could not start PostgreSQL ({exc}): files only.[/]")
        coordinator, token = args.coordinator, None
        if coordinator is None and args.coordinator_mode == "daemon":
            from twophase.testing.servers import LocalDaemon

            token = secrets.token_urlsafe(16)
            servers.append(LocalDaemon(f"sqlite:///{work / 'coordinator.db'}", token,
                                       work / "coordinator.log").start())
            coordinator = servers[-1].url
            console.print(f"coordinator daemon (twophase serve) on {coordinator}")
        kafka = args.kafka_bootstrap or ("local" if args.kafka else None)
        if kafka == "local":
            console.print("starting a private Apache Kafka broker ...")
            servers.append(LocalKafka().start())
            kafka = servers[-1].bootstrap
            console.print(f"private Apache Kafka {servers[-1].version} on {kafka}")
        cfg = JobConfig(
            input_dir=str(work / "input"),
            checkpoint=str(work / "checkpoint"),
            coordinator=coordinator or f"sqlite:///{work / 'coordinator.db'}",
            token=token,
            sink="demo_orders",
            pg_dsn=pg_dsn,
            pg_table="demo_orders",
            files_path=None if args.kafka else str(work / "output"),
            kafka_bootstrap=kafka,
            kafka_topic="demo_orders",
            kafka_config_file=args.kafka_config,
            partitions=args.partitions,
            # a topic of this run's own: a rerun on the same broker reads only its events
            source_topic=f"demo_events-{secrets.token_hex(4)}" if args.kafka else None,
            source_per_batch=args.rows_per_batch,
        )
        # Hold the embedded coordinator for the whole run (the job's sink shares it), so
        # its console can be opened while the job streams.
        from twophase.client.connection import connect

        console_conn = connect(cfg.coordinator, cfg.token)
        conns.append(console_conn)
        console.print(f"console (live, signed in): {console_conn.url}/ui#token="
                      f"{console_conn.operator_token or console_conn.token}")
        if cfg.source_topic and kafka:
            _produce_source(console, kafka, cfg.source_topic, args.batches * args.rows_per_batch)
        else:
            write_input(cfg.input_dir, args.batches, args.rows_per_batch)
        participants = build_participants(cfg)
        console.print(f"starting Spark (local mode); its own log goes to {work / 'spark.log'}")
        with _jvm_stderr_to(work / "spark.log"):
            spark = job_session(cfg)
        console.print(
            f"streaming {args.batches} batches x {args.rows_per_batch} rows into "
            + ", ".join(p.describe() for p in participants)
        )
        console.print(f"{'batch':>5}  {'outcome':<9} {'rows':>7} {'att':>3}  "
                      f"{'prepare':>9} {'wait':>9} {'commit':>9} {'total':>8}")
        totals = {"rows": 0, "batches": 0, "seconds": 0.0}

        def progress(r: Any) -> None:
            totals["rows"] += r.rows
            totals["batches"] += 1
            totals["seconds"] += r.seconds
            console.print(
                f"{r.batch_id:>5}  {r.outcome:<9} {r.rows:>7} {r.attempts:>3}  "
                f"{_phase(r, 'prepare_s'):>9} {_phase(r, 'wait_s'):>9} "
                f"{_phase(r, 'commit_s'):>9} {r.seconds * 1000:6.0f}ms"
            )

        # the table above is the demo's per-batch report: keep only the sink's warnings
        for name in ("twophase.sink", "twophase.preflight"):
            logging.getLogger(name).setLevel(logging.WARNING)
        started = time.perf_counter()
        run_job(cfg, spark, participants=participants, on_batch=progress)
        elapsed = time.perf_counter() - started
        in_batches = totals["seconds"]
        console.print(
            f"committed {totals['batches']} batches, {totals['rows']} rows in {elapsed:.1f}s "
            f"({elapsed - in_batches:.1f}s Spark start-up and scheduling, {in_batches:.1f}s "
            f"inside foreachBatch: {totals['rows'] / max(in_batches, 1e-9):,.0f} rows/s)"
        )
        report = verify(participants, expected_ids(args.batches, args.rows_per_batch),
                        sink=cfg.sink)
        if args.json:
            print(report.to_json())
        else:
            if cfg.source_topic:
                console.print("records out: " + ", ".join(
                    f"{s.rows:,} in {s.participant}" for s in report.systems))
            console.print("exactly-once check:")
            for line in report.lines():
                console.print(line)
        verdict = "[green]OK: every id exactly once[/]" if report.ok else "[red]FAILED[/]"
        console.print(verdict)
        return 0 if report.ok else 1
    finally:
        for c in conns:
            c.close()
        for s in reversed(servers):
            s.stop()
        sys.stdout.flush()
