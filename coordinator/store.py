"""The durable decision log: SQLAlchemy Core over SQLite (default) or PostgreSQL.

Every change follows one pattern, inside one database transaction: load the row(s), feed
the event(s) to the pure state machine in :mod:`twophase.protocol`, then write the result
with ``UPDATE ... WHERE version = :old`` (compare-and-set). When the UPDATE hits no row
another writer (a second replica) got there first: roll back, reload, run the machine
again. No protocol rule lives here; this module only loads, stores and retries.

Writes go through *group commit*: one writer thread per Store runs every request queued
meanwhile inside one database transaction (each in its own SAVEPOINT, so a refusal only
undoes that request) and one commit (one fsync), and answers each request after that
commit. A request whose CAS lost to another replica, or that hit a transient error, is
run again on its own (the classic retry loop), as is every request of a group whose
commit failed. SQLite: WAL, ``synchronous=FULL``, a busy timeout, ``BEGIN IMMEDIATE`` for
writes, and an in-process lock so that the single writer never spins on SQLITE_BUSY.
PostgreSQL: psycopg 3, several coordinator replicas may share one database; the CAS makes
them agree. ``group_commit=False`` runs each request in its own transaction instead.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, TypeVar

import anyio.to_thread
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

from twophase import failpoints
from twophase import protocol as p
from twophase.coordinator import schema as s
from twophase.errors import SchemaMismatch, StoreError, TransactionNotFound
from twophase.protocol import TxnKey

__all__ = [
    "Listed",
    "Store",
    "normalize_url",
]

log = logging.getLogger("twophase.coordinator.store")

T = TypeVar("T")

_MAX_RETRIES: Final = 50


class _Conflict(StoreError):
    """A compare-and-set found a newer version: reload and try again."""


Change = tuple[p.Transaction | None, p.Transaction]  # (before, after)


@dataclass(eq=False)
class _Job:
    """One request waiting for the group-commit writer."""

    fn: Callable[[Connection], tuple[Any, list[Change]]]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    changes: list[Change] = field(default_factory=list)
    error: BaseException | None = None
    retry: bool = False  # a CAS conflict or a failed group commit: run again on its own
    notify: Callable[[], None] | None = None  # wakes an event-loop caller


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclass
class GroupStats:
    """How well group commit is batching (for the benchmark and tests)."""

    groups: int = 0
    jobs: int = 0
    largest: int = 0


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
# hot-path statements: plain SQL run on the driver's cursor (SQLAlchemy's per-statement
# bookkeeping cost ~0.25 ms, as much as SQLite itself); written with :name parameters and
# turned into psycopg's %(name)s form for PostgreSQL. Cold paths use SQLAlchemy Core.

_T, _E = s.txns, s.events

_TXN_COLS: Final = (
    "sink", "lineage", "checkpoint", "attempt", "epoch", "partitions", "branches", "state",
    "reason", "deadline", "created", "decided_at", "finished_at", "version", "alert",
    "updated",
)
_KEY_SQL: Final = (
    "sink = :k_sink AND lineage = :k_lineage AND checkpoint = :k_checkpoint "
    "AND attempt = :k_attempt"
)
_TXN_INS_COLS: Final = (*_TXN_COLS, "branch_count")
_EV_COLS: Final = ("sink", "lineage", "checkpoint", "attempt", "at", "kind", "branch", "detail",
                   "state")


def _ins(table: str, cols: Sequence[str]) -> str:
    return (f"INSERT INTO {table} ({', '.join(cols)}) "
            f"VALUES ({', '.join(':' + c for c in cols)})")


class _Sql:
    """The hot statements in one driver's parameter style."""

    def __init__(self, pyformat: bool) -> None:
        def q(text: str) -> str:
            return re.sub(r":(\w+)", r"%(\1)s", text) if pyformat else text

        cols = ", ".join(_TXN_COLS)
        t, sk = s.txns.name, s.sinks.name
        self.sel_txn = q(f"SELECT {cols} FROM {t} WHERE {_KEY_SQL}")
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


_SQL: Final = {False: _Sql(pyformat=False), True: _Sql(pyformat=True)}


def _key_where(table: Any) -> Any:
    return and_(
        table.c.sink == bindparam("k_sink"),
        table.c.lineage == bindparam("k_lineage"),
        table.c.checkpoint == bindparam("k_checkpoint"),
        table.c.attempt == bindparam("k_attempt"),
    )


def _run(conn: Connection, sql: str, params: Any, *, many: bool = False) -> Any:
    """Execute on the driver cursor; driver errors become SQLAlchemy's (retry logic keys on
    them) and a lost connection is invalidated so that the pool drops it."""
    dbapi_conn = conn.connection.dbapi_connection
    assert dbapi_conn is not None
    cur = dbapi_conn.cursor()
    try:
        if many:
            cur.executemany(sql, params)
        else:
            cur.execute(sql, params)
    except conn.dialect.loaded_dbapi.Error as exc:
        gone = conn.dialect.is_disconnect(exc, dbapi_conn, cur)
        wrapped = DBAPIError.instance(
            sql, params, exc, conn.dialect.loaded_dbapi.Error,
            connection_invalidated=gone, dialect=conn.dialect,
        )
        if gone:
            conn.invalidate(exc)
        raise wrapped from exc
    return cur


def _kp(key: TxnKey) -> dict[str, Any]:
    return {"k_sink": key[0], "k_lineage": key[1], "k_checkpoint": key[2], "k_attempt": key[3]}


def _dec(v: str | None) -> p.Decision | None:
    return p.Decision(v) if v is not None else None


def _encode_branches(branches: Mapping[str, p.BranchState]) -> str:
    out: dict[str, dict[str, Any]] = {}
    for bid, b in branches.items():
        d: dict[str, Any] = {}
        if b.vote is not None:
            d["vote"] = b.vote.value
        if b.handle is not None:
            d["handle"] = dict(b.handle)
        if b.reason is not None:
            d["reason"] = b.reason
        if b.ack is not None:
            d["ack"] = b.ack.value
        out[bid] = d
    return json.dumps(out, separators=(",", ":"))


def _decode_branches(text: str) -> Mapping[str, p.BranchState]:
    return MappingProxyType({
        bid: p.BranchState(
            vote=_dec(d.get("vote")),
            handle=MappingProxyType(d["handle"]) if d.get("handle") is not None else None,
            reason=d.get("reason"),
            ack=_dec(d.get("ack")),
        )
        for bid, d in json.loads(text).items()
    })


def _to_txn(row: Sequence[Any]) -> p.Transaction:
    """A row with the columns of ``_TXN_COLS``, in that order."""
    return p.Transaction(
        sink=row[0],
        lineage=row[1],
        batch_id=row[2],
        attempt=row[3],
        epoch=row[4],
        partitions=row[5],
        branches=_decode_branches(row[6]),
        state=p.State(row[7]),
        reason=row[8],
        deadline=row[9],
        created=row[10],
        decided_at=row[11],
        finished_at=row[12],
        version=row[13],
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
    if isinstance(ev, p.AdminAbort):
        return "admin_abort", None, {"reason": ev.reason}
    if isinstance(ev, p.Begin):
        return "begin", None, {"epoch": ev.epoch, "partitions": ev.partitions}
    return "expire", None, {}


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
        group_commit: bool = True,
        max_group: int = 512,
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
        self._sql = _SQL[not self.is_sqlite]
        self.group_commit = group_commit
        self.max_group = max_group
        self.group_stats = GroupStats()
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._writer_start = threading.Lock()
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
        with self._writer_start:
            writer, self._writer = self._writer, None
        if writer is not None:
            self._queue.put(None)
            writer.join(timeout=30)
        self.engine.dispose()
        if self.read_engine is not self.engine:
            self.read_engine.dispose()

    # ----------------------------------------------------------------- plumbing

    def _write(self, fn: Callable[[Connection], tuple[T, list[Change]]]) -> T:
        """Run ``fn`` in a write transaction (grouped on SQLite); report changes once durable."""
        if self.group_commit:
            job = _Job(fn)
            self._enqueue(job)
            job.done.wait()
            if job.error is not None:
                raise job.error
            if not job.retry:
                return job.result  # type: ignore[no-any-return]
        result, changes = self._write_alone(fn)
        self._after_commit(changes)
        return result

    async def _write_async(self, fn: Callable[[Connection], tuple[T, list[Change]]]) -> T:
        """:meth:`_write` for an event loop: with group commit it waits for the writer
        without holding a worker thread (the HTTP hot path); otherwise in a worker thread."""
        if self.group_commit:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()

            def wake() -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(_settle, fut)

            job = _Job(fn, notify=wake)
            self._enqueue(job)
            await fut
            if job.error is not None:
                raise job.error
            if not job.retry:
                return job.result  # type: ignore[no-any-return]
            return await anyio.to_thread.run_sync(self._write_retry, fn)
        return await anyio.to_thread.run_sync(self._write, fn)

    def _write_retry(self, fn: Callable[[Connection], tuple[T, list[Change]]]) -> T:
        result, changes = self._write_alone(fn)
        self._after_commit(changes)
        return result

    # group commit (SQLite): one writer thread, one transaction and one fsync per group

    def _enqueue(self, job: _Job) -> None:
        if self._writer is None:
            with self._writer_start:
                if self._writer is None:
                    self._writer = threading.Thread(
                        target=self._writer_loop, name="twophase-store-writer", daemon=True
                    )
                    self._writer.start()
        self._queue.put(job)

    def _writer_loop(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.max_group:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stopping = True
                    break
                batch.append(nxt)
            try:
                self._run_group(batch)
                for job in batch:  # durable now: wake long-polls, then answer
                    if job.error is None and not job.retry:
                        try:
                            self._after_commit(job.changes)
                        except BaseException as exc:  # e.g. a failpoint: that request only
                            job.error = exc
            finally:
                for job in batch:
                    job.done.set()
                    if job.notify is not None:
                        job.notify()

    def _run_group(self, batch: Sequence[_Job]) -> None:
        """Each job in its own SAVEPOINT of one transaction; a failing job undoes only itself."""
        try:
            with self._write_lock, self.engine.begin() as conn:
                for job in batch:
                    _run(conn, "SAVEPOINT twophase_job", ())
                    try:
                        job.result, job.changes = job.fn(conn)
                    except BaseException as exc:
                        _run(conn, "ROLLBACK TO twophase_job", ())
                        if isinstance(exc, (_Conflict, IntegrityError)) or (
                            isinstance(exc, OperationalError) and _transient(exc)
                        ):
                            job.retry = True
                        else:
                            job.error = exc  # handed to that request alone
                    _run(conn, "RELEASE twophase_job", ())
        except Exception:  # BEGIN or COMMIT failed: nothing of the group is durable
            log.warning("group commit failed; retrying its requests one by one",
                        exc_info=True)
            for job in batch:
                job.result, job.changes, job.error, job.retry = None, [], None, True
            return
        st = self.group_stats
        st.groups += 1
        st.jobs += len(batch)
        st.largest = max(st.largest, len(batch))

    def _write_alone(
        self, fn: Callable[[Connection], tuple[T, list[Change]]]
    ) -> tuple[T, list[Change]]:
        """Run ``fn`` in its own write transaction; retry on CAS conflict or a lost race."""
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
        return result, changes

    def _after_commit(self, changes: Sequence[Change]) -> None:
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

    def _load(self, conn: Connection, key: TxnKey) -> p.Transaction | None:
        row = _run(conn, self._sql.sel_txn, _kp(key)).fetchone()
        return None if row is None else _to_txn(row)

    def _persist(
        self,
        conn: Connection,
        old: p.Transaction | None,
        new: p.Transaction,
        evs: Sequence[tuple[p.Event | p.Begin, p.Transaction]],
    ) -> None:
        now = self.clock()
        if old is None:
            _run(conn, self._sql.ins_txn, {
                "sink": new.sink, "lineage": new.lineage, "checkpoint": new.batch_id,
                "attempt": new.attempt, "epoch": new.epoch, "partitions": new.partitions,
                "branches": _encode_branches(new.branches), "state": new.state.value,
                "reason": new.reason, "deadline": new.deadline, "created": new.created,
                "decided_at": new.decided_at, "finished_at": new.finished_at,
                "version": new.version, "alert": False, "updated": now,
                "branch_count": len(new.branches),
            })
        else:
            if new.decision is not None and old.decision is None:
                failpoints.hit("coordinator_before_decision")
            cur = _run(conn, self._sql.upd_txn, {
                **_kp(new.key), "old_version": old.version, "state": new.state.value,
                "reason": new.reason, "branches": _encode_branches(new.branches),
                "decided_at": new.decided_at, "finished_at": new.finished_at,
                "updated": now, "alert": False, "version": new.version,
            })
            if cur.rowcount != 1:
                raise _Conflict(f"lost a compare-and-set on {new.key}")
        if evs:
            hist = []
            for ev, after in evs:
                kind, branch, detail = _event_detail(ev)
                hist.append({
                    "sink": new.sink, "lineage": new.lineage, "checkpoint": new.batch_id,
                    "attempt": new.attempt, "at": now, "kind": kind, "branch": branch,
                    "detail": json.dumps(detail), "state": after.state.value,
                })
            if len(hist) == 1:
                _run(conn, self._sql.ins_event, hist[0])
            else:
                _run(conn, self._sql.ins_event, hist, many=True)

    def _load_sink(self, conn: Connection, name: str) -> tuple[p.SinkRecord | None, int]:
        row = _run(conn, self._sql.sel_sink, {"k_name": name}).fetchone()
        if row is None:
            return None, 0
        rec = p.SinkRecord(name=row[0], epoch=row[1], lineage=row[2], last_committed=row[3])
        return rec, int(row[4])

    def _save_sink(
        self, conn: Connection, old: p.SinkRecord | None, version: int, new: p.SinkRecord
    ) -> None:
        if old is None:
            _run(conn, self._sql.ins_sink,
                 {"name": new.name, "epoch": new.epoch, "lineage": new.lineage,
                  "last_committed": new.last_committed, "version": 1})
            return
        cur = _run(conn, self._sql.upd_sink,
                   {"k_name": new.name, "old_version": version, "epoch": new.epoch,
                    "lineage": new.lineage, "last_committed": new.last_committed,
                    "version": version + 1})
        if cur.rowcount != 1:
            raise _Conflict(f"lost a compare-and-set on sink {new.name}")

    # ----------------------------------------------------------------- protocol calls

    def register(self, name: str) -> p.SinkRecord:
        """Hand out the sink's next writer epoch (fences every older writer)."""
        return self._write(self._register_tx(name))

    async def register_async(self, name: str) -> p.SinkRecord:
        return await self._write_async(self._register_tx(name))

    def _register_tx(self, name: str) -> Callable[[Connection], tuple[p.SinkRecord, list[Change]]]:
        def tx(conn: Connection) -> tuple[p.SinkRecord, list[Change]]:
            old, version = self._load_sink(conn, name)
            new = p.register(old, name)
            self._save_sink(conn, old, version, new)
            return new, []

        return tx

    def begin(self, req: p.Begin) -> p.BeginResult:
        return self._write(self._begin_tx(req))

    async def begin_async(self, req: p.Begin) -> p.BeginResult:
        return await self._write_async(self._begin_tx(req))

    def _begin_tx(self, req: p.Begin) -> Callable[[Connection], tuple[p.BeginResult, list[Change]]]:
        def tx(conn: Connection) -> tuple[p.BeginResult, list[Change]]:
            sink, version = self._load_sink(conn, req.sink)
            rows = _run(
                conn, self._sql.sel_attempts,
                {"k_sink": req.sink, "k_lineage": req.lineage, "k_checkpoint": req.batch_id},
            ).fetchall()
            attempts = tuple(_to_txn(r) for r in rows)
            elsewhere: tuple[p.Transaction, ...] = ()
            if sink is not None and sink.lineage not in (None, req.lineage):
                others = _run(
                    conn, self._sql.sel_committing_other,
                    {"k_sink": req.sink, "k_lineage": req.lineage},
                ).fetchall()
                elsewhere = tuple(_to_txn(r) for r in others)
            res = p.begin(sink, attempts, req, committing_elsewhere=elsewhere)
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

        return tx

    def apply(self, key: TxnKey, events: Sequence[p.Event]) -> p.Transaction:
        """Apply events to one transaction, all or nothing, in one database transaction.

        Raises :class:`~twophase.errors.TransactionNotFound`, or the machine's
        :class:`~twophase.errors.ProtocolError`.
        """
        return self._write(self._apply_tx(key, events))

    async def apply_async(self, key: TxnKey, events: Sequence[p.Event]) -> p.Transaction:
        """:meth:`apply` for the service's event loop."""
        return await self._write_async(self._apply_tx(key, events))

    def _apply_tx(
        self, key: TxnKey, events: Sequence[p.Event]
    ) -> Callable[[Connection], tuple[p.Transaction, list[Change]]]:
        def tx(conn: Connection) -> tuple[p.Transaction, list[Change]]:
            old = self._load(conn, key)
            if old is None:
                raise TransactionNotFound.for_key(key)
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

        return tx

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
        q = select(*(_T.c[c] for c in _TXN_COLS))
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
                out.append(Listed(_to_txn(r), bool(r.alert), r.updated))
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
            keys = [TxnKey(*r) for r in conn.execute(q).all()]
        out = []
        for key in keys:
            try:
                out.append(self.apply(key, [p.Expire(now=now)]))
            except TransactionNotFound:
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
            keys = [TxnKey(*r) for r in conn.execute(q).all()]
        if not keys:
            return 0
        params = [_kp(k) for k in keys]
        with self._write_lock, self.engine.begin() as conn:
            conn.execute(delete(_E).where(_key_where(_E)), params)
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

