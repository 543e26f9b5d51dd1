"""The bounds of ``TransactionalSink``'s options, checked when the sink is built (the
coordinator's request models refuse the same, later: coordinator/models.py)."""

from __future__ import annotations

from twophase.errors import InvalidRequest

__all__ = ["MAX_PARTICIPANTS", "MAX_PARTITIONS", "MAX_VOTE_TIMEOUT", "bounded_float",
           "bounded_int"]

# The coordinator's bounds (coordinator/models.py refuses more): checked here so that a
# bad argument fails when the sink is built, not at the first batch.
MAX_PARTICIPANTS = 64
MAX_PARTITIONS = 100_000
MAX_VOTE_TIMEOUT = 7 * 86400.0


def bounded_int(what: str, value: object, lo: int, hi: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise InvalidRequest(f"{what} must be an int from {lo} to {hi}, got {value!r}")


def bounded_float(what: str, value: object, lo: float, hi: float, meaning: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not lo <= float(value) <= hi:  # type: ignore[arg-type]  # NaN fails too
        raise InvalidRequest(
            f"{what} must be a number of {meaning} from {lo:g} to {hi:g}, got {value!r}"
        )
