"""The decision log's statements and the mapping between its rows and protocol records.

Hot-path statements are plain SQL run on the driver's cursor
(:func:`~twophase.coordinator.db.run`), written with ``:name`` parameters and turned into
psycopg's ``%(name)s`` form for PostgreSQL; cold paths (listings, history) use
SQLAlchemy Core. A transaction's branches are one JSON column in :mod:`twophase.wire`'s
branch layout, the same one the HTTP API shows. Updates are compare-and-set on
``version``: a lost race raises :class:`~twophase.coordinator.db.Conflict`. No protocol
rule lives here.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Final

from sqlalchemy import Connection, and_, bindparam, delete, insert, select

from twophase import protocol as p
from twophase import wire
from twophase.coordinator import schema as s
from twophase.coordinator.db import Conflict, run
from twophase.protocol import TxnKey

__all__ = ["TXN_COLS", "Rows", "key_params", "key_where", "to_txn"]

# the transaction columns every load selects, in the order to_txn reads them
TXN_COLS: Final = (
    "sink", "lineage", "checkpoint", "attempt", "epoch", "partitions", "branches", "state",
    "reason", "deadline", "created", "decided_at", "finished_at", "version", "alert",
    "updated",
)
_TXN_INS_COLS: Final = (*TXN_COLS, "branch_count")
_EV_COLS: Final = ("sink", "lineage", "checkpoint", "attempt", "at", "kind", "branch", "detail",
                   "state")
_KEY_SQL: Final = (
    "sink = :k_sink AND lineage = :k_lineage AND checkpoint = :k_checkpoint "
    "AND attempt = :k_attempt"
)


def _ins(table: str, cols: Sequence[str]) -> str:
    return (f"INSERT INTO {table} ({', '.join(cols)}) "
            f"VALUES ({', '.join(':' + c for c in cols)})")


class _Statements:
    """The hot statements in one driver's parameter style."""

    def __init__(self, pyformat: bool) -> None:
        def q(text: str) -> str:
            return re.sub(r":(\w+)", r"%(\1)s", text) if pyformat else text

        cols = ", ".join(TXN_COLS)
        t, sk = s.txns.name, s.sinks.name
        self.sel_txn = q(f"SELECT {cols} FROM {t} WHERE {_KEY_SQL}")
        self.sel_version = q(f"SELECT version FROM {t} WHERE {_KEY_SQL}")
        self.sel_attempts = q(
            f"SELECT {cols} FROM {t} WHERE sink = :k_sink AND lineage = :k_lineage "
            "AND checkpoint = :k_checkpoint ORDER BY attempt"
        )
        self.sel_committing_other = q(
            f"SELECT {cols} FROM {t} WHERE sink = :k_sink AND lineage <> :k_lineage "
            "AND state = 'COMMITTING'"
        )
        self.ins_txn = q(_ins(t, _TXN_INS_COLS))
        self.upd_txn = q(
            f"UPDATE {t} SET state = :state, reason = :reason, branches = :branches, "
            "decided_at = :decided_at, finished_at = :finished_at, updated = :updated, "
            f"alert = :alert, version = :version WHERE {_KEY_SQL} AND version = :old_version"
        )
        self.ins_event = q(_ins(s.events.name, _EV_COLS))
        self.sel_sink = q(
            f"SELECT name, epoch, lineage, last_committed, version FROM {sk} WHERE name = :k_name"
        )
        self.ins_sink = q(_ins(sk, ("name", "epoch", "lineage", "last_committed", "version")))
        self.upd_sink = q(
            f"UPDATE {sk} SET epoch = :epoch, lineage = :lineage, "
            "last_committed = :last_committed, version = :version "
            "WHERE name = :k_name AND version = :old_version"
        )


_STATEMENTS: Final = {False: _Statements(pyformat=False), True: _Statements(pyformat=True)}


# ---------------------------------------------------------------------------------------
# rows <-> records


def key_params(key: TxnKey) -> dict[str, Any]:
    return {"k_sink": key[0], "k_lineage": key[1], "k_checkpoint": key[2], "k_attempt": key[3]}


def key_where(table: Any) -> Any:
    """The Core twin of the key condition, bound by :func:`key_params`."""
    return and_(
        table.c.sink == bindparam("k_sink"),
        table.c.lineage == bindparam("k_lineage"),
        table.c.checkpoint == bindparam("k_checkpoint"),
        table.c.attempt == bindparam("k_attempt"),
    )


def encode_branches(branches: Mapping[str, p.BranchState]) -> str:
    return json.dumps(wire.encode_branches(branches), separators=(",", ":"))


def decode_branches(text: str) -> Mapping[str, p.BranchState]:
    """Also reads rows written before the store used wire's layout (null keys left out)."""
    return wire.decode_branches(json.loads(text), "txns.branches")


def to_txn(row: Sequence[Any]) -> p.Transaction:
    """A row with the columns of ``TXN_COLS``, in that order."""
    return p.Transaction(
        sink=row[0],
        lineage=row[1],
        batch_id=row[2],
        attempt=row[3],
        epoch=row[4],
        partitions=row[5],
        branches=decode_branches(row[6]),
        state=p.State(row[7]),
        reason=row[8],
        deadline=row[9],
        created=row[10],
        decided_at=row[11],
        finished_at=row[12],
        version=row[13],
    )


def _event_detail(ev: p.Event | p.Begin) -> tuple[str, str | None, dict[str, Any]]:
    """(kind, branch, detail) of one history row."""
    if isinstance(ev, p.Vote):
        return "vote", ev.branch, {"yes": ev.yes, "epoch": ev.epoch, "reason": ev.reason}
    if isinstance(ev, p.Ack):
        return "ack", ev.branch, {"outcome": ev.outcome.value, "epoch": ev.epoch}
    if isinstance(ev, p.ForceAck):
        return "force_ack", ev.branch, {"outcome": ev.outcome.value, "reason": ev.reason}
    if isinstance(ev, p.Abandon):
        return "abandon", None, {"reason": ev.reason, "epoch": ev.epoch}
    if isinstance(ev, p.AdminAbort):
        return "admin_abort", None, {"reason": ev.reason}
    if isinstance(ev, p.Begin):
        return "begin", None, {"epoch": ev.epoch, "partitions": ev.partitions}
    return "expire", None, {}


# ---------------------------------------------------------------------------------------
# loading and saving


KEPT_DECODED: Final = 16
"""Transactions whose last durable record the store keeps decoded, with each branch's
JSON: a batch's chunks of votes and acks then neither decode nor re-encode the whole
branches column (O(P) JSON per chunk, O(P^2/chunk) a batch: what made 4,096 branches
cost 3x per branch what 256 did), only the branches that changed."""


class Rows:
    """Protocol records in and out of the tables, inside the caller's transaction.

    Keeps the last :data:`KEPT_DECODED` durable records (``remember``, called once a
    change is durable): a load whose row still has that record's ``version`` (the
    compare-and-set counter every change bumps; a durable version is never rewritten
    with other content) returns it without decoding. A record read inside a write
    transaction is never kept: that transaction may still roll back, and its version be
    written again with other content."""

    def __init__(self, *, pyformat: bool) -> None:
        self.q = _STATEMENTS[pyformat]
        self._lock = threading.Lock()
        self._decoded: OrderedDict[TxnKey, p.Transaction] = OrderedDict()
        # per transaction, each branch's state (by identity) and its encoded '"id":{...}'
        self._encoded: dict[TxnKey, dict[str, tuple[p.BranchState, str]]] = {}

    def remember(self, txn: p.Transaction) -> None:
        """``txn`` is durable: keep it decoded for the next load of its key."""
        with self._lock:
            self._decoded[txn.key] = txn
            self._decoded.move_to_end(txn.key)
            while len(self._decoded) > KEPT_DECODED:
                old, _ = self._decoded.popitem(last=False)
                self._encoded.pop(old, None)

    # transactions

    def load_txn(self, conn: Connection, key: TxnKey) -> p.Transaction | None:
        with self._lock:
            known = self._decoded.get(key)
        if known is not None:
            head = run(conn, self.q.sel_version, key_params(key)).fetchone()
            if head is not None and head[0] == known.version:
                return known
        row = run(conn, self.q.sel_txn, key_params(key)).fetchone()
        return None if row is None else to_txn(row)

    def _branches_json(self, txn: p.Transaction) -> str:
        """``encode_branches(txn.branches)``, re-encoding only the branches whose state
        changed since this transaction's last encoding (states are immutable and shared
        by unchanged branches: identity says unchanged)."""
        with self._lock:
            before = self._encoded.get(txn.key, {})
        now: dict[str, tuple[p.BranchState, str]] = {}
        for bid, b in txn.branches.items():
            hit = before.get(bid)
            if hit is None or hit[0] is not b:
                hit = (b, json.dumps(bid) + ":"
                       + json.dumps(wire.encode_branch(b), separators=(",", ":")))
            now[bid] = hit
        with self._lock:
            self._encoded[txn.key] = now
            if len(self._encoded) > 2 * KEPT_DECODED:  # a write that never became durable
                for k in [k for k in self._encoded if k not in self._decoded]:
                    del self._encoded[k]
        return "{" + ",".join(frag for _, frag in now.values()) + "}"

    def load_attempts(
        self, conn: Connection, sink: str, lineage: str, batch_id: int
    ) -> tuple[p.Transaction, ...]:
        """Every attempt of one batch, oldest first."""
        rows = run(conn, self.q.sel_attempts,
                   {"k_sink": sink, "k_lineage": lineage, "k_checkpoint": batch_id}).fetchall()
        return tuple(to_txn(r) for r in rows)

    def load_committing_elsewhere(
        self, conn: Connection, sink: str, lineage: str
    ) -> tuple[p.Transaction, ...]:
        """The sink's COMMIT-decided, unfinished transactions in other lineages."""
        rows = run(conn, self.q.sel_committing_other,
                   {"k_sink": sink, "k_lineage": lineage}).fetchall()
        return tuple(to_txn(r) for r in rows)

    def insert_txn(self, conn: Connection, new: p.Transaction, now: float) -> None:
        with self._lock:  # a key purged by retention and begun again starts afresh
            self._decoded.pop(new.key, None)
            self._encoded.pop(new.key, None)
        run(conn, self.q.ins_txn, {
            "sink": new.sink, "lineage": new.lineage, "checkpoint": new.batch_id,
            "attempt": new.attempt, "epoch": new.epoch, "partitions": new.partitions,
            "branches": self._branches_json(new), "state": new.state.value,
            "reason": new.reason, "deadline": new.deadline, "created": new.created,
            "decided_at": new.decided_at, "finished_at": new.finished_at,
            "version": new.version, "alert": False, "updated": now,
            "branch_count": len(new.branches),
        })

    def update_txn(
        self, conn: Connection, old: p.Transaction, new: p.Transaction, now: float
    ) -> None:
        """Write ``new`` over ``old`` if the row still has ``old``'s version (clears the
        alert flag: the transaction moved)."""
        cur = run(conn, self.q.upd_txn, {
            **key_params(new.key), "old_version": old.version, "state": new.state.value,
            "reason": new.reason, "branches": self._branches_json(new),
            "decided_at": new.decided_at, "finished_at": new.finished_at,
            "updated": now, "alert": False, "version": new.version,
        })
        if cur.rowcount != 1:
            raise Conflict(f"lost a compare-and-set on {new.key}")

    def insert_events(
        self,
        conn: Connection,
        txn: p.Transaction,
        evs: Sequence[tuple[p.Event | p.Begin, p.State]],
        now: float,
    ) -> None:
        """Append (event, state after it) pairs to the transaction's history."""
        hist = []
        for ev, after in evs:
            kind, branch, detail = _event_detail(ev)
            hist.append({
                "sink": txn.sink, "lineage": txn.lineage, "checkpoint": txn.batch_id,
                "attempt": txn.attempt, "at": now, "kind": kind, "branch": branch,
                "detail": json.dumps(detail), "state": after.value,
            })
        if len(hist) == 1:
            run(conn, self.q.ins_event, hist[0])
        elif hist:
            run(conn, self.q.ins_event, hist, many=True)

    # sinks

    def load_sink(self, conn: Connection, name: str) -> tuple[p.SinkRecord | None, int]:
        """The sink's record and its row version (0 when there is no row yet)."""
        row = run(conn, self.q.sel_sink, {"k_name": name}).fetchone()
        if row is None:
            return None, 0
        rec = p.SinkRecord(name=row[0], epoch=row[1], lineage=row[2], last_committed=row[3])
        return rec, int(row[4])

    def save_sink(
        self, conn: Connection, old: p.SinkRecord | None, version: int, new: p.SinkRecord
    ) -> None:
        if old is None:
            run(conn, self.q.ins_sink,
                {"name": new.name, "epoch": new.epoch, "lineage": new.lineage,
                 "last_committed": new.last_committed, "version": 1})
            return
        cur = run(conn, self.q.upd_sink,
                  {"k_name": new.name, "old_version": version, "epoch": new.epoch,
                   "lineage": new.lineage, "last_committed": new.last_committed,
                   "version": version + 1})
        if cur.rowcount != 1:
            raise Conflict(f"lost a compare-and-set on sink {new.name}")

    # participant descriptors (cold: once per register)

    @staticmethod
    def save_participants(
        conn: Connection, sink: str, descriptors: Sequence[Mapping[str, Any]], now: float
    ) -> None:
        """The sink's descriptors, replacing the previous writer's set."""
        pt = s.participants
        conn.execute(delete(pt).where(pt.c.sink == sink))
        if descriptors:
            conn.execute(insert(pt), [
                {"sink": sink, "name": d["name"], "descriptor": json.dumps(dict(d)),
                 "updated": now}
                for d in descriptors
            ])

    @staticmethod
    def participants(conn: Connection, sink: str) -> list[dict[str, Any]]:
        pt = s.participants
        q = select(pt.c.descriptor).where(pt.c.sink == sink).order_by(pt.c.name)
        return [json.loads(r[0]) for r in conn.execute(q).all()]

    # cold reads (SQLAlchemy Core)

    @staticmethod
    def list_txns(
        conn: Connection,
        sink: str | None,
        state: str | None,
        limit: int,
        alert: bool | None,
    ) -> list[tuple[p.Transaction, bool, float]]:
        """(transaction, alert flag, last update), newest first."""
        t = s.txns
        q = select(*(t.c[c] for c in TXN_COLS))
        if sink is not None:
            q = q.where(t.c.sink == sink)
        if state is not None:
            q = q.where(t.c.state == p.State(state).value)
        if alert is not None:
            q = q.where(t.c.alert == alert)
        q = q.order_by(t.c.created.desc(), t.c.attempt.desc()).limit(limit)
        return [(to_txn(r), bool(r.alert), r.updated) for r in conn.execute(q).all()]

    @staticmethod
    def history(conn: Connection, key: TxnKey) -> list[dict[str, Any]]:
        """The event history of one transaction, oldest first."""
        e = s.events
        q = select(e).where(key_where(e)).order_by(e.c.id)
        return [
            {"at": r.at, "kind": r.kind, "branch": r.branch,
             "detail": json.loads(r.detail) if r.detail else None, "state": r.state}
            for r in conn.execute(q, key_params(key)).all()
        ]
