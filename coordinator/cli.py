"""The ``twophase`` command line.

Each subcommand lives in its own function and imports what it needs when it runs, so
``twophase --help`` works without pyspark, psycopg or confluent-kafka installed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from twophase import __version__

DESCRIPTION = """\
twophase: exactly-once output for PySpark Structured Streaming.

foreachBatch is at-least-once: after a crash Spark runs the same micro-batch again.
twophase wraps the batch's writes to Kafka, PostgreSQL and files in one two-phase
commit per micro-batch, so every row lands exactly once in every system.
"""

EPILOG = """\
examples:
  twophase demo                                   run the demo job end to end
  twophase serve --store sqlite:///tp.db --port 7070 --token "$TWOPHASE_TOKEN"
  twophase txns --coordinator http://host:7070 --sink orders --json
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="twophase",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"twophase {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for register in _SUBCOMMANDS:
        register(sub)
    return parser


_SUBCOMMANDS: list = []  # type: ignore[type-arg]  # filled below, one function per command


# --- serve / txns (coordinator) -------------------------------------------------------

SERVE_EPILOG = """\
examples:
  TWOPHASE_TOKEN=s3cret twophase serve --store sqlite:////var/lib/twophase/log.db --port 7070
  twophase serve --store postgresql://twophase@db:5432/twophase --host 0.0.0.0 --token s3cret
  twophase serve --store sqlite:///dev.db --insecure          # no auth: local testing only
  twophase serve --store sqlite:///tp.db --token t --ssl-certfile cert.pem --ssl-keyfile key.pem

Several daemons may share one PostgreSQL store (no leader: every change is a
compare-and-set). SQLite allows one daemon per file.
"""


def _register_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    import os

    p = sub.add_parser(
        "serve",
        help="run the coordinator daemon (HTTP/JSON, OpenAPI at /openapi.json)",
        description="Run the coordinator: the durable 2PC decision log behind an HTTP API "
        "with bearer-token auth, /healthz and Prometheus /metrics.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--store", required=True, metavar="URL",
                   help="sqlite:///path.db (default kind) or postgresql://user@host:port/db")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7070, help="port (default 7070)")
    p.add_argument("--token", default=os.environ.get("TWOPHASE_TOKEN"),
                   help="bearer token required on every call but /healthz and /metrics "
                   "(default: $TWOPHASE_TOKEN)")
    p.add_argument("--insecure", action="store_true",
                   help="allow running without a token (anyone reaching the port can decide)")
    p.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", help="private key of --ssl-certfile (PEM)")
    p.add_argument("--retention", default="3d",
                   help="keep finished transactions this long (e.g. 12h, 3d; default 3d)")
    p.add_argument("--alert-after", default="10m",
                   help="flag decided transactions not fully acknowledged after this long "
                   "(default 10m)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every request (slower)")
    p.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from coordinator.background import Settings, parse_duration
    from coordinator.service import create_app, setup_logging
    from coordinator.store import Store, StoreError

    if not args.token and not args.insecure:
        print("twophase serve: no token: pass --token or set TWOPHASE_TOKEN "
              "(or --insecure to run without authentication)", file=sys.stderr)
        return 2
    if not args.token:
        print("WARNING: running WITHOUT authentication (--insecure): anyone who can reach "
              f"{args.host}:{args.port} can change transactions", file=sys.stderr)
    setup_logging(args.log_level)
    try:
        settings = Settings(retention=parse_duration(args.retention),
                            alert_after=parse_duration(args.alert_after))
        store = Store(args.store)
    except (ValueError, StoreError) as exc:
        print(f"twophase serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(store, args.token, insecure=args.insecure, settings=settings)
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level,
        access_log=args.access_log, ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile, timeout_keep_alive=75,
    )
    return 0


TXNS_EPILOG = """\
examples:
  twophase txns --coordinator sqlite:///tp.db
  twophase txns --coordinator http://host:7070 --sink orders --state COMMITTING
  twophase txns --coordinator http://host:7070 --state ALERT --json | jq '.[].branches'

states: OPEN PREPARING COMMITTING COMMITTED ABORTING ABORTED, or ALERT (decided, branches
still not acknowledged after --alert-after).
"""


def _register_txns(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    import os

    p = sub.add_parser(
        "txns",
        help="list transactions and their branches (table, or --json)",
        description="List transactions, newest first, from a store URL or a daemon URL.",
        epilog=TXNS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--coordinator", "--store", dest="coordinator",
                   default=os.environ.get("TWOPHASE_COORDINATOR"), metavar="URL",
                   help="http(s)://host:port of a daemon, or a store URL "
                   "(default: $TWOPHASE_COORDINATOR)")
    p.add_argument("--sink", help="only this sink")
    p.add_argument("--state", help="only this state (or ALERT)")
    p.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    p.add_argument("--token", default=None, help="daemon token (default: $TWOPHASE_TOKEN)")
    p.add_argument("--json", action="store_true", help="JSON for scripts")
    p.set_defaults(run=_run_txns)


def _run_txns(args: argparse.Namespace) -> int:
    from coordinator.txns_view import fetch, render
    from twophase.client import CoordinatorError

    if not args.coordinator:
        print("twophase txns: pass --coordinator URL (or set TWOPHASE_COORDINATOR)",
              file=sys.stderr)
        return 2
    states = {"OPEN", "PREPARING", "COMMITTING", "COMMITTED", "ABORTING", "ABORTED", "ALERT"}
    if args.state is not None and args.state.upper() not in states:
        print(f"twophase txns: unknown state {args.state!r}; one of {', '.join(sorted(states))}",
              file=sys.stderr)
        return 2
    try:
        txns = fetch(args.coordinator, sink=args.sink, state=args.state, limit=args.limit,
                     token=args.token)
    except (CoordinatorError, ValueError) as exc:
        print(f"twophase txns: {exc}", file=sys.stderr)
        return 1
    render(txns, as_json=args.json, out=sys.stdout)
    return 0


_SUBCOMMANDS += [_register_serve, _register_txns]

# Commands that live in their own modules; each exposes ``register(sub)``. The modules
# import nothing heavy at module level, so ``--help`` stays fast and dependency-free.
_COMMAND_MODULES = ("coordinator.demo_cli", "coordinator.resolve_cli", "coordinator.chaos_cli")


def _register_modules(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    import importlib

    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # not written yet
        module.register(sub)


_SUBCOMMANDS.append(_register_modules)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rc: int = args.run(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
