"""``twophase serve``: the coordinator daemon (HTTP/JSON, OpenAPI, Prometheus)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from twophase.errors import InvalidRequest, StoreError

if TYPE_CHECKING:
    from twophase.coordinator.store import Store

EPILOG = """\
examples:
  twophase serve --store sqlite:////var/lib/twophase/log.db --token-file /etc/twophase/tokens
  twophase serve --store postgresql://twophase@db:5432/twophase --host 0.0.0.0 \
      --token-file /etc/twophase/tokens --ssl-certfile cert.pem --ssl-keyfile key.pem
  twophase serve --store sqlite:///dev.db --insecure          # no auth: local testing only

A token file (mode 0600) holds one line per token:
  operator <token>            force, abort, resolve, the console: everything
  data <token> orders pay*    a job: its sinks' begin, votes, acks, abandon, register
Make a token with: python -c 'import secrets; print(secrets.token_urlsafe(24))'

Several tokens per role; a data line must name its sinks (names or globs; '*' gives
every sink on purpose). The daemon re-reads the file when it changes (within a second),
so tokens and scopes change without a restart. $TWOPHASE_TOKEN is one operator token;
every token has at least 16 characters. Secrets (TWOPHASE_SECRET_*) go only to the
participants --secret-grants lists (docs/user/security.md).

Several daemons may share one PostgreSQL store (no leader: every change is a
compare-and-set). SQLite allows one daemon per file.
"""


class _OnCommandLine(argparse.Action):
    """Stores the value and notes that it came from the command line (where ``ps`` and
    the shell's history show it), not from the environment."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.token_on_command_line = True


def _port(text: str) -> int:
    """A TCP port, refused by argparse (exit 2, naming the value) when out of range."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: use 0-65535")
    return port


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
    p.add_argument("--store", default=os.environ.get("TWOPHASE_STORE"), metavar="URL",
                   help="sqlite:///path.db or postgresql://user@host:port/db, created if "
                   "missing (a new SQLite file is logged with its path) "
                   "(default: $TWOPHASE_STORE)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=7070, help="port (default 7070)")
    p.add_argument("--token", default=os.environ.get("TWOPHASE_TOKEN"), action=_OnCommandLine,
                   help="an operator bearer token, good for every call (default: "
                   "$TWOPHASE_TOKEN; on the command line it shows in `ps`: prefer "
                   "--token-file); jobs get scoped data tokens from --token-file")
    p.add_argument("--token-file", default=os.environ.get("TWOPHASE_TOKEN_FILE"),
                   metavar="PATH",
                   help="file of 'data <token> [SINK ...]' / 'operator <token>' lines (a data "
                   "line's sinks scope its token), re-read when it changes: rotate tokens "
                   "without a restart (default: $TWOPHASE_TOKEN_FILE)")
    p.add_argument("--insecure", action="store_true",
                   help="allow running without a token (anyone reaching the port can decide)")
    p.add_argument("--insecure-http", action="store_true",
                   help="serve plain HTTP on an address beyond loopback (only behind a "
                   "TLS-terminating proxy or inside a private network): without it, or "
                   "--ssl-certfile, a non-loopback --host is refused, since tokens and "
                   "decisions would cross the network in clear")
    p.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", help="private key of --ssl-certfile (PEM)")
    p.add_argument("--retention", default="3d",
                   help="keep finished transactions this long (e.g. 12h, 3d; default 3d)")
    p.add_argument("--alert-after", default="10m",
                   help="flag decided transactions not fully acknowledged after this long "
                   "(default 10m)")
    p.add_argument("--target-watch", default="30s", metavar="DURATION",
                   help="every DURATION, ask each sink's targets what they hold open (Kafka "
                   "transactions a crash left open, records past the last stable offset), "
                   "with participants rebuilt from the sinks' descriptors and secrets from "
                   "this environment, for /metrics and the console; 0 = off (default 30s)")
    p.add_argument("--secret-grants", default=os.environ.get("TWOPHASE_SECRET_GRANTS_FILE"),
                   metavar="PATH",
                   help="file of 'SINK PARTICIPANT FINGERPRINT' lines: the recorded "
                   "participants this daemon may hand its TWOPHASE_SECRET_* secrets to "
                   "(`twophase sinks SINK --grants` prints them); any other descriptor, "
                   "e.g. one a job's data token stored, gets none. Re-read at each use "
                   "(default: $TWOPHASE_SECRET_GRANTS_FILE)")
    p.add_argument("--store-wait", default=os.environ.get("TWOPHASE_STORE_WAIT", "120s"),
                   metavar="DURATION",
                   help="at start, wait this long for an unreachable store (e.g. a database "
                   "container still starting), retrying with a log line; 0 = fail at once "
                   "(default: $TWOPHASE_STORE_WAIT, else 120s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the daemon's log level (default info)")
    p.add_argument("--access-log", action="store_true", help="log every request (slower)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from twophase.coordinator.app import create_app
    from twophase.coordinator.background import Settings, parse_duration
    from twophase.coordinator.db import lock_sqlite
    from twophase.coordinator.logs import setup_logging
    from twophase.coordinator.roles import TokenSet, check_strength

    if not (_loopback(args.host) or args.ssl_certfile or args.insecure_http
            or args.insecure):
        print(f"twophase serve: --host {args.host} is reachable beyond this machine and "
              "the daemon would serve plain HTTP, sending every bearer token in clear: "
              "pass --ssl-certfile and --ssl-keyfile (clients then pin the CA with "
              "ca_file= / ca_pem=), or --insecure-http if a TLS proxy or a private network "
              "protects the port", file=sys.stderr)
        return 2
    on_command_line = getattr(args, "token_on_command_line", False)
    if not args.store:
        print("twophase serve: no store: pass --store URL or set TWOPHASE_STORE "
              "(e.g. sqlite:////var/lib/twophase/log.db)", file=sys.stderr)
        return 2
    if not args.token and not args.token_file and not args.insecure:
        print("twophase serve: no token: pass --token or set TWOPHASE_TOKEN (one operator "
              "token), or --token-file PATH / TWOPHASE_TOKEN_FILE (data and operator tokens, "
              "rotatable); --insecure to run without authentication", file=sys.stderr)
        return 2
    try:
        if args.token:
            check_strength(args.token, "the operator token of "
                           + ("--token" if on_command_line else "$TWOPHASE_TOKEN"))
        tokens = TokenSet(args.token, args.token_file)
    except InvalidRequest as exc:
        print(f"twophase serve: {exc}", file=sys.stderr)
        return 2
    if on_command_line:
        print("WARNING: --token on the command line is visible to every local user "
              "(`ps`, /proc, shell history): put it in a token file ('operator <token>', "
              "--token-file) or $TWOPHASE_TOKEN", file=sys.stderr)
    if not tokens.enabled:
        print("WARNING: running WITHOUT authentication (--insecure): anyone who can reach "
              f"{args.host}:{args.port} can change transactions", file=sys.stderr)
    setup_logging(args.log_level)
    if tokens.enabled:
        import logging

        counts = tokens.roles()
        logging.getLogger("twophase.serve").log(
            logging.INFO if counts["operator"] else logging.WARNING,
            "bearer tokens" if counts["operator"] else "bearer tokens: no operator token, "
            "so force, abort, resolve and the console are refused until the token file "
            "gets an 'operator <token>' line", extra={"roles": counts, "file": args.token_file})
    try:
        settings = Settings(retention=parse_duration(args.retention),
                            alert_after=parse_duration(args.alert_after),
                            target_watch=parse_duration(args.target_watch),
                            secret_grants=args.secret_grants)
        wait = parse_duration(args.store_wait)
        new = _new_sqlite(args.store)
        lock = lock_sqlite(args.store)  # noqa: F841 - held until this process exits
        store = _open_store(args.store, wait)
    except _StoreDown as exc:
        print(f"twophase serve: {exc}", file=sys.stderr)
        return 1
    except (ValueError, StoreError) as exc:
        print(f"twophase serve: {exc}", file=sys.stderr)
        return 2
    if new is not None:
        import logging

        logging.getLogger("twophase.serve").warning(
            "created a NEW, EMPTY store: if the jobs' decisions are in an existing one, "
            "stop this daemon and fix --store (a new store knows no in-doubt batch)",
            extra={"path": str(new)})
    app = create_app(store, None, insecure=args.insecure, settings=settings, tokens=tokens)
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level,
        access_log=args.access_log, ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile, timeout_keep_alive=75,
    )
    return 0


def _loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or name (reachable from this machine only)."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _new_sqlite(url: str) -> Path | None:
    """The SQLite file this daemon is about to create (None: it exists, or not SQLite)."""
    from twophase.coordinator.db import normalize_url, sqlite_path

    path = sqlite_path(normalize_url(url))
    return path.absolute() if path is not None and not path.exists() else None


class _StoreDown(StoreError):
    """The store did not answer within --store-wait (exit 1, not a usage error)."""


def _open_store(url: str, wait: float) -> Store:
    """The store, once it answers: a database that is not up yet (connection refused,
    starting up, DNS of a container not there yet) is retried with a log line each time
    for up to ``wait`` seconds; a wrong URL, a schema mismatch or bad credentials are
    not retried (they will not heal)."""
    import logging
    import time

    from sqlalchemy.exc import OperationalError

    from twophase.coordinator.store import Store

    log = logging.getLogger("twophase.serve")
    deadline = time.monotonic() + wait
    delay = 0.5
    while True:
        try:
            return Store(url)
        except OperationalError as exc:
            why = str(exc.orig if exc.orig is not None else exc).strip().splitlines()[0]
            if "password authentication failed" in why or "does not exist" in why:
                raise _StoreDown(f"store refused the connection: {why}; check --store") \
                    from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise _StoreDown(
                    f"store not reachable after waiting {wait:g}s: {why}; start the "
                    "database or check --store (and --store-wait to wait longer)"
                ) from None
            log.warning("store not reachable yet, retrying",
                        extra={"error": why, "retry_in": round(min(delay, left), 1),
                               "gives_up_in": round(left, 1)})
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)
