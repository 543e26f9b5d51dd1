"""``twophase serve``: the coordinator daemon (HTTP/JSON, OpenAPI, Prometheus)."""

from __future__ import annotations

import argparse
import sys

EPILOG = """\
examples:
  TWOPHASE_TOKEN=s3cret twophase serve --store sqlite:////var/lib/twophase/log.db --port 7070
  twophase serve --store postgresql://twophase@db:5432/twophase --host 0.0.0.0 --token s3cret
  twophase serve --store sqlite:///dev.db --insecure          # no auth: local testing only
  twophase serve --store sqlite:///tp.db --token t --ssl-certfile cert.pem --ssl-keyfile key.pem

Several daemons may share one PostgreSQL store (no leader: every change is a
compare-and-set). SQLite allows one daemon per file.
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    import os

    p = sub.add_parser(
        "serve",
        help="run the coordinator daemon (HTTP/JSON, OpenAPI at /openapi.json)",
        description="Run the coordinator: the durable 2PC decision log behind an HTTP API "
        "with bearer-token auth, /healthz and Prometheus /metrics.",
        epilog=EPILOG,
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
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from twophase.coordinator.app import create_app
    from twophase.coordinator.background import Settings, parse_duration
    from twophase.coordinator.db import lock_sqlite
    from twophase.coordinator.logs import setup_logging
    from twophase.coordinator.store import Store
    from twophase.errors import StoreError

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
        lock = lock_sqlite(args.store)  # noqa: F841 - held until this process exits
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
