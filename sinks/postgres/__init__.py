"""PostgreSQL participant (see :mod:`.participant` for how a branch maps onto a server).

Modules, one concern each:

- ``gid``: names of prepared transactions, built from and parsed back to branches;
- ``arrow``: Arrow <-> PostgreSQL column types, table fit, and the COPY payload;
- ``participant``: the branch (COPY + marker row + ``PREPARE TRANSACTION``).
"""

from twophase.sinks.postgres.gid import GID_MAX_BYTES, gid_for, gid_prefix, parse_gid
from twophase.sinks.postgres.participant import PostgresParticipant

__all__ = ["GID_MAX_BYTES", "PostgresParticipant", "gid_for", "gid_prefix", "parse_gid"]
