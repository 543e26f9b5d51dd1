"""twophase resolve: settle the in-doubt branches of a sink whose job is gone."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from twophase.cli.common import (
    add_coordinator_flags,
    add_kafka_config_flag,
    descriptor,
    kafka_hint,
    kafka_settings,
)

EPILOG = """\
examples:
  twophase resolve orders --coordinator http://coord:7070 --dry-run
  twophase resolve orders --coordinator sqlite:///tp.db --secrets secrets.json
  TWOPHASE_COORDINATOR=sqlite:///tp.db twophase resolve orders --json
  twophase resolve orders --coordinator sqlite:///tp.db \\
      --pg-dsn postgresql://u@db/app --pg-table orders --files-path /data/orders
  twophase resolve orders --coordinator http://coord:7070 --participant @lake.json
  TWOPHASE_KAFKA_SASL_PASSWORD=... twophase resolve orders --coordinator sqlite:///tp.db \\
      --kafka-bootstrap broker:9093 --kafka-config client.properties

By default the participants are rebuilt from the descriptors the coordinator recorded
when the sink's writer registered (kind, target, non-secret options). Secrets are never
stored: a PostgreSQL password comes from PGPASSWORD / ~/.pgpass or
TWOPHASE_SECRET_<PARTICIPANT>_PASSWORD, a Kafka secret setting from
TWOPHASE_SECRET_<PARTICIPANT>_<KEY> (e.g. TWOPHASE_SECRET_KAFKA_ORDERS_SASL_PASSWORD), or
all of them from --secrets FILE.json ({"participant": {"key": "value"}}), and only for
the participants the --secret-grants file names (a descriptor is recorded by whoever
registered the sink, possibly a job's data token). The --pg-*,
--files-*, --kafka-bootstrap/--kafka-topic and --participant flags name them by hand
(a descriptor as the daemon lists it: GET /v1/sinks/SINK/participants).
--kafka-config FILE lays librdkafka settings (TLS, SASL) over every Kafka participant,
by hand or rebuilt; its sasl.password comes from TWOPHASE_KAFKA_SASL_PASSWORD.

Every unfinished transaction of the sink is settled by the recovery rule: a COMMIT
decision commits what is prepared, anything else aborts it (presumed abort), and
prepared leftovers the participants find by name are settled the same way. A lost Kafka
branch under a COMMIT decision needs the data again: restart the query to redo it.
--dry-run changes nothing anywhere: on a store URL it reads the store without starting
a coordinator on it. Exit code 0 when nothing is left unresolved.
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "resolve",
        help="settle in-doubt branches of a sink whose job is gone",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("sink_arg", nargs="?", metavar="SINK", help="sink name")
    p.add_argument("--sink", default=None, help=argparse.SUPPRESS)  # before SINK was positional
    add_coordinator_flags(p)
    p.add_argument("--secrets", default=None, metavar="FILE.json",
                   help="secrets per participant name, for participants rebuilt from "
                   "descriptors (default: from the environment)")
    p.add_argument("--secret-grants", default=os.environ.get("TWOPHASE_SECRET_GRANTS_FILE"),
                   metavar="PATH",
                   help="file of 'SINK PARTICIPANT FINGERPRINT' lines: the recorded "
                   "participants that may receive the secrets (`twophase sinks --grants "
                   "SINK` prints them); others get none (default: "
                   "$TWOPHASE_SECRET_GRANTS_FILE)")
    p.add_argument("--participant", action="append", default=[], metavar="DESCRIPTOR",
                   help="a participant by hand, rebuilt by kind: a JSON descriptor "
                   "'{\"kind\": ..., \"name\": ..., \"target\": ..., \"options\": {...}}' "
                   "or @FILE.json holding one; repeatable")
    p.add_argument("--pg-dsn", default=None, metavar="DSN",
                   help="a PostgreSQL participant by hand: its database")
    p.add_argument("--pg-table", default=None, metavar="TABLE",
                   help="its table (default: the sink name)")
    p.add_argument("--files-path", default=None, metavar="PATH",
                   help="a staged-files participant by hand: its folder or s3:// prefix")
    p.add_argument("--files-format", default="parquet", choices=["parquet", "jsonl"],
                   help="its file format (default parquet)")
    p.add_argument("--kafka-bootstrap", default=None, metavar="HOST:PORT",
                   help="a Kafka participant by hand: its bootstrap servers")
    p.add_argument("--kafka-topic", default=None, metavar="TOPIC",
                   help="its topic (default: the sink name)")
    add_kafka_config_flag(p)
    p.add_argument("--job", default=None, metavar="CONFIG.json",
                   help="the participants of a `twophase chaos --job` config file")
    p.add_argument("--dry-run", action="store_true",
                   help="show what would be done; change nothing anywhere")
    p.add_argument("--json", action="store_true", help="JSON report")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from twophase.cli.common import read_store, require_store
    from twophase.client.connection import check_coordinator, connect
    from twophase.errors import TwophaseError

    args.sink = args.sink or args.sink_arg
    if not args.sink:
        print("twophase resolve: name the sink (twophase resolve SINK --coordinator URL)",
              file=sys.stderr)
        return 2
    if not args.coordinator:
        print("twophase resolve: pass --coordinator URL (or set TWOPHASE_COORDINATOR)",
              file=sys.stderr)
        return 2
    try:
        location = check_coordinator(args.coordinator)
        if not location.startswith(("http://", "https://")):
            require_store(location, "resolve")
        if args.dry_run and not location.startswith(("http://", "https://")):
            with read_store(location, "resolve") as reader:
                report = _resolve(reader, args)
        else:
            with connect(location, args.token, token_file=args.token_file,
                         create=False) as conn:
                report = _resolve(conn.client(operator=True), args)
    except (TwophaseError, ValueError, OSError, ImportError) as exc:
        from twophase.extras import missing_extra

        msg = (missing_extra(exc) or str(exc)) + kafka_hint(args, str(exc))
        if args.json:
            print(json.dumps({"ok": False, "error": msg}))
        print(f"twophase resolve: {msg}", file=sys.stderr)
        return 1
    _print(args, report)
    return 0 if report.ok else 1


def _resolve(source: Any, args: argparse.Namespace) -> Any:
    """Rebuild or name the participants, then apply the recovery rule (``source``: the
    coordinator's client, or a store reader for a dry run)."""
    from twophase.engine.resolve import participants_from, resolve_sink

    secrets = None
    if args.secrets:
        with open(args.secrets, encoding="utf-8") as fh:
            secrets = json.load(fh)
    kafka = kafka_settings(args)
    by_hand = (args.job or args.pg_dsn or args.files_path or args.kafka_bootstrap
               or args.participant)
    if by_hand:
        participants = _by_hand(args, secrets, kafka)
    else:
        from twophase.grants import Grants

        participants = participants_from(
            source.participants(args.sink), secrets, sink=args.sink,
            grants=Grants(args.secret_grants),
            overlay=lambda d: with_kafka_settings(d, kafka),
            overlay_secrets=[k for k in kafka if _is_secret(k)])
    try:
        _reach_kafka(participants)
        return resolve_sink(source, args.sink, participants, dry_run=args.dry_run)
    finally:
        for part in participants:
            part.close()


def _reach_kafka(participants: list[Any]) -> None:
    """Each Kafka participant's brokers answer with its settings, asked first: a wrong
    password or CA is then named at once, not seen as a marker read timing out (which
    reads like a transaction left open) after connect_timeout_s."""
    if not any(type(p).__name__ == "KafkaParticipant" for p in participants):
        return
    from twophase.sinks.kafka import KafkaParticipant
    from twophase.sinks.kafka.admin import probe_topic
    from twophase.sinks.kafka.config import common_config

    for p in participants:
        if isinstance(p, KafkaParticipant):
            probe_topic(p.describe(), common_config(p.config), p.topic,
                        timeout=p.connect_timeout_s)


def _is_secret(key: str) -> bool:
    from twophase.sinks.kafka.options import is_secret_key

    return is_secret_key(key)


def with_kafka_settings(d: Mapping[str, Any], kafka: Mapping[str, str]) -> Mapping[str, Any]:
    """A Kafka descriptor with ``--kafka-config``'s settings laid over its recorded ones
    (the operator's host may keep the CA elsewhere); a password given there is no longer
    asked of ``TWOPHASE_SECRET_...``. Other kinds, or no settings: unchanged."""
    if not kafka or d.get("kind") != "kafka":
        return d
    options = {**d.get("options", {}), **{f"config.{k}": v for k, v in kafka.items()}}
    given = set(kafka)
    options["secrets"] = ",".join(k for k in str(options.get("secrets") or "").split(",")
                                  if k and k not in given)
    return {**d, "options": options}


def _by_hand(args: argparse.Namespace, secrets: dict[str, Any] | None,
             kafka: dict[str, str]) -> list[Any]:
    """Participants named by flags (or a chaos job config) instead of the recorded
    descriptors; built from the participants' own classes, no test tooling."""
    from twophase.participant import rebuild

    if args.job:
        from twophase.testing.job import JobConfig, build_participants

        cfg = JobConfig.load(args.job)
        if args.kafka_config:
            cfg.kafka_config_file = args.kafka_config
        return build_participants(cfg)
    parts: list[Any] = []
    if args.pg_dsn:
        from twophase.sinks.postgres import PostgresParticipant

        parts.append(PostgresParticipant(dsn=args.pg_dsn, table=args.pg_table or args.sink))
    if args.files_path:
        from twophase.sinks.files import StagedFileParticipant

        parts.append(StagedFileParticipant(path=args.files_path, format=args.files_format))
    if args.kafka_bootstrap:
        from twophase.sinks.kafka import KafkaParticipant

        parts.append(KafkaParticipant(topic=args.kafka_topic or args.sink,
                                      config={**kafka,
                                              "bootstrap.servers": args.kafka_bootstrap}))
    for text in args.participant:
        d = with_kafka_settings(descriptor(text), kafka)
        parts.append(rebuild(d, None if secrets is None else secrets.get(d["name"])))
    return parts


def _print(args: argparse.Namespace, report: Any) -> None:
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        verb = "would do" if args.dry_run else "did"
        for a in report.actions:
            print(f"{verb}: {a.action:<8} {a.txn} {a.branch} (status {a.status})")
        for a in report.unresolved:
            print(f"UNRESOLVED: {a.action}: {a.txn} {a.branch} (status {a.status})")
        print(f"{len(report.actions)} action(s), {len(report.unresolved)} unresolved")
