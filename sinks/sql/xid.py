"""Transaction ids (xids) of SQL branches: deterministic, validated, and short enough.

A branch's xid is readable when it fits the server's limit::

    tp:{sink}:{lineage}:{checkpoint}:{attempt}:{participant}:{partition}

(the PostgreSQL participant's gid format, so one parser reads both). MySQL and MariaDB
allow 64 bytes of gtrid, which a UUID lineage alone nearly fills; a longer xid becomes
``tph:`` plus 56 hex digits of its SHA-256, and the branch it names is recorded (outside
the XA transaction, before it starts) in the xid table next to the marker table, so
``XA RECOVER`` plus that table still tell recovery which branch a leftover is. Every part
comes from a validated :class:`~twophase.participant.BranchRef`; the alphabet has no quote.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

from twophase.names import validate_name
from twophase.participant import BranchRef

__all__ = ["HASHED_ROOT", "ROOT", "is_ours", "parse_readable", "readable_xid", "xid_for"]

ROOT: Final = "tp:"
HASHED_ROOT: Final = "tph:"

_XID_RE: Final = re.compile(
    r"^tp:(?P<sink>[A-Za-z0-9_.-]+):(?P<lineage>[A-Za-z0-9-]+):(?P<checkpoint>\d+):"
    r"(?P<attempt>\d+):(?P<participant>[A-Za-z0-9_.-]+):(?P<partition>\d+)$"
)


def readable_xid(branch: BranchRef) -> str:
    validate_name("sink name", branch.sink)
    return (f"{ROOT}{branch.sink}:{branch.lineage}:{branch.batch_id}:{branch.attempt}:"
            f"{branch.participant}:{branch.partition}")


def xid_for(branch: BranchRef, limit: int) -> tuple[str, bool]:
    """The branch's xid within ``limit`` bytes, and whether it is the hashed form."""
    readable = readable_xid(branch)
    if len(readable.encode()) <= limit:
        return readable, False
    return HASHED_ROOT + hashlib.sha256(readable.encode()).hexdigest()[:56], True


def is_ours(xid: str) -> bool:
    return xid.startswith((ROOT, HASHED_ROOT))


def parse_readable(xid: str) -> BranchRef | None:
    """The branch a readable xid names, or None (hashed, or not ours)."""
    m = _XID_RE.match(xid)
    if not m:
        return None
    try:
        return BranchRef(sink=m["sink"], lineage=m["lineage"], batch_id=int(m["checkpoint"]),
                         attempt=int(m["attempt"]), participant=m["participant"],
                         partition=int(m["partition"]))
    except ValueError:
        return None
