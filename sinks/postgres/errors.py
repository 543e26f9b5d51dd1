"""How the PostgreSQL participant reads the server's errors: which are transient (retry),
which are a permanent refusal (a :class:`TargetProblem` with its fix), and the message a
user sees (the server's words plus where: COPY line, column, constraint)."""

from __future__ import annotations

import re
import socket
from typing import Final

import psycopg
from psycopg import errors as pgerr

from twophase.errors import Failure, InvalidRequest, TargetProblem, classify

__all__ = ["describe_error", "identifier", "refused", "transient"]

_IDENT_RE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def identifier(kind: str, value: str) -> str:
    """Table, schema and marker-table names: a plain SQL identifier, nothing else."""
    if not isinstance(value, str) or not _IDENT_RE.match(value):
        raise InvalidRequest(
            f"invalid {kind} {value!r}: use a letter or _ then up to 62 of A-Z a-z 0-9 _"
        )
    return value


def transient(exc: BaseException) -> bool:
    """Connection-level failures, where nothing in the server changed because of us
    (an authentication or authorization refusal is permanent: twophase.errors.classify)."""
    if isinstance(exc, pgerr.OperationalError) and not isinstance(
        exc, (pgerr.QueryCanceled, pgerr.LockNotAvailable)
    ):
        state = exc.sqlstate
        if not (state is None or state.startswith("08") or state in ("57P01", "57P02",
                                                                      "57P03")):
            return False
        return not classify(exc).permanent
    return False


_FIXES: Final = {
    Failure.AUTHENTICATION: "check the user and password in dsn= (the role must exist and "
    "pg_hba.conf must let it log in from this host)",
    Failure.AUTHORIZATION: "grant the role what the sink needs: CONNECT on the database, "
    "USAGE and CREATE on the schema (or INSERT, SELECT, UPDATE, DELETE on existing tables)",
    Failure.MISSING: "create it, or fix dsn= / schema= / table=",
    Failure.CONFIGURATION: "fix the setting named above (dsn= or the server's configuration)",
}


def describe_error(exc: psycopg.Error) -> str:
    """The server's message plus where it happened (COPY line and column)."""
    parts = [str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__]
    diag = exc.diag
    if diag.column_name:
        parts.append(f"column {diag.column_name}")
    if diag.constraint_name:
        parts.append(f"constraint {diag.constraint_name}")
    if diag.context:
        parts.append(diag.context.strip().splitlines()[0])
    return "; ".join(parts)


def refused(who: str, exc: psycopg.Error, kind: Failure, what: str) -> TargetProblem:
    """A permanent refusal by the server as one sentence: cause, where, fix."""
    text = " ".join(str(exc).split())
    cause = text.split("FATAL:", 1)[1].strip() if "FATAL:" in text else describe_error(exc)
    return TargetProblem(who, f"cannot {what}: {kind.value}: {cause}",
                         _FIXES[kind], host=socket.gethostname(), kind=kind)
