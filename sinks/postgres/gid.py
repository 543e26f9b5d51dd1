"""Names of prepared transactions (gids): one per branch attempt, parsed back by recovery.

The gid is built only from validated :class:`~twophase.participant.BranchRef` parts::

    tp:{sink}:{lineage}:{checkpoint}:{attempt}:{participant}:{partition}

so ``pg_prepared_xacts`` alone tells recovery (and the verifier) which branch a leftover
belongs to. The server limit is 199 bytes (:func:`gid_for` refuses more); a gid reaches
SQL only as a :class:`psycopg.sql.Literal`.
"""

from __future__ import annotations

import re
from typing import Final

from twophase.errors import InvalidRequest
from twophase.names import validate_name
from twophase.participant import BranchRef

__all__ = ["GID_MAX_BYTES", "GID_ROOT", "gid_for", "gid_prefix", "parse_gid"]

GID_MAX_BYTES: Final = 199
"""PostgreSQL's GIDSIZE is 200 bytes including the terminating NUL."""

GID_ROOT: Final = "tp:"
"""Every twophase gid starts with this; other gids in the server are not ours."""

_GID_RE: Final = re.compile(
    r"^tp:(?P<sink>[A-Za-z0-9_.-]+):(?P<lineage>[A-Za-z0-9-]+):(?P<checkpoint>\d+):"
    r"(?P<attempt>\d+):(?P<participant>[A-Za-z0-9_.-]+):(?P<partition>\d+)$"
)


def gid_prefix(sink: str) -> str:
    return f"{GID_ROOT}{validate_name('sink name', sink)}:"


def gid_for(branch: BranchRef) -> str:
    """The prepared transaction's name; ``ValueError`` if it would not fit the server."""
    gid = (
        f"{gid_prefix(branch.sink)}{branch.lineage}:{branch.batch_id}:{branch.attempt}:"
        f"{branch.participant}:{branch.partition}"
    )
    if len(gid.encode()) > GID_MAX_BYTES:
        raise InvalidRequest(
            f"transaction name {gid!r} is {len(gid.encode())} bytes; PostgreSQL allows at "
            f"most {GID_MAX_BYTES}: shorten the sink, lineage or participant name"
        )
    return gid


def parse_gid(gid: str) -> BranchRef | None:
    """The branch a gid names, or None for a gid that is not ours."""
    m = _GID_RE.match(gid)
    if not m:
        return None
    try:
        return BranchRef(
            sink=m["sink"],
            lineage=m["lineage"],
            batch_id=int(m["checkpoint"]),
            attempt=int(m["attempt"]),
            participant=m["participant"],
            partition=int(m["partition"]),
        )
    except ValueError:
        return None
