"""twophase sinks: per sink, the last committed batch, in-doubt count and age, alerts."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from twophase.cli.common import add_coordinator_flags, require_store

EPILOG = """\
examples:
  twophase sinks --coordinator http://host:7070
  twophase sinks --coordinator sqlite:///tp.db --json
  twophase sinks --coordinator http://host:7070 --grants orders >> /etc/twophase/grants

health: ok; "in doubt" (decided, branches not all acknowledged yet); ALERT (in doubt
for longer than the coordinator's --alert-after). Exit code 0, or 1 when a sink is in
ALERT (for cron jobs and probes).

--grants SINK prints, for each participant the sink recorded, the line of the secret
grants file that lets the daemon and `twophase resolve` hand it its secrets, with a
comment saying where they would go: read it before adding it.
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "sinks",
        help="per sink: last committed batch, in-doubt count and age, alert state",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_coordinator_flags(p)
    p.add_argument("--json", action="store_true", help="JSON for scripts")
    p.add_argument("--grants", default=None, metavar="SINK",
                   help="print the secret grants lines for SINK's recorded participants")
    p.set_defaults(run=run)


def health(s: dict[str, Any]) -> str:
    if s["alerts"]:
        return "ALERT"
    return "in doubt" if s["in_doubt"] else "ok"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from twophase.cli.txns import _age
    from twophase.coordinator.listing import fetch_sinks
    from twophase.errors import TwophaseError

    if not args.coordinator:
        print("twophase sinks: pass --coordinator URL (or set TWOPHASE_COORDINATOR)",
              file=sys.stderr)
        return 2
    try:
        if not args.coordinator.startswith(("http://", "https://")):
            require_store(args.coordinator, "sinks")
        if args.grants:
            return _grants(args)
        sinks = fetch_sinks(args.coordinator, token=args.token,
                            token_file=args.token_file)
    except (TwophaseError, ValueError) as exc:
        print(f"twophase sinks: {exc}", file=sys.stderr)
        return 1
    for s in sinks:
        s["health"] = health(s)
    if args.json:
        print(json.dumps(sinks, indent=2))
    else:
        t = Table(title=f"{len(sinks)} sink(s)", header_style="bold")
        for col in ("sink", "health", "last committed", "epoch", "undecided", "in doubt",
                    "oldest in doubt", "alerts", "participants"):
            t.add_column(col)
        for s in sinks:
            style = {"ALERT": "bold red", "in doubt": "yellow"}.get(s["health"], "green")
            oldest = s["oldest_in_doubt_age"]
            t.add_row(
                s["name"], f"[{style}]{s['health']}[/]",
                "-" if s["last_committed"] is None else str(s["last_committed"]),
                str(s["epoch"]), str(s["undecided"]), str(s["in_doubt"]),
                "-" if oldest is None else _age(0.0, oldest), str(s["alerts"]),
                ", ".join(s["participants"]),
            )
        Console(file=sys.stdout, width=160).print(t)
    return 1 if any(s["alerts"] for s in sinks) else 0


def _grants(args: argparse.Namespace) -> int:
    from twophase.coordinator.listing import fetch_participants
    from twophase.grants import grant_line

    found = fetch_participants(args.coordinator, args.grants, token=args.token,
                               token_file=args.token_file)
    if not found:
        print(f"twophase sinks: sink {args.grants!r} recorded no participants",
              file=sys.stderr)
        return 1
    for d in found:
        print(grant_line(args.grants, d))
    return 0
