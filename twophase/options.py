"""The bounds of ``TransactionalSink``'s options, checked when the sink is built (the
coordinator's request models refuse the same, later: coordinator/models.py)."""

from __future__ import annotations

from collections.abc import Sequence

from twophase.errors import InvalidRequest

__all__ = ["MAX_PARTICIPANTS", "MAX_PARTITIONS", "MAX_VOTE_TIMEOUT", "bounded_float",
           "bounded_int", "check_sink_options"]

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


def check_sink_options(
    name: str, participants: Sequence[str], *, partitions: int | None, max_attempts: int,
    backoff: float, vote_timeout: float, retry_budget_s: float,
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
