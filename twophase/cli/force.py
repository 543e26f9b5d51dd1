"""twophase force: settle one stuck transaction by hand, with a reason.

ack: the operator states that the transaction's unacknowledged branches are settled
(committed or aborted by hand, per the decision), so the coordinator can finish it.
abort: write ABORT for an undecided transaction whose writer is gone (a decided one
keeps its decision). Both go through the daemon's admin API and are kept, with the
reason, in the transaction's history. twophase resolve is the safer first choice:
it asks each participant's own system before acknowledging anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from twophase.cli.common import add_coordinator_flags, require_store

EPILOG = """\
examples:
  twophase force orders/3f2c.../17/1 ack --reason "pg branch committed by hand" \\
      --coordinator http://host:7070
  twophase force orders/3f2c.../17/2 abort --reason "writer gone" --yes --json

TXN is sink/lineage/batch/attempt, as `twophase txns` and the console show it
(attempt may be written attempt-2). Asks for confirmation unless --yes; without a
terminal and without --yes nothing is done (exit code 2).
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "force",
        help="force-acknowledge or abort one transaction by hand (with a reason)",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("txn", metavar="TXN", help="sink/lineage/batch/attempt")
    p.add_argument("action", choices=["ack", "abort"],
                   help="ack: branches are settled by hand; abort: write ABORT (undecided)")
    p.add_argument("--reason", required=True, help="why (kept in the history)")
    p.add_argument("--branch", action="append", default=None, metavar="PARTICIPANT/N",
                   help="ack only this branch (repeatable; default: every unacknowledged)")
    add_coordinator_flags(p)
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--json", action="store_true", help="JSON result")
    p.set_defaults(run=run)


def parse_txn(text: str) -> Any:
    """``sink/lineage/batch/attempt`` (attempt may read ``attempt-N``) as a TxnKey."""
    from twophase.errors import InvalidRequest
    from twophase.names import validate_lineage, validate_name
    from twophase.protocol import TxnKey

    parts = text.split("/")
    if len(parts) != 4:
        raise InvalidRequest(f"TXN {text!r} is not sink/lineage/batch/attempt "
                             "(as `twophase txns --json` shows it)")
    sink, lineage, batch, attempt = parts
    attempt = attempt.removeprefix("attempt-")
    if not batch.isdigit() or not attempt.isdigit() or int(attempt) < 1:
        raise InvalidRequest(f"TXN {text!r}: batch and attempt must be numbers (attempt >= 1)")
    validate_name("sink name", sink)
    validate_lineage(lineage)
    return TxnKey(sink, lineage, int(batch), int(attempt))


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        return False
    answer = input(f"{question} [type yes] ")
    return answer.strip().lower() == "yes"


def run(args: argparse.Namespace) -> int:
    from twophase.client import wire
    from twophase.client.connection import connect
    from twophase.errors import TwophaseError

    def fail(msg: str, rc: int = 1) -> int:
        if args.json:
            print(json.dumps({"ok": False, "error": msg}))
        print(f"twophase force: {msg}", file=sys.stderr)
        return rc

    if not args.coordinator:
        return fail("pass --coordinator URL (or set TWOPHASE_COORDINATOR)", 2)
    if not args.reason.strip():
        return fail("--reason must say why", 2)
    try:
        key = parse_txn(args.txn)
    except ValueError as exc:
        return fail(str(exc), 2)
    try:
        if not args.coordinator.startswith(("http://", "https://")):
            require_store(args.coordinator, "force")
        with connect(args.coordinator, args.token, token_file=args.token_file,
                     create=False) as conn:
            client = conn.client(operator=True)
            txn = client.get(key)
            if args.action == "ack":
                if txn.decision is None:
                    return fail(f"{args.txn} is undecided ({txn.state.value}): nothing to "
                                "acknowledge; `abort` it first (or run twophase resolve)")
                pending = [b for b, st in sorted(txn.branches.items()) if st.ack is None]
                branches = args.branch or pending
                unknown = [b for b in branches if b not in txn.branches]
                if unknown:
                    return fail(f"{args.txn} has no branch {unknown[0]!r}; its branches: "
                                f"{', '.join(sorted(txn.branches))}", 2)
                what = (f"force-ack {txn.decision.value} for {len(branches)} branch(es) of "
                        f"{args.txn} ({', '.join(branches) or 'none'}): only if you settled "
                        "them in their systems yourself")
            else:
                branches = []
                if txn.decision is not None:
                    return fail(f"{args.txn} is already decided {txn.decision.value} "
                                f"({txn.state.value}): a decision is never changed; use "
                                "`ack` once its branches are settled")
                what = f"write ABORT for {args.txn} ({txn.state.value})"
            if not args.yes and not _confirm(f"twophase force: {what}?"):
                return fail(f"not confirmed: {what}; pass --yes to do it without asking", 2)
            if args.action == "ack":
                assert txn.decision is not None
                for b in branches:
                    txn = client.force_ack(key, b, txn.decision, args.reason)
            else:
                txn = client.admin_abort(key, args.reason)
    except (TwophaseError, ValueError) as exc:
        return fail(str(exc))
    if args.json:
        print(json.dumps({"ok": True, "action": args.action, "branches": branches,
                          "txn": wire.encode_txn(txn)}, indent=2))
    else:
        print(f"done: {what}; now {txn.state.value}")
    return 0
