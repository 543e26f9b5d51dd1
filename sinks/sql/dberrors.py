"""What a database error means for a branch: MySQL's number or PostgreSQL's SQLSTATE read
from a DBAPI error, whether the connection (not the statement) failed, and a one-line
message naming the server's own words."""

from __future__ import annotations

from typing import Any, Final

import sqlalchemy as sa

__all__ = ["DUPLICATE", "MISSING_TABLE", "UNKNOWN_XID", "code", "message", "transient"]

UNKNOWN_XID: Final = {1397, "42704"}
""""This transaction id is not prepared here": MySQL ER_XAER_NOTA, PostgreSQL undefined_object."""
_CONNECTION_CODES: Final = {2002, 2003, 2006, 2013, 2055, 1053, 1927}
"""The connection (not the statement) failed: MySQL client errors (PostgreSQL: class 08)."""
DUPLICATE: Final = {1062, "23505"}
MISSING_TABLE: Final = (1146, "42P01")


def code(exc: BaseException) -> int | str | None:
    """The server's error: MySQL's number or PostgreSQL's SQLSTATE."""
    orig = getattr(exc, "orig", exc)
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int):
        return int(args[0])
    state = getattr(orig, "sqlstate", None)
    return state if isinstance(state, str) else None


def transient(exc: BaseException) -> bool:
    """The connection failed (worth another connection), not the statement."""
    if not isinstance(exc, sa.exc.DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    found = code(exc)
    return found in _CONNECTION_CODES or (isinstance(found, str) and found.startswith("08"))


def message(exc: BaseException) -> str:
    orig = getattr(exc, "orig", exc)
    args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
    if len(args) >= 2 and isinstance(args[0], int):
        return f"({args[0]}) {args[1]}"
    text = str(orig).strip()
    return text.splitlines()[0] if text else type(orig).__name__
