"""The bounds of ``TransactionalSink``'s options, checked when the sink is built (the
coordinator's request models refuse the same, later: coordinator/models.py)."""

from __future__ import annotations

from collections.abc import Sequence

from twophase.errors import InvalidRequest

__all__ = ["MARKER_KEEP_BATCHES", "MAX_PARTICIPANTS", "MAX_PARTITIONS", "MAX_VOTE_TIMEOUT",
           "MIN_MARKER_KEEP_BATCHES", "VOTE_TIMEOUT", "bounded_float", "bounded_int",
           "check_marker_window", "check_sink_options"]

# The coordinator's bounds (coordinator/models.py refuses more): checked here so that a
# bad argument fails when the sink is built, not at the first batch.
MAX_PARTICIPANTS = 64
MAX_PARTITIONS = 100_000
MAX_VOTE_TIMEOUT = 7 * 86400.0

VOTE_TIMEOUT = 300.0
"""``vote_timeout``'s default, both doors: seconds before an undecided attempt is aborted."""

MARKER_KEEP_BATCHES = 1000
"""``marker_keep_batches``' default: ten times Spark's ``minBatchesToRetain`` default."""
MIN_MARKER_KEEP_BATCHES = 100
"""Spark's ``spark.sql.streaming.minBatchesToRetain`` default: the fewest batches a
checkpoint can replay, so the smallest window that covers a replay of a default query."""


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


def check_marker_window(keep: object) -> None:
    """``marker_keep_batches``: how many batches behind the newest committed one keep
    their participants' idempotency markers (older ones are pruned in the background).

    Why markers below the window are never asked for again: a marker answers "did this
    branch commit?" for a batch that is being run again. The coordinator answers a replay
    of a committed batch itself, also once retention removed its record (any batch at or
    below the lineage's last committed one), so the markers matter only when that record
    is gone too (a lineage switched back, a store lost). Spark replays only batches its
    checkpoint still retains: ``spark.sql.streaming.minBatchesToRetain`` (default 100)
    offset and commit log entries. A window at least that long therefore covers every
    batch a checkpoint can replay; the default keeps ten times as many for queries that
    raise the setting."""
    if (not isinstance(keep, int) or isinstance(keep, bool)
            or not MIN_MARKER_KEEP_BATCHES <= keep <= 2**62):
        raise InvalidRequest(
            f"marker_keep_batches must be an int of at least {MIN_MARKER_KEEP_BATCHES} "
            f"(batches whose participant markers are kept), got {keep!r}: pass at least "
            "the query's spark.sql.streaming.minBatchesToRetain (default 100), or leave "
            f"the default {MARKER_KEEP_BATCHES}"
        )


def check_sink_options(
    name: str, participants: Sequence[str], *, partitions: int | None, max_attempts: int,
    backoff: float, vote_timeout: float, retry_budget_s: float,
    marker_keep_batches: int = MARKER_KEEP_BATCHES,
) -> None:
    """``TransactionalSink``'s arguments, refused when the sink is built (``participants``:
    their names), each refusal naming the bound and the fix."""
    if not participants:
        raise InvalidRequest("a TransactionalSink needs at least one participant")
    names = list(participants)
    if len(set(names)) != len(names):
        raise InvalidRequest(
            f"participant names must be unique within sink {name!r}, got {names}; "
            "pass name=... to tell two participants of the same kind apart"
        )
    if len(names) > MAX_PARTICIPANTS:
        raise InvalidRequest(
            f"a TransactionalSink takes at most {MAX_PARTICIPANTS} participants, got "
            f"{len(names)}: split the output over several sinks"
        )
    bounded_int("partitions", partitions, 1, MAX_PARTITIONS, optional=True)
    bounded_int("max_attempts", max_attempts, 1, 1000)
    bounded_float("backoff", backoff, 0.0, 3600.0, "seconds between attempts")
    bounded_float("vote_timeout", vote_timeout, 0.001, MAX_VOTE_TIMEOUT,
                  "seconds the coordinator waits for every vote")
    if not retry_budget_s > 0:
        raise InvalidRequest(f"retry_budget_s must be > 0 seconds, got {retry_budget_s}")
    check_marker_window(marker_keep_batches)
