"""What a librdkafka error means for a branch: retry an ambiguous commit, or report it.

Shared by the admin checks and the transactional branch, which both turn client errors
into messages naming the Kafka error code.
"""

from __future__ import annotations

from typing import Any, Final, Literal

__all__ = ["COORDINATOR_MOVES", "CommitAction", "classify_commit_error", "describe_error",
           "kafka_error"]

CommitAction = Literal["retry", "fatal"]

_AMBIGUOUS: Final = frozenset(
    {"_TIMED_OUT", "_TRANSPORT", "REQUEST_TIMED_OUT", "COORDINATOR_NOT_AVAILABLE",
     "NOT_COORDINATOR", "COORDINATOR_LOAD_IN_PROGRESS", "CONCURRENT_TRANSACTIONS",
     "_ALL_BROKERS_DOWN", "NETWORK_EXCEPTION", "_WAIT_COORD", "_IN_PROGRESS"}
)


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
