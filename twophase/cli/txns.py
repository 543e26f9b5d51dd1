"""``twophase txns``: transactions as a readable table (rich) or as JSON for scripts.

Reads either a store directly (``sqlite:///...``, ``postgresql://...``; read-only use) or
a daemon over HTTP (``http(s)://...``, token from ``--token`` or ``TWOPHASE_TOKEN``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

from rich.console import Console
from rich.table import Table

from twophase.cli.common import add_coordinator_flags, require_store

_STYLE = {
    "OPEN": "cyan", "PREPARING": "cyan", "COMMITTING": "yellow", "COMMITTED": "green",
    "ABORTING": "magenta", "ABORTED": "red",
}


def _age(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    secs = max(0.0, now - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs / size:.1f}{unit}"
    return f"{secs:.1f}s"


def table(txns: Sequence[dict[str, Any]], now: float | None = None) -> Table:
    now = time.time() if now is None else now
    t = Table(title=f"{len(txns)} transaction(s), newest first", header_style="bold")
    for col in ("sink", "lineage", "ckpt", "att", "epoch", "state", "votes", "acks", "age",
                "decided", "reason"):
        t.add_column(col, justify="right" if col in ("ckpt", "att", "epoch") else "left")
    for x in txns:
        branches = x["branches"].values()
        yes = sum(1 for b in branches if b["vote"] == "COMMIT")
        no = sum(1 for b in branches if b["vote"] == "ABORT")
        acked = sum(1 for b in branches if b["ack"] is not None)
        n = len(x["branches"])
        state = x["state"]
        label = f"[{_STYLE.get(state, 'white')}]{state}[/]"
        if x.get("alert"):
            label += " [bold red]ALERT[/]"
        t.add_row(
            x["sink"], x["lineage"], str(x["checkpoint"]), str(x["attempt"]), str(x["epoch"]),
            label, f"{yes}+{no}/{n}" if no else f"{yes}/{n}", f"{acked}/{n}",
            _age(x["created"], now), _age(x["decided_at"], now), x.get("reason") or "",
        )
    return t


def render(txns: Sequence[dict[str, Any]], *, as_json: bool, out: IO[str]) -> None:
    if as_json:
        json.dump(list(txns), out, indent=2)
        out.write("\n")
        return
    Console(file=out, width=160).print(table(txns))


EPILOG = """\
examples:
  twophase txns --coordinator sqlite:///tp.db
  twophase txns --coordinator http://host:7070 --sink orders --state COMMITTING
  twophase txns --coordinator http://host:7070 --state ALERT --json | jq '.[].branches'

states: OPEN PREPARING COMMITTING COMMITTED ABORTING ABORTED, or ALERT (decided, branches
still not acknowledged after --alert-after).
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "txns",
        help="list transactions and their branches (table, or --json)",
        description="List transactions, newest first, from a store URL or a daemon URL.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_coordinator_flags(p)
    p.add_argument("--sink", help="only this sink")
    p.add_argument("--state", help="only this state (or ALERT)")
    p.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    p.add_argument("--json", action="store_true", help="JSON for scripts")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from twophase.coordinator.listing import fetch
    from twophase.errors import TwophaseError

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
        if not args.coordinator.startswith(("http://", "https://")):
            require_store(args.coordinator, "txns")
        txns = fetch(args.coordinator, sink=args.sink, state=args.state, limit=args.limit,
                     token=args.token, token_file=args.token_file)
    except (TwophaseError, ValueError) as exc:
        print(f"twophase txns: {exc}", file=sys.stderr)
        return 1
    render(txns, as_json=args.json, out=sys.stdout)
    return 0
