"""``twophase resolve``: settle the in-doubt branches of a sink whose job is gone."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EPILOG = """\
examples:
  twophase resolve orders --coordinator http://coord:7070 --dry-run
  twophase resolve orders --coordinator sqlite:///tp.db --secrets secrets.json
  twophase resolve --coordinator sqlite:///tp.db --sink orders \\
      --pg-dsn postgresql://u@db/app --pg-table orders --files-path /data/orders

By default the participants are rebuilt from the descriptors the coordinator recorded
when the sink's writer registered (kind, target, non-secret options). Secrets are never
stored: a PostgreSQL password comes from PGPASSWORD / ~/.pgpass or
TWOPHASE_SECRET_<PARTICIPANT>_PASSWORD, a Kafka secret setting from
TWOPHASE_SECRET_<PARTICIPANT>_<KEY> (e.g. TWOPHASE_SECRET_KAFKA_ORDERS_SASL_PASSWORD), or
all of them from --secrets FILE.json ({"participant": {"key": "value"}}). The --pg-*,
--files-*, --kafka-* flags and --job name the participants by hand instead.

Every unfinished transaction of the sink is settled by the recovery rule: a COMMIT
decision commits what is prepared, anything else aborts it (presumed abort), and
prepared leftovers the participants find by name are settled the same way. A lost Kafka
branch under a COMMIT decision needs the data again: restart the query to redo it.
Exit code 0 when nothing is left unresolved.
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "resolve",
        help="settle in-doubt branches of a sink whose job is gone",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--coordinator", required=True,
                   help="store URL (sqlite:///..., postgresql://...) or daemon URL (http://...)")
    p.add_argument("--token", default=None, help="daemon token (default: $TWOPHASE_TOKEN)")
    p.add_argument("sink_arg", nargs="?", metavar="SINK", help="sink name")
    p.add_argument("--sink", default=None, help=argparse.SUPPRESS)
    p.add_argument("--secrets", default=None, metavar="FILE.json",
                   help="secrets per participant name, for participants rebuilt from the "
                   "coordinator's descriptors (default: from the environment)")
    p.add_argument("--job", default=None, metavar="CONFIG.json",
                   help="take participants from a twophase.testing.job config file")
    p.add_argument("--pg-dsn", default=None)
    p.add_argument("--pg-table", default=None)
    p.add_argument("--files-path", default=None)
    p.add_argument("--files-format", default="parquet", choices=["parquet", "jsonl"])
    p.add_argument("--kafka-bootstrap", default=None)
    p.add_argument("--kafka-topic", default=None)
    p.add_argument("--dry-run", action="store_true", help="show what would be done")
    p.add_argument("--json", action="store_true", help="JSON report")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from twophase.connection import connect
    from twophase.errors import TwophaseError
    from twophase.resolve import participants_from, resolve_sink

    args.sink = args.sink or args.sink_arg
    if not args.sink:
        print("twophase resolve: name the sink (twophase resolve SINK --coordinator URL)",
              file=sys.stderr)
        return 2
    by_hand = args.job or args.pg_dsn or args.files_path or args.kafka_bootstrap
    try:
        with connect(args.coordinator, args.token) as conn:
            client = conn.client()
            try:
                if by_hand:
                    participants = _by_hand(args)
                else:
                    secrets = None
                    if args.secrets:
                        with open(args.secrets, encoding="utf-8") as fh:
                            secrets = json.load(fh)
                    participants = participants_from(client.participants(args.sink), secrets)
                try:
                    report = resolve_sink(client, args.sink, participants,
                                          dry_run=args.dry_run)
                finally:
                    for part in participants:
                        part.close()
            finally:
                client.close()
    except (TwophaseError, ValueError, OSError, ImportError) as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc)}))
        print(f"twophase resolve: {exc}", file=sys.stderr)
        return 1
    _print(args, report)
    return 0 if report.ok else 1


def _by_hand(args: argparse.Namespace) -> list[Any]:
    """Participants named by flags or a job config (instead of the recorded descriptors)."""
    from twophase.errors import InvalidRequest
    from twophase.testing.job import JobConfig, build_participants

    if args.job:
        cfg = JobConfig.load(args.job)
    else:
        cfg = JobConfig(input_dir="", checkpoint="", coordinator=args.coordinator,
                        sink=args.sink, pg_dsn=args.pg_dsn,
                        pg_table=args.pg_table or args.sink, files_path=args.files_path,
                        files_format=args.files_format, kafka_bootstrap=args.kafka_bootstrap,
                        kafka_topic=args.kafka_topic or args.sink)
    try:
        return build_participants(cfg)
    except ValueError as exc:
        raise InvalidRequest(
            f"{exc} (name the sink's participants with --pg-dsn/--pg-table, --files-path, "
            "--kafka-bootstrap/--kafka-topic or --job)"
        ) from None


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
