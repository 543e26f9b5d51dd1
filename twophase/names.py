"""The name rules: which sink, participant and lineage names twophase accepts.

Names reach SQL identifiers, PostgreSQL gids, file names, object keys and Kafka group
ids, so one safe alphabet is checked where a name enters (the sink, a participant, an
HTTP request) and nowhere else needs to trust it. The HTTP service validates paths and
bodies with the same patterns.
"""

from __future__ import annotations

import re
from typing import Final

from twophase.errors import InvalidRequest

__all__ = [
    "BRANCH_PATTERN",
    "LINEAGE_PATTERN",
    "LINEAGE_RULE",
    "NAME_PATTERN",
    "NAME_RULE",
    "validate_lineage",
    "validate_name",
]

NAME_PATTERN: Final = (r"^(?:[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}|\.[A-Za-z0-9_-][A-Za-z0-9_.-]{0,62}"
                       r"|\.\.[A-Za-z0-9_.-]{1,62})$")
"""Sink and participant names: 1-64 characters from the safe alphabet, except ``.`` and
``..`` (a folder's self and parent in a path). Written without look-ahead, so the HTTP
layer's validators (Rust's regex engine) and Python's ``re`` read it the same: the one
definition behind the routes' path patterns, the request bodies, :func:`validate_name`
and the store."""

LINEAGE_PATTERN: Final = r"^[A-Za-z0-9-]{1,64}$"
"""A lineage (Spark's streaming query id, a UUID, or the sink's ``lineage=``). Narrower
than names: ``_``, ``.`` and ``:`` separate fields in gids and file names."""

NAME_RULE: Final = "1-64 characters from A-Z a-z 0-9 _ . -, not '.' or '..'"
""":data:`NAME_PATTERN` in words, for messages (one copy, so no message can drift)."""

LINEAGE_RULE: Final = "1-64 characters from A-Z a-z 0-9 -"
""":data:`LINEAGE_PATTERN` in words."""

BRANCH_PATTERN: Final = NAME_PATTERN[:-1] + r"/[0-9]{1,6}$"
"""A branch id: ``participant/partition`` (a name, then the partition's index)."""

_NAME_RE: Final = re.compile(NAME_PATTERN)
_LINEAGE_RE: Final = re.compile(LINEAGE_PATTERN)


def validate_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid sink or participant name, else raise
    :class:`~twophase.errors.InvalidRequest` naming ``kind`` and the rule."""
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise InvalidRequest(
            f"invalid {kind} {value!r}: use {NAME_RULE}"
        )
    return value


def validate_lineage(value: str) -> str:
    """Return ``value`` if it is a valid lineage, else raise ``InvalidRequest``."""
    if not isinstance(value, str) or not _LINEAGE_RE.match(value):
        raise InvalidRequest(
            f"invalid lineage {value!r}: use {LINEAGE_RULE}"
        )
    return value
