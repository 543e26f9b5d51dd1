"""``twophase chaos``: kill the driver, a worker or the coordinator at random moments, restart,
run to the end and prove every row landed exactly once (see ``twophase/chaos.py``)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from twophase.cli.common import add_kafka_config_flag, descriptor, kafka_settings

EPILOG = """\
examples:
  twophase chaos                                     10 kills, demo job, private PostgreSQL + files
  twophase chaos --kills 200 --seed 7 --coordinator-mode daemon --json-out chaos.json
  twophase chaos --victims worker,coordinator --coordinator-mode daemon --kills 20
  twophase chaos --kills 5 --no-postgres --batches 2 --rows-per-batch 100
  twophase chaos --kafka-bootstrap broker:9092      also write to (and judge) a Kafka
  twophase chaos --kafka-local                      also write to a private Apache Kafka
                                                    broker (judged from its partition logs
                                                    and a read_committed consumer)
  twophase chaos --kafka-local --victims driver,worker,broker
                                                    ... and kill/restart that broker too
  twophase chaos --kafka-cluster 3 --victims driver,worker,broker --kills 24
                                                    3 Kafka nodes (namespaces; root): the
                                                    broker victim is a partition leader or
                                                    transaction coordinator (failover)
  twophase chaos --files-s3-local                   the files go to a private S3-API server
                                                    (moto) instead of a folder
  twophase chaos --mariadb-local                    also write a private MariaDB (XA, sql extra)
  twophase chaos --delta-local                      also write a Delta table (one version per
                                                    batch; delta extra)
  twophase chaos --iceberg-local --delta-local --kafka-local --coordinator-mode daemon --kills 40
                                                    PostgreSQL + files + Iceberg + Delta + Kafka
                                                    in one sink (iceberg extra)
  twophase chaos --job my-job.json --kills 30       your own participants (a JobConfig as read
                                                    by `python -m twophase.testing.job`);
                                                    chaos writes the input into its
                                                    (empty) input_dir

Victims: driver (the Spark driver process), worker (a Spark Python worker), coordinator
(the `twophase serve` daemon; needs --coordinator-mode daemon), broker (the Apache Kafka
broker of --kafka-local, its log on disk: SIGKILL, a pause of up to --broker-down-max
seconds, restart on the same port and log; with --kafka-tansu, tansu on S3 storage in a
private moto server; with --kafka-cluster, the node leading a partition of the target or
staging topic, or coordinating an open transaction of the sink, restarted after the
pause and waited for until it is back in every ISR). A kill
is a failpoint at a protocol step (before_prepare, after_decision, before_commit, ...) or a
SIGKILL after a random delay (always, for the broker). Every victim gets a kill before
any gets a second (when --kills allows); --seed makes the sequence reproducible. Exit
code 0 only when every system shows 0 duplicates, 0 missing ids and nothing left
prepared.
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "chaos",
        help="SIGKILL driver/worker/coordinator at random N times, restart, verify exactly-once",
        description="Run a streaming job, SIGKILL its driver, a Python worker or the "
        "coordinator at random moments N times (restarting after each), run it to the end, "
        "and verify every system: duplicates, missing ids, leftovers still prepared.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--kills", type=int, default=10, help="kills that must land (default 10)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--victims", default=None,
                   help="comma list of driver,worker,coordinator,broker (default: "
                   "driver,worker, plus coordinator in daemon mode; broker needs "
                   "--kafka-local)")
    p.add_argument("--batches", type=int, default=3,
                   help="new input batches for every job run (default 3)")
    p.add_argument("--rows-per-batch", type=int, default=200, help="rows per batch (default 200)")
    p.add_argument("--partitions", type=int, default=2, help="partitions per batch (default 2)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="input, checkpoint, files output, logs (default: a new temp folder)")
    p.add_argument("--json-out", type=Path, default=None,
                   help="write the JSON report here (default WORKDIR/chaos-report.json)")
    p.add_argument("--coordinator-mode", choices=["embedded", "daemon"], default="embedded",
                   help="embedded: in the driver; daemon: a `twophase serve` process chaos "
                   "starts (and may kill) (default embedded)")
    p.add_argument("--pg-dsn", default=None,
                   help="PostgreSQL to write to (default: a private server, when the server "
                   "binaries are installed)")
    p.add_argument("--no-postgres", action="store_true", help="no PostgreSQL participant")
    p.add_argument("--no-files", action="store_true", help="no staged-files participant")
    p.add_argument("--kafka-bootstrap", default=None, metavar="HOST:PORT",
                   help="also write to this Kafka (judged from its partition logs, cross-checked "
                   "with a read_committed consumer); 'local': a private Apache Kafka "
                   "broker, as in twophase demo (--kafka-local)")
    p.add_argument("--kafka-local", action="store_true",
                   help="also write to a private Apache Kafka broker (4.x, KRaft, one node; "
                   "jars resolved once through Maven, docs/kafka.md), judged from its "
                   "partition logs and a read_committed consumer")
    p.add_argument("--kafka-cluster", type=int, default=None, metavar="N",
                   help="also write to a private Apache Kafka cluster of N nodes (3 or more; "
                   "KRaft, each node in its own network namespace, replication N, "
                   "min.insync.replicas 2; needs root); victim broker then kills the node "
                   "leading a partition of the target or staging topic, or coordinating an "
                   "open transaction of the sink (leader failover), and restarts it")
    p.add_argument("--kafka-tansu", action="store_true",
                   help="also write to a private tansu broker instead (the stand-in used "
                   "before Apache Kafka; it shows aborted records to read_committed readers, "
                   "so it proves nothing on its own)")
    p.add_argument("--kafka-reuse", action="store_true",
                   help="the Kafka participant keeps its producers across batches "
                   "(reuse_clients=True, docs/kafka.md \"Producer reuse\"), to put that "
                   "under kills too")
    p.add_argument("--kafka-prepare", type=kafka_prepare, default=None,
                   metavar="{resumable,staged}",
                   help="the Kafka participant's prepare: resumable (the task's transaction "
                   "left open, ended by the driver with EndTxn) or staged (records staged in "
                   "a topic, copied by the driver); in_task was retired in 0.4 "
                   "(default: the participant's default, resumable)")
    add_kafka_config_flag(p)
    p.add_argument("--broker-down-max", type=float, default=5.0, metavar="SECONDS",
                   help="victim broker: it stays down a random 0..SECONDS after each kill "
                   "(default 5)")
    p.add_argument("--files-s3-local", action="store_true",
                   help="write the staged files to a private S3-API server (moto, from the "
                   "dev extra) as s3://twophase-chaos/files")
    p.add_argument("--sql-url", default=None, metavar="URL",
                   help="also write this SQL database through SqlAlchemyParticipant (a "
                   "SQLAlchemy URL: mysql+pymysql://... or postgresql+psycopg://...)")
    p.add_argument("--mariadb-local", action="store_true",
                   help="also write a private MariaDB server (Debian's mariadb-server) "
                   "through SqlAlchemyParticipant (XA transactions)")
    p.add_argument("--delta-local", action="store_true",
                   help="also write a Delta table (deltalake) in WORKDIR/delta: one table "
                   "version per batch, judged for extra commits too")
    p.add_argument("--iceberg-local", action="store_true",
                   help="also write an Iceberg table (pyiceberg, a SQL catalog on SQLite and a "
                   "warehouse in WORKDIR): one snapshot per batch, judged for extra commits too")
    p.add_argument("--participant", action="append", default=[], metavar="DESCRIPTOR",
                   help="also write a participant rebuilt by kind, e.g. one of your own "
                   "package's (registered under the twophase.participants entry points): "
                   "a JSON descriptor '{\"kind\": ..., \"name\": ..., \"target\": ..., "
                   "\"options\": {...}}' or @FILE.json holding one; repeatable. Its class "
                   "must implement read_back (twophase.participant.Verifiable); secrets come "
                   "from TWOPHASE_SECRET_<PARTICIPANT>_<KEY>")
    p.add_argument("--job", type=Path, default=None, metavar="CONFIG.json",
                   help="run your own job config instead of the demo's")
    p.add_argument("--failpoint-share", type=float, default=0.5,
                   help="share of kills done by failpoint, the rest by timer (default 0.5)")
    p.add_argument("--max-kills-per-run", type=int, default=4,
                   help="worker/coordinator kills one driver run may take before it is left "
                   "to finish (default 4)")
    p.add_argument("--aim-endtxn", type=int, default=0, metavar="N",
                   help="aim the failpoint kills of the driver and coordinator between a "
                   "Kafka vote and its EndTxn (the resumable prepare) until N have landed "
                   "there, each driver run taking one kill meanwhile (a failpoint is drawn "
                   "as a run starts); the report counts them (default 0: points drawn "
                   "evenly)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop killing after this many minutes, then finish and verify")
    p.add_argument("--quiet", action="store_true", help="print only the final report")
    p.add_argument("--json", action="store_true",
                   help="print only the JSON report on stdout (as written to --json-out)")
    p.set_defaults(run=_run_chaos)


def _run_chaos(args: argparse.Namespace) -> int:
    from twophase.testing.chaos import ChaosError, ChaosOptions, render, run_chaos
    from twophase.testing.job import JobConfig
    from twophase.testing.servers import ServerUnavailable

    def say(msg: str) -> None:
        if not args.quiet and not args.json:
            print(msg, flush=True)

    if args.kafka_bootstrap == "local":  # demo's spelling of a private broker
        args.kafka_bootstrap, args.kafka_local = None, True
    if args.victims is None:
        victims: tuple[str, ...] = ("driver", "worker") + (
            ("coordinator",) if args.coordinator_mode == "daemon" else ())
    else:
        victims = tuple(v.strip() for v in args.victims.split(",") if v.strip())
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="twophase-chaos-"))
    job = None
    if args.job is not None:
        try:
            job = JobConfig.load(args.job)
        except (OSError, ValueError, TypeError) as exc:
            print(f"twophase chaos: cannot read job config {args.job}: {exc}", file=sys.stderr)
            return 2
    try:
        extra = tuple(descriptor(text) for text in args.participant)
    except ValueError as exc:
        print(f"twophase chaos: --participant: {exc}", file=sys.stderr)
        return 2
    if extra and job is not None:
        print("twophase chaos: --participant adds to the demo job; with --job, list the "
              "descriptors in the config's \"participants\"", file=sys.stderr)
        return 2
    if args.kafka_config:
        if not (args.kafka_bootstrap or (job is not None and job.kafka_bootstrap)):
            print("twophase chaos: --kafka-config (or $TWOPHASE_KAFKA_CONFIG) is for a "
                  "secured broker of yours: pass it with --kafka-bootstrap HOST:PORT or a "
                  "--job naming kafka_bootstrap (the private brokers are plaintext)",
                  file=sys.stderr)
            return 2
        try:
            kafka_settings(args)  # a bad file refused before any server starts
        except ValueError as exc:
            print(f"twophase chaos: {exc}", file=sys.stderr)
            return 2
        if job is not None:
            job.kafka_config_file = args.kafka_config
    if args.kafka_cluster is not None and args.kafka_cluster < 3:
        print("twophase chaos: --kafka-cluster needs 3 or more nodes (replication 3 with "
              "min.insync.replicas 2 survives one node down)", file=sys.stderr)
        return 2
    local_kafka = args.kafka_local or args.kafka_tansu or args.kafka_cluster is not None
    if "broker" in victims and not (local_kafka and job is None):
        print("twophase chaos: victim 'broker' needs --kafka-local (chaos kills and restarts "
              "the private Kafka broker it starts; it cannot restart a broker given by "
              "--kafka-bootstrap or a --job's)", file=sys.stderr)
        return 2
    servers: list[Any] = []
    broker: Any = None  # LocalKafka or LocalTansu
    try:
        pg_dsn = args.pg_dsn
        if args.kafka_reuse and (job is not None or not (args.kafka_bootstrap
                                                          or local_kafka)):
            print("twophase chaos: --kafka-reuse needs --kafka-local or --kafka-bootstrap "
                  "(with --job, set kafka_reuse in the config)", file=sys.stderr)
            return 2
        if job is None and pg_dsn is None and not args.no_postgres:
            from twophase.testing.localpg import LocalPostgres, find_bindir

            if find_bindir() is not None:
                say("starting a private PostgreSQL server ...")
                server = LocalPostgres(max_prepared_transactions=100, fsync=False)
                server.start()
                servers.append(server)
                pg_dsn = server.dsn
            else:
                say("PostgreSQL server binaries not found: running without PostgreSQL "
                    "(pass --pg-dsn, or install the 'postgresql' package)")
        kafka = args.kafka_bootstrap
        if local_kafka and job is None:
            if kafka or (args.kafka_local + args.kafka_tansu
                         + (args.kafka_cluster is not None)) > 1:
                print("twophase chaos: pass one of --kafka-bootstrap, --kafka-local, "
                      "--kafka-tansu, --kafka-cluster", file=sys.stderr)
                return 2
            from twophase.testing.apachekafka import LocalKafka
            from twophase.testing.localkafka import LocalTansu

            if args.kafka_cluster is not None:
                from twophase.testing.kafkacluster import KafkaCluster

                say(f"starting a private Apache Kafka cluster of {args.kafka_cluster} nodes "
                    "...")
                broker = KafkaCluster(args.kafka_cluster)
            elif args.kafka_local:
                say("starting a private Apache Kafka broker ...")
                broker = LocalKafka()
            elif "broker" in victims:
                # Its log must survive its kills: S3 storage in a private moto server.
                from twophase.testing.locals3 import LocalS3

                say("starting a private S3-API server (moto) for the broker's log ...")
                log_store = LocalS3()
                log_store.start()
                servers.append(log_store)
                bucket = log_store.create_bucket("twophase-chaos-tansu")
                say("starting a private tansu broker on S3 storage ...")
                broker = LocalTansu(storage=f"s3://{bucket}/", s3={
                    "endpoint": log_store.endpoint, "access_key": log_store.access_key,
                    "secret_key": log_store.secret_key, "region": log_store.region})
            else:
                say("starting a private tansu broker ...")
                broker = LocalTansu()
            broker.start()
            servers.append(broker)
            kafka = broker.bootstrap
        files_path, files_options = None, None
        if args.files_s3_local and job is None and not args.no_files:
            from twophase.testing.locals3 import LocalS3

            say("starting a private S3-API server (moto) ...")
            store = LocalS3()
            store.start()
            servers.append(store)
            files_path = f"s3://{store.create_bucket('twophase-chaos')}/files"
            files_options = store.storage_options
        sql_url = args.sql_url
        if args.mariadb_local and job is None:
            if sql_url:
                print("twophase chaos: pass --sql-url or --mariadb-local, not both",
                      file=sys.stderr)
                return 2
            from twophase.testing.localmariadb import LocalMariaDB

            say("starting a private MariaDB server ...")
            maria = LocalMariaDB()
            maria.start()
            servers.append(maria)
            sql_url = maria.url
        delta_path = str(workdir / "delta") if args.delta_local and job is None else None
        iceberg = args.iceberg_local and job is None
        if job is None and not (pg_dsn or not args.no_files or kafka or sql_url or delta_path
                                or iceberg or extra):
            print("twophase chaos: no participant left (PostgreSQL, files and Kafka all off)",
                  file=sys.stderr)
            return 2
        opts = ChaosOptions(
            workdir=workdir, kills=args.kills, seed=args.seed, victims=victims,
            batches=args.batches, rows_per_batch=args.rows_per_batch,
            coordinator_mode=args.coordinator_mode, pg_dsn=pg_dsn,
            files=not args.no_files, files_path=files_path, files_options=files_options,
            kafka_bootstrap=kafka, kafka_reuse=args.kafka_reuse,
            kafka_prepare=args.kafka_prepare, kafka_config_file=args.kafka_config,
            sql_url=sql_url,
            delta_path=delta_path, iceberg_local=iceberg, participants=extra, job=job,
            broker=broker if "broker" in victims else None,
            broker_down_max_s=args.broker_down_max,
            partitions=args.partitions, failpoint_share=args.failpoint_share,
            json_out=args.json_out, log=say, max_kills_per_run=args.max_kills_per_run,
            aim_endtxn=args.aim_endtxn,
            max_seconds=None if args.max_minutes is None else args.max_minutes * 60,
        )
        say(f"chaos in {workdir}: {args.kills} kills of {', '.join(victims)}, seed {args.seed}")
        report = run_chaos(opts)
    except (ChaosError, ServerUnavailable) as exc:
        print(f"twophase chaos: {exc}", file=sys.stderr)
        return 2
    finally:
        for s in reversed(servers):
            s.stop()
    if args.json:
        print(Path(report["json_path"]).read_text(encoding="utf-8"))
        return 0 if report["ok"] else 1
    print("\n".join(render(report)))
    if args.quiet:
        print(json.dumps({"ok": report["ok"], "json": report["json_path"]}))
    return 0 if report["ok"] else 1


def kafka_prepare(value: str) -> str:
    """``--kafka-prepare``: the participant's own rule (the retired "in_task" refused
    naming its replacement), as an argparse error."""
    from twophase.sinks.kafka.options import check_prepare

    try:
        return check_prepare(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
