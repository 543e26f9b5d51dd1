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

import enum
import errno
import re
from typing import Any, ClassVar

__all__ = [
    "BatchFailed",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "EnvironmentProblem",
    "FailpointHit",
    "Failure",
    "IllegalTransition",
    "InvalidRequest",
    "ParticipantError",
    "PrepareRefused",
    "ProtocolError",
    "RedoMismatch",
    "SchemaMismatch",
    "StaleEpoch",
    "StoreError",
    "TargetProblem",
    "TransactionNotFound",
    "TwophaseError",
    "UnknownBranch",
    "WireError",
    "classify",
    "error_class",
    "headline",
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


class RedoMismatch(ParticipantError):
    """A lost branch cannot be redone: the replayed rows differ from the ones voted on
    (their content digests differ). Nothing was written; the message names the branch
    and the operator's two ways to settle it."""

    code = "redo_mismatch"


class PrepareRefused(ParticipantError):
    """Prepare failed for a reason the data or the target explains: vote NO with it.

    Raised after the participant has undone whatever it had written for the branch.
    """

    code = "prepare_refused"


class TargetProblem(ParticipantError):
    """A participant's target refuses the sink for a reason running again cannot heal
    (credentials, permissions, a missing object, a bad setting), found by its
    :meth:`~twophase.participant.Participant.probe` or :meth:`check` before anything is
    written, or by a write. Never retried. The message is one sentence: the participant,
    the cause (with the host and the target when known), then ``Fix:`` and the fix."""

    code = "target_problem"

    def __init__(
        self, participant: str = "", cause: str = "", fix: str = "", *, host: str = "",
        target: str = "", kind: Failure | None = None, status: int | None = None,
        code: str | None = None,
    ) -> None:
        if not cause:  # rebuilt from an HTTP answer or a pickle: the message only
            super().__init__(participant, status=status, code=code)
            self.participant, self.cause, self.fix, self.host, self.target = (
                "", participant, "", "", "")
            self.kind = kind
            return
        where = ", ".join(x for x in (f"target {target}" if target else "",
                                      f"on host {host}" if host else "") if x)
        text = f"{participant}: {cause.rstrip('.')}" + (f" ({where})" if where else "")
        super().__init__(f"{text}. Fix: {fix.rstrip('.')}." if fix else f"{text}.",
                         status=status, code=code)
        self.participant, self.cause, self.fix = participant, cause, fix
        self.host, self.target, self.kind = host, target, kind

    def __reduce__(self) -> Any:  # across processes (Spark, the preflight job) as a message
        return (type(self), (self.message,))

    def on_host(self, host: str) -> TargetProblem:
        """The same problem, saying where it was found (an executor's host)."""
        if not self.cause or self.host:
            return self
        return TargetProblem(self.participant, self.cause, self.fix, host=host,
                             target=self.target, kind=self.kind)


class BatchFailed(TwophaseError, RuntimeError):
    """A micro-batch could not be committed; the message names participant, partition
    and cause. The query stops; restarting it replays the batch."""

    code = "batch_failed"


class FailpointHit(TwophaseError, RuntimeError):
    """Raised by a failpoint whose action is ``raise``."""

    code = "failpoint"


# --------------------------------------------------------------------------- classifying


class Failure(str, enum.Enum):
    """What kind of failure an exception is: the one place that decides whether running
    again can help. The first four are permanent (no retry, one clear message); a
    transient failure is retried within the retry budget; ``UNKNOWN`` is treated as
    transient (the retry rule bounds it)."""

    AUTHENTICATION = "authentication"
    AUTHORIZATION = "authorization"
    MISSING = "missing object"
    CONFIGURATION = "bad configuration"
    TRANSIENT = "transient"
    UNKNOWN = "unknown"

    @property
    def permanent(self) -> bool:
        return self not in (Failure.TRANSIENT, Failure.UNKNOWN)


_PERMANENT_ERRNO = {
    errno.EACCES: Failure.AUTHORIZATION, errno.EPERM: Failure.AUTHORIZATION,
    errno.EROFS: Failure.AUTHORIZATION, errno.ENOENT: Failure.MISSING,
    errno.ENOTDIR: Failure.CONFIGURATION, errno.EISDIR: Failure.CONFIGURATION,
    errno.ENAMETOOLONG: Failure.CONFIGURATION, errno.EEXIST: Failure.CONFIGURATION,
}
_TRANSIENT_ERRNO = {
    errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT,
    errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN, errno.EINTR,
    errno.ENOSPC,  # space can be freed; the retry budget bounds the wait
}

# PostgreSQL SQLSTATE classes and codes (errcodes appendix of the PostgreSQL manual)
_SQLSTATE_PERMANENT = {
    "28": Failure.AUTHENTICATION, "42501": Failure.AUTHORIZATION,
    "3D": Failure.MISSING, "3F": Failure.MISSING, "42P01": Failure.MISSING,
    "42883": Failure.MISSING, "55000": Failure.CONFIGURATION, "22023": Failure.CONFIGURATION,
    "42": Failure.CONFIGURATION,
}
_SQLSTATE_TRANSIENT = ("08", "57P01", "57P02", "57P03", "53", "40001", "40P01", "55P03",
                       "57014")
# A refused connection has no SQLSTATE in libpq's message: the server's FATAL line says it
_PG_FATAL = (
    (re.compile(r"password authentication failed|role \".*\" does not exist|"
                r"no pg_hba\.conf entry|authentication failed|"
                r"no password supplied|GSSAPI|certificate", re.I), Failure.AUTHENTICATION),
    (re.compile(r"permission denied|must be superuser|not permitted to log in", re.I),
     Failure.AUTHORIZATION),
    (re.compile(r"database \".*\" does not exist", re.I), Failure.MISSING),
    (re.compile(r"invalid (value|connection option)|unrecognized configuration", re.I),
     Failure.CONFIGURATION),
)
_KAFKA_PERMANENT = {
    "SASL_AUTHENTICATION_FAILED": Failure.AUTHENTICATION,
    "_AUTHENTICATION": Failure.AUTHENTICATION, "_SSL": Failure.AUTHENTICATION,
    "TOPIC_AUTHORIZATION_FAILED": Failure.AUTHORIZATION,
    "TRANSACTIONAL_ID_AUTHORIZATION_FAILED": Failure.AUTHORIZATION,
    "CLUSTER_AUTHORIZATION_FAILED": Failure.AUTHORIZATION,
    "GROUP_AUTHORIZATION_FAILED": Failure.AUTHORIZATION,
    "UNKNOWN_TOPIC_OR_PART": Failure.MISSING, "_UNKNOWN_TOPIC": Failure.MISSING,
    "_UNKNOWN_PARTITION": Failure.MISSING, "INVALID_CONFIG": Failure.CONFIGURATION,
    "_INVALID_ARG": Failure.CONFIGURATION, "INVALID_TRANSACTION_TIMEOUT": Failure.CONFIGURATION,
    "UNSUPPORTED_VERSION": Failure.CONFIGURATION,
}
_S3_PERMANENT = {
    "InvalidAccessKeyId": Failure.AUTHENTICATION, "SignatureDoesNotMatch":
    Failure.AUTHENTICATION, "ExpiredToken": Failure.AUTHENTICATION,
    "InvalidToken": Failure.AUTHENTICATION, "AccessDenied": Failure.AUTHORIZATION,
    "AllAccessDisabled": Failure.AUTHORIZATION, "403": Failure.AUTHORIZATION,
    "NoSuchBucket": Failure.MISSING, "404": Failure.MISSING,
    "InvalidBucketName": Failure.CONFIGURATION, "AuthorizationHeaderMalformed":
    Failure.CONFIGURATION, "PermanentRedirect": Failure.CONFIGURATION,
}


def classify(exc: BaseException) -> Failure:
    """The kind of ``exc``: every participant asks here whether to retry.

    Read from what the error carries (no client library is imported): an OS errno, a
    PostgreSQL SQLSTATE or FATAL line, a librdkafka error name, an S3 error code, or a
    twophase class. Its causes are followed (``raise ... from``)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        kind = _classify_one(cur)
        if kind is not Failure.UNKNOWN:
            return kind
        cur = cur.__cause__ or cur.__context__
    return Failure.UNKNOWN


def _classify_one(exc: BaseException) -> Failure:
    if isinstance(exc, TargetProblem):
        return exc.kind or Failure.CONFIGURATION
    if isinstance(exc, (InvalidRequest, EnvironmentProblem)):
        return Failure.CONFIGURATION
    if isinstance(exc, CoordinatorUnavailable):
        return Failure.TRANSIENT
    state = getattr(exc, "sqlstate", None)
    if isinstance(state, str) and state:
        for prefix, kind in sorted(_SQLSTATE_PERMANENT.items(), key=lambda kv: -len(kv[0])):
            if state.startswith(prefix) and not state.startswith(_SQLSTATE_TRANSIENT):
                return kind
        return Failure.TRANSIENT if state.startswith(_SQLSTATE_TRANSIENT) else Failure.UNKNOWN
    if type(exc).__module__.startswith("psycopg"):
        text = str(exc)
        if "FATAL:" in text and "starting up" not in text and "shutting down" not in text \
                and "too many" not in text and "terminating connection" not in text:
            for pattern, kind in _PG_FATAL:
                if pattern.search(text):
                    return kind
        if type(exc).__name__ == "OperationalError":
            return Failure.TRANSIENT  # no server answer: refused, reset, timed out
    name = _kafka_name(exc)
    if name is not None:
        return _KAFKA_PERMANENT.get(name, Failure.TRANSIENT if _kafka_retriable(exc)
                                    else Failure.UNKNOWN)
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and isinstance(response.get("Error"), dict):
        code = str(response["Error"].get("Code", ""))
        return _S3_PERMANENT.get(code, Failure.UNKNOWN)
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return Failure.TRANSIENT
    if isinstance(exc, OSError) and exc.errno is not None:
        if exc.errno in _TRANSIENT_ERRNO:
            return Failure.TRANSIENT
        return _PERMANENT_ERRNO.get(exc.errno, Failure.UNKNOWN)
    return Failure.UNKNOWN


def _kafka_name(exc: BaseException) -> str | None:
    err = exc.args[0] if exc.args else None
    name = getattr(err, "name", None)
    if type(exc).__name__ == "KafkaException" and callable(name):
        return str(name())
    return None


def _kafka_retriable(exc: BaseException) -> bool:
    err = exc.args[0]
    return bool(getattr(err, "retriable", lambda: False)())


_SENTENCE = re.compile(r"((?:[\w.-]+ )?participant '[^'\n]*'(?: \([^)\n]*\))?: [^\n]*?"
                       r"\. Fix: [^\n]*)")


def headline(text: str) -> str | None:
    """The first ``<participant>: <cause>. Fix: <fix>.`` sentence in ``text`` (an abort
    reason or a Spark job error, however wrapped), or None."""
    m = _SENTENCE.search(text)
    return m.group(1) if m else None


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
