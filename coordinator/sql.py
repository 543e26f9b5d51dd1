"""The decision log's statements and the mapping between its rows and protocol records.

Hot-path statements are plain SQL run on the driver's cursor
(:func:`~twophase.coordinator.db.run`), written with ``:name`` parameters and turned into
psycopg's ``%(name)s`` form for PostgreSQL; cold paths (listings, history) use
SQLAlchemy Core. A transaction's branches are rows of their own, each one JSON value in
:mod:`twophase.client.wire`'s branch layout (the one the HTTP API shows); a change writes the
transaction's row with a compare-and-set on ``version`` (a lost race raises
:class:`~twophase.coordinator.db.Conflict`), then only the branch rows that changed.
A load reads the transaction's row, its branch rows, then its ``version`` again, and
reads again if that moved (PostgreSQL gives each statement its own snapshot): a branch
row is only written with a new ``version``, so a mixed read is never returned, and a
compare-and-set computed from one would fail anyway. No protocol rule lives here.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final

from sqlalchemy import Connection, and_, bindparam, delete, insert, select

from twophase import protocol as p
from twophase.client import wire
from twophase.coordinator import schema as s
from twophase.coordinator.db import Conflict, run
from twophase.protocol import TxnKey

__all__ = ["TXN_COLS", "Rows", "key_params", "key_where", "to_txn"]

# the transaction columns every load selects, in the order to_txn reads them
TXN_COLS: Final = (
    "sink", "lineage", "checkpoint", "attempt", "epoch", "partitions", "state", "reason",
    "deadline", "created", "decided_at", "finished_at", "version", "alert", "updated",
)
_TXN_INS_COLS: Final = (*TXN_COLS, "branch_count")
_BRANCH_COLS: Final = ("sink", "lineage", "checkpoint", "attempt", "idx", "branch", "state")
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
        t, sk, br = s.txns.name, s.sinks.name, s.branches.name
        self.sel_txn = q(f"SELECT {cols} FROM {t} WHERE {_KEY_SQL}")
        self.sel_branches = q(f"SELECT branch, state FROM {br} WHERE {_KEY_SQL} ORDER BY idx")
        self.ins_branch = q(_ins(br, _BRANCH_COLS))
        self.upd_branch = q(f"UPDATE {br} SET state = :state WHERE {_KEY_SQL} AND idx = :idx")
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
            f"UPDATE {t} SET state = :state, reason = :reason, "
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


def encode_branch(b: p.BranchState) -> str:
    return json.dumps(wire.encode_branch(b), separators=(",", ":"))


def to_txn(row: Sequence[Any], branches: Mapping[str, p.BranchState]) -> p.Transaction:
    """A row with the columns of ``TXN_COLS``, in that order, and its branches."""
    return p.Transaction(
        sink=row[0],
        lineage=row[1],
        batch_id=row[2],
        attempt=row[3],
        epoch=row[4],
        partitions=row[5],
        branches=branches,
        state=p.State(row[6]),
        reason=row[7],
        deadline=row[8],
        created=row[9],
        decided_at=row[10],
        finished_at=row[11],
        version=row[12],
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


_CONSISTENT_TRIES: Final = 10  # a write's compare-and-set still catches a mixed read

KEPT_DECODED: Final = 16
"""Transactions whose last durable record the store keeps decoded: a batch's chunks of
votes and acks then read one row (its ``version``), not every branch row, and write only
the branches that changed."""


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

    def remember(self, txn: p.Transaction) -> None:
        """``txn`` is durable: keep it decoded for the next load of its key."""
        with self._lock:
            self._decoded[txn.key] = txn
            self._decoded.move_to_end(txn.key)
            while len(self._decoded) > KEPT_DECODED:
                self._decoded.popitem(last=False)

    # transactions

    def load_txn(self, conn: Connection, key: TxnKey) -> p.Transaction | None:
        with self._lock:
            known = self._decoded.get(key)
        if known is not None:
            head = run(conn, self.q.sel_version, key_params(key)).fetchone()
            if head is not None and head[0] == known.version:
                return known
        params = key_params(key)
        for _ in range(_CONSISTENT_TRIES):
            row = run(conn, self.q.sel_txn, params).fetchone()
            if row is None:
                return None
            txn = self._with_branches(conn, row)
            # PostgreSQL reads each statement at its own snapshot: a change committed
            # between the two reads moved the version too; read both again then
            head = run(conn, self.q.sel_version, params).fetchone()
            if head is not None and head[0] == txn.version:
                break
        return txn

    def _with_branches(self, conn: Connection, row: Sequence[Any]) -> p.Transaction:
        """The transaction of a ``TXN_COLS`` row, its branch rows read now (after it)."""
        params = {"k_sink": row[0], "k_lineage": row[1], "k_checkpoint": row[2],
                  "k_attempt": row[3]}
        branches = {
            bid: wire.decode_branch(json.loads(state), f"{s.branches.name}.{bid}")
            for bid, state in run(conn, self.q.sel_branches, params).fetchall()
        }
        return to_txn(row, MappingProxyType(branches))

    def load_attempts(
        self, conn: Connection, sink: str, lineage: str, batch_id: int
    ) -> tuple[p.Transaction, ...]:
        """Every attempt of one batch, oldest first."""
        rows = run(conn, self.q.sel_attempts,
                   {"k_sink": sink, "k_lineage": lineage, "k_checkpoint": batch_id}).fetchall()
        return tuple(self._with_branches(conn, r) for r in rows)

    def load_committing_elsewhere(
        self, conn: Connection, sink: str, lineage: str
    ) -> tuple[p.Transaction, ...]:
        """The sink's COMMIT-decided, unfinished transactions in other lineages."""
        rows = run(conn, self.q.sel_committing_other,
                   {"k_sink": sink, "k_lineage": lineage}).fetchall()
        return tuple(self._with_branches(conn, r) for r in rows)

    def insert_txn(self, conn: Connection, new: p.Transaction, now: float) -> None:
        with self._lock:  # a key purged by retention and begun again starts afresh
            self._decoded.pop(new.key, None)
        run(conn, self.q.ins_txn, {
            "sink": new.sink, "lineage": new.lineage, "checkpoint": new.batch_id,
            "attempt": new.attempt, "epoch": new.epoch, "partitions": new.partitions,
            "state": new.state.value,
            "reason": new.reason, "deadline": new.deadline, "created": new.created,
            "decided_at": new.decided_at, "finished_at": new.finished_at,
            "version": new.version, "alert": False, "updated": now,
            "branch_count": len(new.branches),
        })
        key = {"sink": new.sink, "lineage": new.lineage, "checkpoint": new.batch_id,
               "attempt": new.attempt}
        rows = [{**key, "idx": i, "branch": bid, "state": encode_branch(b)}
                for i, (bid, b) in enumerate(new.branches.items())]
        if rows:
            run(conn, self.q.ins_branch, rows, many=True)

    def update_txn(
        self, conn: Connection, old: p.Transaction, new: p.Transaction, now: float
    ) -> None:
        """Write ``new`` over ``old`` if the row still has ``old``'s version (clears the
        alert flag: the transaction moved), then the branch rows whose state changed
        (the machine shares unchanged states: identity says unchanged)."""
        keyp = key_params(new.key)
        cur = run(conn, self.q.upd_txn, {
            **keyp, "old_version": old.version, "state": new.state.value,
            "reason": new.reason,
            "decided_at": new.decided_at, "finished_at": new.finished_at,
            "updated": now, "alert": False, "version": new.version,
        })
        if cur.rowcount != 1:
            raise Conflict(f"lost a compare-and-set on {new.key}")
        before = old.branches
        changed = [{**keyp, "idx": i, "state": encode_branch(b)}
                   for i, (bid, b) in enumerate(new.branches.items())
                   if before.get(bid) is not b]
        if len(changed) == 1:
            run(conn, self.q.upd_branch, changed[0])
        elif changed:
            run(conn, self.q.upd_branch, changed, many=True)

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

    def list_txns(
        self,
        conn: Connection,
        sink: str | None,
        state: str | None,
        limit: int,
        alert: bool | None,
    ) -> list[tuple[p.Transaction, bool, float]]:
        """(transaction, alert flag, last update), newest first: the page of
        transactions joined with their branch rows in one statement (one snapshot, one
        round trip per page, not one per transaction); the join follows the branches'
        primary key, whose leading columns are the transaction's key."""
        t, b = s.txns, s.branches
        page = select(*(t.c[c] for c in TXN_COLS))
        if sink is not None:
            page = page.where(t.c.sink == sink)
        if state is not None:
            page = page.where(t.c.state == p.State(state).value)
        if alert is not None:
            page = page.where(t.c.alert == alert)
        pg = page.order_by(t.c.created.desc(), t.c.attempt.desc()).limit(limit).subquery()
        on = and_(*(b.c[k] == pg.c[k] for k in ("sink", "lineage", "checkpoint", "attempt")))
        q = (select(*(pg.c[c] for c in TXN_COLS), b.c.branch, b.c.state.label("branch_state"))
             .select_from(pg.outerjoin(b, on))
             .order_by(pg.c.created.desc(), pg.c.attempt.desc(), pg.c.sink, pg.c.lineage,
                       pg.c.checkpoint, b.c.idx))
        found: dict[tuple[Any, ...], tuple[Any, dict[str, p.BranchState]]] = {}
        for r in conn.execute(q):
            key = tuple(r[:4])
            if key not in found:
                found[key] = (r, {})
            if r.branch is not None:  # a transaction has branches; the outer join is a guard
                found[key][1][r.branch] = wire.decode_branch(
                    json.loads(r.branch_state), f"{b.name}.{r.branch}")
        return [(to_txn(r, MappingProxyType(branches)), bool(r.alert), r.updated)
                for r, branches in found.values()]

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
