"""One root for every error twophase raises, and the HTTP mapping derived from it.

Each class states its stable ``code`` (the ``error`` field of an HTTP error body) and the
HTTP status the coordinator answers it with. The service answers any
:class:`TwophaseError` from these two attributes; the client turns an error body back
into the class its code names (:func:`error_class`), so a refusal has one name on both
sides of the API: a stale writer gets :class:`StaleEpoch` from the embedded state
machine and from a daemon alike.

Everything the coordinator can answer is a :class:`CoordinatorError`; what a participant,
the driver or the codec raises has its own branch of the tree.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "BatchFailed",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "EnvironmentProblem",
    "FailpointHit",
    "IllegalTransition",
    "InvalidRequest",
    "ParticipantError",
    "PrepareRefused",
    "ProtocolError",
    "SchemaMismatch",
    "StaleEpoch",
    "StoreError",
    "TransactionNotFound",
    "TwophaseError",
    "UnknownBranch",
    "WireError",
    "error_class",
]


class TwophaseError(Exception):
    """Root of every twophase error. ``code`` and ``http_status`` are per class; an
    instance built from an HTTP answer carries the status it was answered with."""

    code: ClassVar[str] = "error"
    http_status: ClassVar[int] = 500

    def __init__(
        self, message: str = "", *, status: int | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = self.http_status if status is None else status
        if code is not None and code != type(self).code:
            self.code = code  # type: ignore[misc]  # an answer whose code we do not model


# --------------------------------------------------------------------------- coordinator


class CoordinatorError(TwophaseError):
    """A refusal or failure reported by (or about) the coordinator."""

    code = "coordinator_error"
    http_status = 500


class ProtocolError(CoordinatorError):
    """The state machine refuses a message; a refused message changes nothing."""

    code = "protocol_error"
    http_status = 409


class IllegalTransition(ProtocolError):
    """The message is not allowed in the transaction's state (the transition table says
    which are)."""

    code = "illegal_transition"


class StaleEpoch(ProtocolError):
    """A message from a writer older than the sink's or transaction's (a zombie driver or
    task): a newer writer took over and this one must stop."""

    code = "stale_epoch"


class UnknownBranch(ProtocolError):
    code = "unknown_branch"


class TransactionNotFound(CoordinatorError):
    """No such transaction (or sink)."""

    code = "not_found"
    http_status = 404

    @classmethod
    def for_key(cls, key: tuple[str, str, int, int]) -> TransactionNotFound:
        """The error for a transaction key (its wire field names, as the API spells them)."""
        sink, lineage, batch_id, attempt = key
        return cls(
            f"no transaction sink={sink!r} lineage={lineage!r} checkpoint={batch_id} "
            f"attempt={attempt}"
        )


class StoreError(CoordinatorError):
    """The decision log cannot do what was asked (unreachable, conflicting, mismatched)."""

    code = "store_error"
    http_status = 503


class SchemaMismatch(StoreError):
    code = "schema_mismatch"


class CoordinatorUnavailable(CoordinatorError):
    """The coordinator could not be reached (or kept failing) within the retry budget."""

    code = "unavailable"
    http_status = 503


# --------------------------------------------------------------------------- the rest


class InvalidRequest(TwophaseError, ValueError):
    """A value that can never be accepted as given: a bad name, a number out of range.
    Raised where the value enters (sink, participant, HTTP request), never retried."""

    code = "invalid_request"
    http_status = 422



class EnvironmentProblem(TwophaseError, RuntimeError):
    """The executors cannot run the sink's tasks as set up (a module missing or at another
    version, the coordinator unreachable from them). Found by the preflight job before
    anything is written; the message names the host, the interpreter and the fix. Never
    retried: running again meets the same environment."""

    code = "environment_problem"


class WireError(TwophaseError, ValueError):
    """A JSON document does not have the expected layout."""

    code = "wire_error"
    http_status = 502


class ParticipantError(TwophaseError):
    """A participant failed; the message names the participant and the cause."""

    code = "participant_error"


class PrepareRefused(ParticipantError):
    """Prepare failed for a reason the data or the target explains: vote NO with it.

    Raised after the participant has undone whatever it had written for the branch.
    """

    code = "prepare_refused"


class BatchFailed(TwophaseError, RuntimeError):
    """A micro-batch could not be committed; the message names participant, partition
    and cause. The query stops; restarting it replays the batch."""

    code = "batch_failed"


class FailpointHit(TwophaseError, RuntimeError):
    """Raised by a failpoint whose action is ``raise``."""

    code = "failpoint"


def _codes() -> dict[str, type[TwophaseError]]:
    out: dict[str, type[TwophaseError]] = {}
    todo: list[type[TwophaseError]] = [TwophaseError]
    while todo:
        cls = todo.pop()
        out.setdefault(cls.code, cls)
        todo.extend(cls.__subclasses__())
    return out


def error_class(code: str) -> type[TwophaseError]:
    """The class an HTTP error body's ``code`` names (the generic
    :class:`CoordinatorError` for a code this version does not know)."""
    cls = _codes().get(code)
    return CoordinatorError if cls is None or cls is TwophaseError else cls
