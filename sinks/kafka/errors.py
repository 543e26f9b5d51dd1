"""What a librdkafka error means for a branch: retry an ambiguous commit, or report it.

Shared by the admin checks and both prepares' transactions, which turn client errors into
messages naming the Kafka error code and end their transactions with :func:`commit_retrying`.
"""

from __future__ import annotations

import time
from typing import Any, Final, Literal

from twophase.errors import ParticipantError

__all__ = ["COORDINATOR_MOVES", "FENCED", "TRANSIENT", "CommitAction", "CommitNotDone",
           "classify_commit_error", "commit_retrying", "describe_error", "kafka_error"]

CommitAction = Literal["retry", "fatal"]

_AMBIGUOUS: Final = frozenset(
    {"_TIMED_OUT", "_TRANSPORT", "REQUEST_TIMED_OUT", "COORDINATOR_NOT_AVAILABLE",
     "NOT_COORDINATOR", "COORDINATOR_LOAD_IN_PROGRESS", "CONCURRENT_TRANSACTIONS",
     "_ALL_BROKERS_DOWN", "NETWORK_EXCEPTION", "_WAIT_COORD", "_IN_PROGRESS"}
)


FENCED: Final = frozenset({"_FENCED", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH"})
"""A newer producer of the same transactional.id took over: this one can do nothing more."""


TRANSIENT: Final = _AMBIGUOUS | {"LEADER_NOT_AVAILABLE", "NOT_LEADER_OR_FOLLOWER",
                                  "NOT_CONTROLLER"}
"""Errors a broker restart or a leader election gives for a while: a read asked again
shortly gets its answer."""


COORDINATOR_MOVES: Final = frozenset(
    {"NOT_COORDINATOR", "COORDINATOR_LOAD_IN_PROGRESS", "COORDINATOR_NOT_AVAILABLE"})
"""A coordinator is loading or elsewhere: asked again, it answers (a fresh or restarted
broker loads its internal topics; a failover moves them)."""


def classify_commit_error(err: Any) -> CommitAction:
    """What a ``commit_transaction`` failure means for a branch under a COMMIT decision.

    Retriable and ambiguous errors (timeouts, coordinator moves) are retried: the commit may
    already have happened and calling again is how librdkafka resumes it. An error that
    requires an abort, or a fatal one (fenced), is reported: the decision is COMMIT, so the
    branch is never aborted here; it is redone instead.
    """
    if err.fatal() or err.txn_requires_abort():
        return "fatal"
    if err.retriable() or err.name() in _AMBIGUOUS:
        return "retry"
    return "fatal"


def kafka_error(exc: BaseException) -> Any | None:
    """The ``KafkaError`` a ``KafkaException`` carries, or None."""
    from confluent_kafka import KafkaError, KafkaException

    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


def describe_error(exc: BaseException) -> str:
    err = kafka_error(exc)
    if err is not None:
        return f"{err.name()}: {err.str()}"
    return f"{type(exc).__name__}: {exc}"


class CommitNotDone(ParticipantError):
    """:func:`commit_retrying` gave up after ``attempts``: ``in_doubt`` when the last error
    was ambiguous (the commit may yet complete; calling again resumes it), else it failed
    (fatal, fenced, abort-required, or not a Kafka error). The error is the ``__cause__``."""

    def __init__(self, cause: str, attempts: int, in_doubt: bool) -> None:
        super().__init__(cause)
        self.cause = cause
        self.attempts = attempts
        self.in_doubt = in_doubt


def commit_retrying(producer: Any, timeout_s: float, retry_s: float) -> int:
    """``producer.commit_transaction``, errors that :func:`classify_commit_error` calls
    ambiguous retried (with a growing pause) until ``retry_s``: calling again is how
    librdkafka resumes a commit that may have happened. The attempts it took; raises
    :class:`CommitNotDone`. The staged copy ends its transactions here
    (:mod:`.staged`)."""
    deadline = time.monotonic() + retry_s
    attempts = 0
    while True:
        attempts += 1
        try:
            producer.commit_transaction(timeout_s)
            return attempts
        except Exception as exc:
            err = kafka_error(exc)
            in_doubt = err is not None and classify_commit_error(err) == "retry"
            if in_doubt and time.monotonic() < deadline:
                time.sleep(min(0.1 * attempts, 2.0))
                continue
            raise CommitNotDone(describe_error(exc), attempts, in_doubt) from exc
