"""JSON codec for the protocol's records, both directions, with no I/O.

The HTTP service encodes with these functions and the client decodes with them, so both
sides agree on one layout. Decoding checks types and names the offending field: a
malformed answer from a server is a clear error, never a half-built record.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from twophase import protocol as p
from twophase.errors import WireError

__all__ = [
    "WireError",
    "decode_begin",
    "decode_sink",
    "decode_txn",
    "encode_begin",
    "encode_sink",
    "encode_txn",
]

JSON = dict[str, Any]


def encode_branch(b: p.BranchState) -> JSON:
    return {
        "vote": b.vote.value if b.vote else None,
        "handle": dict(b.handle) if b.handle is not None else None,
        "reason": b.reason,
        "ack": b.ack.value if b.ack else None,
    }


def encode_txn(t: p.Transaction) -> JSON:
    return {
        "sink": t.sink,
        "lineage": t.lineage,
        "checkpoint": t.batch_id,
        "attempt": t.attempt,
        "epoch": t.epoch,
        "partitions": t.partitions,
        "state": t.state.value,
        "decision": t.decision.value if t.decision else None,
        "reason": t.reason,
        "deadline": t.deadline,
        "created": t.created,
        "decided_at": t.decided_at,
        "finished_at": t.finished_at,
        "version": t.version,
        "branches": {bid: encode_branch(b) for bid, b in t.branches.items()},
    }


def encode_sink(s: p.SinkRecord) -> JSON:
    return {
        "name": s.name,
        "epoch": s.epoch,
        "lineage": s.lineage,
        "last_committed": s.last_committed,
    }


def encode_begin(r: p.BeginResult) -> JSON:
    return {
        "kind": r.kind.value,
        "sink": encode_sink(r.sink),
        "txn": encode_txn(r.txn) if r.txn is not None else None,
        "recover": [encode_txn(t) for t in r.recover],
        "changed": [encode_txn(t) for t in r.changed],
        "new_lineage": r.new_lineage,
    }


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
    )


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
        branches=MappingProxyType(
            {
                str(bid): decode_branch(b, f"{where}.branches.{bid}")
                for bid, b in raw_branches.items()
            }
        ),
        deadline=_num(d, "deadline", where),
        state=st,
        reason=_opt(d, "reason", str, where),
        created=_num(d, "created", where),
        decided_at=_opt_num(d, "decided_at", where),
        finished_at=_opt_num(d, "finished_at", where),
        version=_get(d, "version", int, where),
    )


def decode_sink(d: Mapping[str, Any], where: str = "sink") -> p.SinkRecord:
    return p.SinkRecord(
        name=_get(d, "name", str, where),
        epoch=_get(d, "epoch", int, where),
        lineage=_opt(d, "lineage", str, where),
        last_committed=_opt(d, "last_committed", int, where),
    )


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
