"""JSON codec for the protocol's records, both directions, with no I/O.

This module is the one definition of the record layout. The HTTP service encodes its
answers with these functions and documents them with the TypedDicts below (its OpenAPI
response schemas), the client decodes them here, the store keeps a transaction's branches
in the same layout, and the client builds every request body here. Decoding checks types
and names the offending field: a malformed answer from a server is a clear error, never a
half-built record. A missing optional key reads as null (older stored rows omit them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Final, Literal

from typing_extensions import NotRequired, TypedDict

from twophase import protocol as p
from twophase.errors import WireError

__all__ = [
    "MAX_EPOCH",
    "MAX_INT",
    "MAX_TEXT",
    "AbandonBody",
    "AbortBody",
    "AckBody",
    "AcksBody",
    "BeginBody",
    "BeginKindName",
    "BeginOut",
    "BranchMetrics",
    "BranchOut",
    "DecisionName",
    "DescriptorOut",
    "ErrorOut",
    "ForceAckBody",
    "ParticipantsOut",
    "RegisterBody",
    "SinkListOut",
    "SinkOut",
    "SinkSummaryOut",
    "StateName",
    "TxnListOut",
    "TxnOut",
    "VoteBody",
    "VoteIn",
    "VotesBody",
    "WireError",
    "abandon_body",
    "abort_body",
    "acks_body",
    "begin_body",
    "clip_text",
    "decode_begin",
    "decode_branch",
    "decode_branches",
    "decode_descriptor",
    "decode_sink",
    "decode_touched",
    "decode_txn",
    "encode_begin",
    "encode_branch",
    "encode_branches",
    "encode_sink",
    "encode_txn",
    "error_body",
    "force_ack_body",
    "register_body",
    "votes_body",
]

# The enums' values as the JSON carries them. mypy checks the encoders below against them
# (it types an enum's .value as the union of its values); a test checks them too.
StateName = Literal["OPEN", "PREPARING", "COMMITTING", "COMMITTED", "ABORTING", "ABORTED"]
DecisionName = Literal["COMMIT", "ABORT"]
BeginKindName = Literal["new", "committed", "in_doubt"]

# Bounds of every request field (the service refuses more; the client never sends more).
MAX_INT: Final = 2**63 - 1
"""Largest integer a request may carry: SQLite INTEGER and PostgreSQL BIGINT hold it."""
MAX_EPOCH: Final = 2**62
"""Largest writer epoch a request may carry; registering adds one, so it cannot overflow."""
MAX_TEXT: Final = 4096
"""Longest free text (a NO vote's or an abandon's reason, a handle value)."""


# ---------------------------------------------------------------------------------------
# what the coordinator answers (named as its OpenAPI schemas: "Out" of the service)


class BranchOut(TypedDict):
    vote: DecisionName | None
    handle: dict[str, str] | None
    reason: str | None
    ack: DecisionName | None
    digest: NotRequired[str | None]  # absent in answers of older coordinators
    task: NotRequired[str | None]  # the Spark task attempt whose vote counts (0.3 on)


class TxnOut(TypedDict):
    sink: str
    lineage: str
    checkpoint: int  # Spark's batch id; the field keeps its HTTP name
    attempt: int
    epoch: int
    partitions: int
    state: StateName
    decision: DecisionName | None
    reason: str | None
    deadline: float
    created: float
    decided_at: float | None
    finished_at: float | None
    version: int
    branches: dict[str, BranchOut]
    alert: NotRequired[bool]  # listings add the operational alert flag


class SinkOut(TypedDict):
    name: str
    epoch: int
    lineage: str | None
    last_committed: int | None


class BeginOut(TypedDict):
    kind: BeginKindName
    sink: SinkOut
    txn: TxnOut | None
    recover: list[TxnOut]
    changed: list[TxnOut]
    new_lineage: bool


class TxnListOut(TypedDict):
    txns: list[TxnOut]


class DescriptorOut(TypedDict):
    """How to rebuild a participant: its kind, name, target and non-secret options
    (:meth:`twophase.participant.Participant.descriptor`)."""

    kind: str
    name: str
    target: str
    options: dict[str, str | int | float | bool | None]


class ParticipantsOut(TypedDict):
    sink: str
    participants: list[DescriptorOut]


class SinkSummaryOut(TypedDict):
    """One sink as operators see it (``GET /v1/sinks``)."""

    name: str
    epoch: int
    lineage: str | None
    last_committed: int | None
    in_doubt: int  # decided, branches not all acknowledged
    undecided: int  # open or preparing
    oldest_in_doubt_age: float | None  # seconds since the oldest in-doubt was decided
    alerts: int
    participants: list[str]


class SinkListOut(TypedDict):
    sinks: list[SinkSummaryOut]


class ErrorOut(TypedDict):
    """A refusal: the error code (one per twophase.errors class) and why."""

    error: str
    message: str


def error_body(code: str, message: str) -> ErrorOut:
    return {"error": code, "message": message}


def _decision_name(d: p.Decision | None) -> DecisionName | None:
    return d.value if d is not None else None


def encode_branch(b: p.BranchState) -> BranchOut:
    out: BranchOut = {
        "vote": _decision_name(b.vote),
        "handle": dict(b.handle) if b.handle is not None else None,
        "reason": b.reason,
        "ack": _decision_name(b.ack),
        "digest": b.digest,
    }
    if b.task is not None:  # only votes that name their task attempt carry it
        out["task"] = b.task
    return out


def encode_branches(branches: Mapping[str, p.BranchState]) -> dict[str, BranchOut]:
    return {bid: encode_branch(b) for bid, b in branches.items()}


def encode_txn(
    t: p.Transaction, *, brief: bool = False, only: Iterable[str] | None = None
) -> TxnOut:
    """The record as the API shows it; ``brief`` leaves out the branches (``{}``), and
    ``only`` keeps the branches it names (those a request of votes or acks touched): a
    batch of P branches then sends O(P) bytes back in all, not O(P^2/chunk)."""
    if brief:
        branches: dict[str, BranchOut] = {}
    elif only is not None:
        branches = {bid: encode_branch(t.branches[bid]) for bid in dict.fromkeys(only)
                    if bid in t.branches}
    else:
        branches = encode_branches(t.branches)
    return {
        "sink": t.sink,
        "lineage": t.lineage,
        "checkpoint": t.batch_id,
        "attempt": t.attempt,
        "epoch": t.epoch,
        "partitions": t.partitions,
        "state": t.state.value,
        "decision": _decision_name(t.decision),
        "reason": t.reason,
        "deadline": t.deadline,
        "created": t.created,
        "decided_at": t.decided_at,
        "finished_at": t.finished_at,
        "version": t.version,
        "branches": branches,
    }


def encode_sink(s: p.SinkRecord) -> SinkOut:
    return {
        "name": s.name,
        "epoch": s.epoch,
        "lineage": s.lineage,
        "last_committed": s.last_committed,
    }


def encode_begin(r: p.BeginResult) -> BeginOut:
    return {
        "kind": r.kind.value,
        "sink": encode_sink(r.sink),
        "txn": encode_txn(r.txn) if r.txn is not None else None,
        "recover": [encode_txn(t) for t in r.recover],
        "changed": [encode_txn(t) for t in r.changed],
        "new_lineage": r.new_lineage,
    }


# ---------------------------------------------------------------------------------------
# what the client sends (the service validates these with strict models and bounds)


class BranchMetrics(TypedDict, total=False):
    """What was measured for one branch: by its task, sent with the vote (``prepare_s``,
    ``rows``), and by the driver, sent with the ack (``commit_s``). Optional and only
    observed: the coordinator exports them as Prometheus histograms, never decides on
    them. (The coordinator still takes a 0.3 client's ``wait_s``: its tasks waited for
    the decision.)"""

    prepare_s: float
    commit_s: float
    rows: int


@dataclass(frozen=True)
class VoteIn:
    """One branch's vote: YES with the handle needed to commit it later, or NO with why."""

    branch: str
    yes: bool
    handle: Mapping[str, str] | None = None
    reason: str | None = None
    metrics: BranchMetrics | None = None
    digest: str | None = None  # content digest of the rows voted on (twophase.digest)
    task: str | None = None  # the Spark task attempt voting (first YES of a branch wins)


class BeginBody(TypedDict):
    lineage: str
    checkpoint: int
    epoch: int
    participants: list[str]
    partitions: int
    vote_timeout: float


class VoteBody(TypedDict):
    branch: str
    yes: bool
    handle: dict[str, str] | None
    reason: str | None
    metrics: NotRequired[BranchMetrics]
    digest: NotRequired[str]  # sent only when set: older services refuse unknown keys
    task: NotRequired[str]  # sent only when set, as digest


class VotesBody(TypedDict):
    epoch: int
    votes: list[VoteBody]
    brief: NotRequired[bool]  # answer without the branches
    touched: NotRequired[bool]  # answer with only the branches named here (0.3 on)


class AckBody(TypedDict):
    branch: str
    outcome: DecisionName
    metrics: NotRequired[BranchMetrics]


class AcksBody(TypedDict):
    epoch: int
    acks: list[AckBody]
    brief: NotRequired[bool]  # answer without the branches
    touched: NotRequired[bool]  # answer with only the branches named here (0.3 on)


class AbandonBody(TypedDict):
    epoch: int
    reason: str


class ForceAckBody(TypedDict):
    branch: str
    outcome: DecisionName
    reason: NotRequired[str]


class RegisterBody(TypedDict):
    participants: list[DescriptorOut]


class AbortBody(TypedDict):
    reason: str


def _outcome(o: p.Decision | str) -> DecisionName:
    """Raises ValueError for anything but COMMIT or ABORT, before a request is sent."""
    return p.Decision(o).value


def clip_text(text: str) -> str:
    """``text`` as the service accepts it: at most :data:`MAX_TEXT` characters, no NUL
    (PostgreSQL refuses it in text), no lone surrogate (not UTF-8). A reason built from
    an exception message can be anything; clipping it keeps the vote from being refused."""
    text = text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > MAX_TEXT:
        text = text[: MAX_TEXT - 15] + " ...[clipped]"
    return text


def begin_body(
    lineage: str,
    batch_id: int,
    epoch: int,
    participants: Sequence[str],
    partitions: int,
    vote_timeout: float,
) -> BeginBody:
    return {
        "lineage": lineage, "checkpoint": batch_id, "epoch": epoch,
        "participants": list(participants), "partitions": partitions,
        "vote_timeout": float(vote_timeout),
    }


def _vote(v: VoteIn) -> VoteBody:
    out: VoteBody = {"branch": v.branch, "yes": v.yes,
                     "handle": dict(v.handle) if v.handle is not None else None,
                     "reason": clip_text(v.reason) if v.reason is not None else None}
    if v.metrics:
        out["metrics"] = v.metrics
    if v.digest:
        out["digest"] = v.digest
    if v.task:
        out["task"] = v.task
    return out


def votes_body(epoch: int, votes: Iterable[VoteIn], *, brief: bool = False,
               touched: bool = False) -> VotesBody:
    """``brief``: the answer leaves out the branches; ``touched``: it carries only the
    branches voted on here (each sent only when set: older services refuse unknown keys)."""
    body: VotesBody = {"epoch": epoch, "votes": [_vote(v) for v in votes]}
    if brief:
        body["brief"] = True
    if touched:
        body["touched"] = True
    return body


def acks_body(
    epoch: int,
    acks: Iterable[tuple[str, p.Decision]],
    metrics: Mapping[str, BranchMetrics] | None = None,
    *,
    brief: bool = False,
    touched: bool = False,
) -> AcksBody:
    """``metrics``: per branch id, what the executor measured (optional); ``brief`` and
    ``touched`` as for :func:`votes_body`."""
    out: list[AckBody] = []
    for b, o in acks:
        ack: AckBody = {"branch": b, "outcome": _outcome(o)}
        if metrics and metrics.get(b):
            ack["metrics"] = metrics[b]
        out.append(ack)
    body: AcksBody = {"epoch": epoch, "acks": out}
    if brief:
        body["brief"] = True
    if touched:
        body["touched"] = True
    return body


def register_body(descriptors: Iterable[DescriptorOut]) -> RegisterBody:
    return {"participants": [dict(d) for d in descriptors]}  # type: ignore[misc]


def abandon_body(epoch: int, reason: str) -> AbandonBody:
    return {"epoch": epoch, "reason": clip_text(reason)}


def force_ack_body(branch: str, outcome: p.Decision, reason: str | None = None) -> ForceAckBody:
    out: ForceAckBody = {"branch": branch, "outcome": _outcome(outcome)}
    if reason:
        out["reason"] = reason
    return out


def abort_body(reason: str) -> AbortBody:
    return {"reason": clip_text(reason)}


# ---------------------------------------------------------------------------------------
# decoding


def _get(d: Mapping[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(d, Mapping):
        raise WireError(f"{where}: expected an object, got {type(d).__name__}")
    if key not in d:
        raise WireError(f"{where}.{key}: missing")
    v = d[key]
    if not isinstance(v, typ) or (isinstance(v, bool) and typ in (int, float, (int, float))):
        names = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise WireError(f"{where}.{key}: expected {names}, got {type(v).__name__}")
    return v


def _opt(d: Mapping[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if d.get(key) is None:
        return None
    return _get(d, key, typ, where)


def _decision(v: Any, where: str) -> p.Decision | None:
    if v is None:
        return None
    try:
        return p.Decision(v)
    except ValueError:
        raise WireError(f"{where}: {v!r} is not COMMIT or ABORT") from None


def _num(d: Mapping[str, Any], key: str, where: str) -> float:
    return float(_get(d, key, (int, float), where))


def _opt_num(d: Mapping[str, Any], key: str, where: str) -> float | None:
    v = _opt(d, key, (int, float), where)
    return None if v is None else float(v)


def decode_branch(d: Mapping[str, Any], where: str = "branch") -> p.BranchState:
    handle = _opt(d, "handle", dict, where)
    if handle is not None:
        for k, v in handle.items():
            if not isinstance(v, str):
                raise WireError(f"{where}.handle.{k}: expected str, got {type(v).__name__}")
        handle = MappingProxyType(dict(handle))
    return p.BranchState(
        vote=_decision(d.get("vote"), f"{where}.vote"),
        handle=handle,
        reason=_opt(d, "reason", str, where),
        ack=_decision(d.get("ack"), f"{where}.ack"),
        digest=_opt(d, "digest", str, where),
        task=_opt(d, "task", str, where),
    )


def decode_branches(d: Mapping[str, Any], where: str = "branches") -> Mapping[str, p.BranchState]:
    if not isinstance(d, Mapping):
        raise WireError(f"{where}: expected an object, got {type(d).__name__}")
    return MappingProxyType({str(bid): decode_branch(b, f"{where}.{bid}") for bid, b in d.items()})


def decode_txn(d: Mapping[str, Any], where: str = "txn") -> p.Transaction:
    raw_branches = _get(d, "branches", dict, where)
    state = _get(d, "state", str, where)
    try:
        st = p.State(state)
    except ValueError:
        raise WireError(f"{where}.state: unknown state {state!r}") from None
    return p.Transaction(
        sink=_get(d, "sink", str, where),
        lineage=_get(d, "lineage", str, where),
        batch_id=_get(d, "checkpoint", int, where),
        attempt=_get(d, "attempt", int, where),
        epoch=_get(d, "epoch", int, where),
        partitions=_get(d, "partitions", int, where),
        branches=decode_branches(raw_branches, f"{where}.branches"),
        deadline=_num(d, "deadline", where),
        state=st,
        reason=_opt(d, "reason", str, where),
        created=_num(d, "created", where),
        decided_at=_opt_num(d, "decided_at", where),
        finished_at=_opt_num(d, "finished_at", where),
        version=_get(d, "version", int, where),
    )


def decode_touched(d: Mapping[str, Any], base: p.Transaction) -> p.Transaction | None:
    """A ``touched`` answer (the record's state with only the branches its request
    named) decoded into ``base``, the caller's copy: ``base``'s other branches kept, in
    ``base``'s order. None when the two disagree: a branch ``base`` does not have, or a
    merged record that is not :meth:`~twophase.protocol.Transaction.coherent` (another
    writer moved a branch ``base`` still shows); then only the whole record will do."""
    answer = decode_txn(d)
    if not answer.branches.keys() <= base.branches.keys():
        return None
    merged = replace(answer, branches=MappingProxyType({**base.branches, **answer.branches}))
    return merged if merged.coherent() else None


def decode_sink(d: Mapping[str, Any], where: str = "sink") -> p.SinkRecord:
    return p.SinkRecord(
        name=_get(d, "name", str, where),
        epoch=_get(d, "epoch", int, where),
        lineage=_opt(d, "lineage", str, where),
        last_committed=_opt(d, "last_committed", int, where),
    )


def decode_descriptor(d: Mapping[str, Any], where: str = "descriptor") -> DescriptorOut:
    options = _get(d, "options", dict, where)
    for k, v in options.items():
        if not isinstance(k, str) or not (v is None or isinstance(v, (str, int, float, bool))):
            raise WireError(f"{where}.options.{k}: expected a string, number, bool or null")
    return {
        "kind": _get(d, "kind", str, where),
        "name": _get(d, "name", str, where),
        "target": _get(d, "target", str, where),
        "options": dict(options),
    }


def decode_begin(d: Mapping[str, Any], where: str = "begin") -> p.BeginResult:
    kind = _get(d, "kind", str, where)
    try:
        k = p.BeginKind(kind)
    except ValueError:
        raise WireError(f"{where}.kind: unknown kind {kind!r}") from None
    txn = d.get("txn")
    return p.BeginResult(
        kind=k,
        sink=decode_sink(_get(d, "sink", dict, where), f"{where}.sink"),
        txn=decode_txn(txn, f"{where}.txn") if txn is not None else None,
        recover=tuple(
            decode_txn(t, f"{where}.recover") for t in _get(d, "recover", list, where)
        ),
        changed=tuple(
            decode_txn(t, f"{where}.changed") for t in _get(d, "changed", list, where)
        ),
        new_lineage=bool(_get(d, "new_lineage", bool, where)),
    )
