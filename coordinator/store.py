"""The durable decision log: SQLAlchemy Core over SQLite (default) or PostgreSQL.

Every change follows one pattern, inside one database transaction: load the row(s), feed
the event(s) to the pure state machine in :mod:`twophase.protocol`, then write the result
with ``UPDATE ... WHERE version = :old`` (compare-and-set). When the UPDATE hits no row
another writer (a second replica) got there first: roll back, reload, run the machine
again. No protocol rule lives here; this module only loads, stores and retries.

SQLite: WAL, ``synchronous=FULL``, a busy timeout, ``BEGIN IMMEDIATE`` for writes, and an
in-process lock so that the single writer never spins on SQLITE_BUSY. PostgreSQL: psycopg 3,
several coordinator replicas may share one database; the CAS makes them agree.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    and_,
    bindparam,
    create_engine,
    delete,
    event,
    func,
    insert,
    inspect,
    select,
    update,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from coordinator import schema as s
from twophase import failpoints
from twophase import protocol as p

__all__ = [
    "Listed",
    "SchemaMismatch",
    "Store",
    "StoreError",
    "TxnKey",
    "TxnNotFound",
    "normalize_url",
]

log = logging.getLogger("twophase.coordinator.store")

TxnKey = tuple[str, str, int, int]
T = TypeVar("T")

_MAX_RETRIES: Final = 50


class StoreError(Exception):
    """The store cannot do what was asked (bad URL, schema mismatch, persistent conflict)."""


class SchemaMismatch(StoreError):
    pass


class TxnNotFound(StoreError, KeyError):
    def __init__(self, key: TxnKey) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        sink, lineage, ckpt, attempt = self.key
        return (
            f"no transaction sink={sink!r} lineage={lineage!r} checkpoint={ckpt} "
            f"attempt={attempt}"
        )


class _Conflict(Exception):
    """A compare-and-set found a newer version: reload and try again."""


@dataclass(frozen=True)
class Listed:
    """A transaction as listings show it, with the operational alert flag."""

    txn: p.Transaction
    alert: bool
    updated: float


def normalize_url(url: str) -> str:
    """Accept ``postgresql://`` / ``postgres://`` and pick psycopg 3; check SQLite URLs."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url[len("postgresql://") :]
    if url.startswith("postgresql+psycopg://"):
        return url
    if url.startswith("sqlite:///"):
        db = url[len("sqlite:///") :].split("?")[0]
        if not db or db == ":memory:":
            raise ValueError(
                "an in-memory SQLite store is not a durable decision log; "
                "use sqlite:///relative/path.db or sqlite:////absolute/path.db"
            )
        return url
    raise ValueError(
        f"unsupported store URL {url!r}: use sqlite:///path.db, sqlite:////abs/path.db "
        "or postgresql://user@host:port/db"
    )


# ---------------------------------------------------------------------------------------
# prepared statements (built once; SQLAlchemy caches their compiled form)

_T, _B, _E = s.txns, s.branches, s.events


def _key_where(table: Any) -> Any:
    return and_(
        table.c.sink == bindparam("k_sink"),
        table.c.lineage == bindparam("k_lineage"),
        table.c.checkpoint == bindparam("k_checkpoint"),
        table.c.attempt == bindparam("k_attempt"),
    )


_SEL_TXN: Final = select(_T).where(_key_where(_T))
_SEL_BRANCHES: Final = select(_B.c.branch, _B.c.vote, _B.c.handle, _B.c.reason, _B.c.ack).where(
    _key_where(_B)
)
_SEL_ATTEMPTS: Final = (
    select(_T)
    .where(
        _T.c.sink == bindparam("k_sink"),
        _T.c.lineage == bindparam("k_lineage"),
        _T.c.checkpoint == bindparam("k_checkpoint"),
    )
    .order_by(_T.c.attempt)
)
_UPD_TXN: Final = (
    update(_T)
    .where(_key_where(_T), _T.c.version == bindparam("old_version"))
    .values(
        state=bindparam("state"),
        reason=bindparam("reason"),
        decided_at=bindparam("decided_at"),
        finished_at=bindparam("finished_at"),
        updated=bindparam("updated"),
        alert=bindparam("alert"),
        version=bindparam("version"),
    )
)
_UPD_BRANCH: Final = (
    update(_B)
    .where(_key_where(_B), _B.c.branch == bindparam("k_branch"))
    .values(
        vote=bindparam("vote"),
        handle=bindparam("handle"),
        reason=bindparam("reason"),
        ack=bindparam("ack"),
    )
)
_SEL_SINK: Final = select(s.sinks).where(s.sinks.c.name == bindparam("k_name"))
_UPD_SINK: Final = (
    update(s.sinks)
    .where(s.sinks.c.name == bindparam("k_name"), s.sinks.c.version == bindparam("old_version"))
    .values(
        epoch=bindparam("epoch"),
        lineage=bindparam("lineage"),
        last_committed=bindparam("last_committed"),
        version=bindparam("version"),
    )
)


def _kp(key: TxnKey) -> dict[str, Any]:
    return {"k_sink": key[0], "k_lineage": key[1], "k_checkpoint": key[2], "k_attempt": key[3]}


def _dec(v: str | None) -> p.Decision | None:
    return p.Decision(v) if v is not None else None


def _branch_values(b: p.BranchState) -> dict[str, Any]:
    return {
        "vote": b.vote.value if b.vote else None,
        "handle": json.dumps(dict(b.handle), sort_keys=True) if b.handle is not None else None,
        "reason": b.reason,
        "ack": b.ack.value if b.ack else None,
    }


def _to_txn(row: Any, brows: Sequence[Any]) -> p.Transaction:
    branches = {
        b.branch: p.BranchState(
            vote=_dec(b.vote),
            handle=MappingProxyType(json.loads(b.handle)) if b.handle is not None else None,
            reason=b.reason,
            ack=_dec(b.ack),
        )
        for b in brows
    }
    return p.Transaction(
        sink=row.sink,
        lineage=row.lineage,
        checkpoint=row.checkpoint,
        attempt=row.attempt,
        epoch=row.epoch,
        partitions=row.partitions,
        branches=MappingProxyType(branches),
        deadline=row.deadline,
        state=p.State(row.state),
        reason=row.reason,
        created=row.created,
        decided_at=row.decided_at,
        finished_at=row.finished_at,
        version=row.version,
    )


def _event_detail(ev: p.Event | p.Begin) -> tuple[str, str | None, dict[str, Any]]:
    if isinstance(ev, p.Vote):
        return "vote", ev.branch, {"yes": ev.yes, "epoch": ev.epoch, "reason": ev.reason}
    if isinstance(ev, p.Ack):
        return "ack", ev.branch, {"outcome": ev.outcome.value, "epoch": ev.epoch}
    if isinstance(ev, p.ForceAck):
        return "force_ack", ev.branch, {"outcome": ev.outcome.value}
    if isinstance(ev, p.Abandon):
        return "abandon", None, {"reason": ev.reason, "epoch": ev.epoch}
    if isinstance(ev, p.Begin):
        return "begin", None, {"epoch": ev.epoch, "partitions": ev.partitions}
    return "expire", None, {}


Change = tuple[p.Transaction | None, p.Transaction]  # (before, after)


class Store:
    """The decision log. Thread-safe; one instance per process and URL is enough.

    ``on_change(before, after)`` is called (outside any database transaction) for every
    transaction a call changed, once the change is durable; the service uses it to wake
    long-polls and count metrics.
    """

    def __init__(
        self,
        url: str,
        *,
        create: bool = True,
        on_change: Callable[[p.Transaction | None, p.Transaction], None] | None = None,
        clock: Callable[[], float] = time.time,
        pool_size: int = 8,
    ) -> None:
        self.url = normalize_url(url)
        self.clock = clock
        self.on_change = on_change
        self.is_sqlite = self.url.startswith("sqlite")
        if self.is_sqlite:
            self.engine = self._sqlite_engine(immediate=True)
            self.read_engine = self._sqlite_engine(immediate=False)
            self._write_lock: contextlib.AbstractContextManager[Any] = threading.Lock()
        else:
            self.engine = create_engine(
                self.url, pool_size=pool_size, max_overflow=pool_size * 2, pool_pre_ping=False
            )
            self.read_engine = self.engine
            self._write_lock = contextlib.nullcontext()
        self._check_schema(create)

    # ----------------------------------------------------------------- setup

    def _sqlite_engine(self, *, immediate: bool) -> Engine:
        eng = create_engine(
            self.url, connect_args={"timeout": 30.0, "check_same_thread": False}
        )

        @event.listens_for(eng, "connect")
        def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(eng, "begin")
        def _on_begin(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return eng

    def _check_schema(self, create: bool) -> None:
        with self._write_lock, self.engine.begin() as conn:
            present = inspect(conn).has_table(s.meta.name)
            if not present:
                if not create:
                    raise SchemaMismatch(f"store {self.safe_url} has no twophase schema")
                s.metadata.create_all(conn)
                conn.execute(
                    insert(s.meta).values(key="schema_version", value=str(s.SCHEMA_VERSION))
                )
                return
            row = conn.execute(
                select(s.meta.c.value).where(s.meta.c.key == "schema_version")
            ).first()
            found = row[0] if row else None
            if found != str(s.SCHEMA_VERSION):
                raise SchemaMismatch(
                    f"store {self.safe_url} has schema version {found}, this coordinator "
                    f"needs {s.SCHEMA_VERSION}; use a matching twophase version"
                )

    @property
    def safe_url(self) -> str:
        return make_url(self.url).render_as_string(hide_password=True)

    def close(self) -> None:
        self.engine.dispose()
        if self.read_engine is not self.engine:
            self.read_engine.dispose()

    # ----------------------------------------------------------------- plumbing

    def _write(self, fn: Callable[[Connection], tuple[T, list[Change]]]) -> T:
        """Run ``fn`` in one write transaction; retry on CAS conflict or a lost race."""
        for attempt in range(_MAX_RETRIES):
            try:
                with self._write_lock, self.engine.begin() as conn:
                    result, changes = fn(conn)
                break
            except (_Conflict, IntegrityError) as exc:
                if attempt == _MAX_RETRIES - 1:
                    raise StoreError(f"gave up after {_MAX_RETRIES} conflicting writes") from exc
                time.sleep(min(0.001 * 2**attempt, 0.05))
            except OperationalError as exc:
                # a dropped connection or a deadlock: the transaction did not commit
                if attempt == _MAX_RETRIES - 1 or not _transient(exc):
                    raise
                time.sleep(min(0.01 * 2**attempt, 0.5))
        decided = False
        for before, after in changes:
            if after.decision is not None and (before is None or before.decision is None):
                decided = True
                log.info(
                    "decision",
                    extra={"txn": list(after.key), "decision": after.decision.value,
                           "reason": after.reason},
                )
        if decided:
            failpoints.hit("after_decision")
        if self.on_change is not None:
            for before, after in changes:
                self.on_change(before, after)
        return result

    @staticmethod
    def _load(conn: Connection, key: TxnKey) -> p.Transaction | None:
        kp = _kp(key)
        row = conn.execute(_SEL_TXN, kp).first()
        if row is None:
            return None
        return _to_txn(row, conn.execute(_SEL_BRANCHES, kp).all())

    def _persist(
        self,
        conn: Connection,
        old: p.Transaction | None,
        new: p.Transaction,
        evs: Sequence[tuple[p.Event | p.Begin, p.Transaction]],
    ) -> None:
        now = self.clock()
        kp = _kp(new.key)
        if old is None:
            conn.execute(
                insert(_T),
                {
                    "sink": new.sink, "lineage": new.lineage, "checkpoint": new.checkpoint,
                    "attempt": new.attempt, "epoch": new.epoch, "partitions": new.partitions,
                    "branch_count": len(new.branches), "state": new.state.value,
                    "reason": new.reason, "deadline": new.deadline, "created": new.created,
                    "decided_at": new.decided_at, "finished_at": new.finished_at,
                    "updated": now, "alert": False, "version": new.version,
                },
            )
            rows = []
            for bid, b in new.branches.items():
                participant, partition = p.parse_branch_id(bid)
                rows.append({
                    "sink": new.sink, "lineage": new.lineage, "checkpoint": new.checkpoint,
                    "attempt": new.attempt, "branch": bid, "participant": participant,
                    "partition": partition, **_branch_values(b),
                })
            conn.execute(insert(_B), rows)
        else:
            if new.decision is not None and old.decision is None:
                failpoints.hit("coordinator_before_decision")
            res = conn.execute(
                _UPD_TXN,
                {
                    **kp, "old_version": old.version, "state": new.state.value,
                    "reason": new.reason, "decided_at": new.decided_at,
                    "finished_at": new.finished_at, "updated": now,
                    "alert": False, "version": new.version,
                },
            )
            if res.rowcount != 1:
                raise _Conflict(new.key)
            changed = [
                {**kp, "k_branch": bid, **_branch_values(b)}
                for bid, b in new.branches.items()
                if old.branches.get(bid) != b
            ]
            if changed:
                conn.execute(_UPD_BRANCH, changed)
        if evs:
            hist = []
            for ev, after in evs:
                kind, branch, detail = _event_detail(ev)
                hist.append({
                    "sink": new.sink, "lineage": new.lineage, "checkpoint": new.checkpoint,
                    "attempt": new.attempt, "at": now, "kind": kind, "branch": branch,
                    "detail": json.dumps(detail), "state": after.state.value,
                })
            conn.execute(insert(_E), hist)

    @staticmethod
    def _load_sink(conn: Connection, name: str) -> tuple[p.SinkRecord | None, int]:
        row = conn.execute(_SEL_SINK, {"k_name": name}).first()
        if row is None:
            return None, 0
        rec = p.SinkRecord(
            name=row.name, epoch=row.epoch, lineage=row.lineage,
            last_committed=row.last_committed,
        )
        return rec, row.version

    @staticmethod
    def _save_sink(
        conn: Connection, old: p.SinkRecord | None, version: int, new: p.SinkRecord
    ) -> None:
        if old is None:
            conn.execute(
                insert(s.sinks),
                {"name": new.name, "epoch": new.epoch, "lineage": new.lineage,
                 "last_committed": new.last_committed, "version": 1},
            )
            return
        res = conn.execute(
            _UPD_SINK,
            {"k_name": new.name, "old_version": version, "epoch": new.epoch,
             "lineage": new.lineage, "last_committed": new.last_committed,
             "version": version + 1},
        )
        if res.rowcount != 1:
            raise _Conflict(new.name)

    # ----------------------------------------------------------------- protocol calls

    def register(self, name: str) -> p.SinkRecord:
        """Hand out the sink's next writer epoch (fences every older writer)."""

        def tx(conn: Connection) -> tuple[p.SinkRecord, list[Change]]:
            old, version = self._load_sink(conn, name)
            new = p.register(old, name)
            self._save_sink(conn, old, version, new)
            return new, []

        return self._write(tx)

    def begin(self, req: p.Begin) -> p.BeginResult:
        def tx(conn: Connection) -> tuple[p.BeginResult, list[Change]]:
            sink, version = self._load_sink(conn, req.sink)
            rows = conn.execute(
                _SEL_ATTEMPTS,
                {"k_sink": req.sink, "k_lineage": req.lineage, "k_checkpoint": req.checkpoint},
            ).all()
            attempts = tuple(
                _to_txn(r, conn.execute(_SEL_BRANCHES, _kp(
                    (r.sink, r.lineage, r.checkpoint, r.attempt))).all())
                for r in rows
            )
            res = p.begin(sink, attempts, req)
            if res.sink != sink:
                self._save_sink(conn, sink, version, res.sink)
            by_attempt = {a.attempt: a for a in attempts}
            changes: list[Change] = []
            for t in res.changed:
                old = by_attempt.get(t.attempt)
                ev: p.Event | p.Begin = req
                if old is not None:
                    ev = p.Abandon(epoch=req.epoch, reason=t.reason or "abandoned", now=req.now)
                self._persist(conn, old, t, [(ev, t)])
                changes.append((old, t))
            return res, changes

        return self._write(tx)

    def apply(self, key: TxnKey, events: Sequence[p.Event]) -> p.Transaction:
        """Apply events to one transaction, all or nothing, in one database transaction.

        Raises :class:`TxnNotFound` or the machine's :class:`~twophase.protocol.ProtocolError`.
        """

        def tx(conn: Connection) -> tuple[p.Transaction, list[Change]]:
            old = self._load(conn, key)
            if old is None:
                raise TxnNotFound(key)
            new = old
            applied: list[tuple[p.Event | p.Begin, p.Transaction]] = []
            for ev in events:
                nxt = p.handle(new, ev)
                if nxt is not new:
                    applied.append((ev, nxt))
                    new = nxt
            if new is old:
                return old, []
            self._persist(conn, old, new, applied)
            if new.state == p.State.COMMITTED:
                sink, version = self._load_sink(conn, new.sink)
                if sink is not None:
                    advanced = p.committed(sink, new)
                    if advanced != sink:
                        self._save_sink(conn, sink, version, advanced)
            return new, [(old, new)]

        return self._write(tx)

    # ----------------------------------------------------------------- reads

    @contextlib.contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.read_engine.connect() as conn:
            yield conn
            conn.rollback()

    def get(self, key: TxnKey) -> p.Transaction | None:
        with self._read() as conn:
            return self._load(conn, key)

    def sink(self, name: str) -> p.SinkRecord | None:
        with self._read() as conn:
            return self._load_sink(conn, name)[0]

    def list(
        self,
        sink: str | None = None,
        state: str | None = None,
        limit: int = 100,
        *,
        alert: bool | None = None,
    ) -> builtins.list[Listed]:
        """Newest first. ``state`` is a protocol state name (or ``ALERT`` via ``alert``)."""
        q = select(_T)
        if sink is not None:
            q = q.where(_T.c.sink == sink)
        if state is not None:
            q = q.where(_T.c.state == p.State(state).value)
        if alert is not None:
            q = q.where(_T.c.alert == alert)
        q = q.order_by(_T.c.created.desc(), _T.c.attempt.desc()).limit(limit)
        out = []
        with self._read() as conn:
            for r in conn.execute(q).all():
                brows = conn.execute(
                    _SEL_BRANCHES, _kp((r.sink, r.lineage, r.checkpoint, r.attempt))
                ).all()
                out.append(Listed(_to_txn(r, brows), bool(r.alert), r.updated))
        return out

    def history(self, key: TxnKey) -> builtins.list[dict[str, Any]]:
        """The event history of one transaction, oldest first."""
        q = select(_E).where(_key_where(_E)).order_by(_E.c.id)
        with self._read() as conn:
            return [
                {"at": r.at, "kind": r.kind, "branch": r.branch,
                 "detail": json.loads(r.detail) if r.detail else None, "state": r.state}
                for r in conn.execute(q, _kp(key)).all()
            ]

    def stats(self, now: float | None = None) -> dict[str, Any]:
        """Counts by state, alerts, and the age of the oldest in-doubt transaction."""
        now = self.clock() if now is None else now
        with self._read() as conn:
            counts = {
                st: n
                for st, n in conn.execute(select(_T.c.state, func.count()).group_by(_T.c.state))
            }
            in_doubt_states = (p.State.COMMITTING.value, p.State.ABORTING.value)
            oldest = conn.execute(
                select(func.min(_T.c.decided_at)).where(_T.c.state.in_(in_doubt_states))
            ).scalar()
            alerts = conn.execute(
                select(func.count()).select_from(_T).where(_T.c.alert.is_(True))
            ).scalar()
        return {
            "by_state": {st.value: int(counts.get(st.value, 0)) for st in p.State},
            "in_doubt": sum(int(counts.get(x, 0)) for x in in_doubt_states),
            "oldest_in_doubt_age": max(0.0, now - oldest) if oldest is not None else 0.0,
            "alerts": int(alerts or 0),
        }

    # ----------------------------------------------------------------- background work

    def expire_due(
        self, now: float | None = None, limit: int = 500
    ) -> builtins.list[p.Transaction]:
        """Feed ``Expire`` to undecided transactions whose vote deadline passed."""
        now = self.clock() if now is None else now
        q = (
            select(_T.c.sink, _T.c.lineage, _T.c.checkpoint, _T.c.attempt)
            .where(
                _T.c.state.in_((p.State.OPEN.value, p.State.PREPARING.value)),
                _T.c.deadline <= now,
            )
            .limit(limit)
        )
        with self._read() as conn:
            keys = [tuple(r) for r in conn.execute(q).all()]
        out = []
        for key in keys:
            try:
                out.append(self.apply(key, [p.Expire(now=now)]))
            except TxnNotFound:
                continue  # purged meanwhile by another replica
        return out

    def mark_alerts(self, now: float, alert_after: float) -> int:
        """Flag decided transactions whose branches have not all acknowledged in time."""
        stmt = (
            update(_T)
            .where(
                _T.c.state.in_((p.State.COMMITTING.value, p.State.ABORTING.value)),
                _T.c.decided_at <= now - alert_after,
                _T.c.alert.is_(False),
            )
            .values(alert=True)
        )
        with self._write_lock, self.engine.begin() as conn:
            n = conn.execute(stmt).rowcount
        if n:
            log.warning("alert", extra={"transactions": n, "alert_after": alert_after})
        return int(n)

    def purge(self, cutoff: float, limit: int = 1000) -> int:
        """Delete finished transactions older than ``cutoff`` that a replay can no longer need.

        A finished attempt goes only when its checkpoint is at or below the sink's
        ``last_committed`` for the current lineage, or its lineage is no longer current: a
        replay of such a checkpoint is answered from the sink row. Aborted attempts of a
        checkpoint not yet committed stay, so attempt numbers are never reused.
        """
        sk = s.sinks
        q = (
            select(_T.c.sink, _T.c.lineage, _T.c.checkpoint, _T.c.attempt)
            .join(sk, sk.c.name == _T.c.sink)
            .where(
                _T.c.state.in_((p.State.COMMITTED.value, p.State.ABORTED.value)),
                _T.c.finished_at < cutoff,
                (sk.c.lineage != _T.c.lineage) | (_T.c.checkpoint <= sk.c.last_committed),
            )
            .limit(limit)
        )
        with self._read() as conn:
            keys = [tuple(r) for r in conn.execute(q).all()]
        if not keys:
            return 0
        params = [_kp(k) for k in keys]
        with self._write_lock, self.engine.begin() as conn:
            conn.execute(delete(_E).where(_key_where(_E)), params)
            conn.execute(delete(_B).where(_key_where(_B)), params)
            conn.execute(delete(_T).where(_key_where(_T)), params)
        log.info("purged", extra={"transactions": len(keys)})
        return len(keys)

    def force(self, key: TxnKey, branch: str, outcome: p.Decision) -> p.Transaction:
        """Admin: state that a branch is settled (see :class:`twophase.protocol.ForceAck`)."""
        return self.apply(key, [p.ForceAck(branch=branch, outcome=outcome, now=self.clock())])


def _transient(exc: DBAPIError) -> bool:
    msg = str(exc.orig).lower() if exc.orig is not None else str(exc).lower()
    return exc.connection_invalidated or any(
        w in msg for w in ("deadlock", "database is locked", "could not serialize", "closed")
    )

