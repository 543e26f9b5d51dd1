"""The ``twophase`` command line.

One module per subcommand (``serve``, ``txns``, ``sinks``, ``force``, ``demo``,
``resolve``, ``chaos``), each with ``register(subparsers)``, and ``common`` for the flags
and store handling the operator commands share; a command imports what it needs only
when it runs, so ``twophase --help`` works without pyspark, psycopg or confluent-kafka
installed.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from twophase.cli import chaos, demo, force, resolve, serve, sinks, txns

DESCRIPTION = """\
twophase: exactly-once output for PySpark Structured Streaming.

foreachBatch is at-least-once: after a crash Spark runs the same micro-batch again.
twophase wraps the batch's writes to Kafka, PostgreSQL and files in one two-phase
commit per micro-batch, so every row lands exactly once in every system.
"""

EPILOG = """\
examples:
  twophase demo                                   run the demo job end to end
  twophase serve --store sqlite:///tp.db --port 7070 --token-file /etc/twophase/tokens
  twophase txns --coordinator http://host:7070 --sink orders --json
  twophase sinks --coordinator http://host:7070   sinks, in-doubt counts, alerts
  twophase resolve orders --coordinator http://host:7070 --dry-run
  open http://host:7070/ui                        the operators' console
"""


def version() -> str:
    """The installed distribution's version (what pip installed), else the source tree's
    (a checkout run without installing)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("twophase")
    except PackageNotFoundError:
        from twophase import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="twophase",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"twophase {version()}",
                        help="show the installed version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in (serve, txns, sinks, force, demo, resolve, chaos):
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    from twophase.extras import missing_extra

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc: int = args.run(args)
    except ImportError as exc:  # the light install: one line naming the extra
        hint = missing_extra(exc)
        if hint is None:
            raise
        print(f"twophase {args.command}: {hint}", file=sys.stderr)
        return 1
    return rc
