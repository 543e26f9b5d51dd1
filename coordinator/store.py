"""The durable decision log: every change is protocol + compare-and-set, durably.

Every change follows one pattern, inside one database transaction: load the row(s)
(:mod:`~twophase.coordinator.sql`), feed the event(s) to the pure state machine in
:mod:`twophase.protocol`, then write the result with ``UPDATE ... WHERE version = :old``.
When the UPDATE hits no row, another writer (a second replica) got there first: the
writer (:mod:`~twophase.coordinator.groupcommit`) rolls back and runs the change again.
No protocol rule lives here; this module only loads, calls the machine and stores.

Writes go through group commit (``group_commit=False``: one transaction per request);
``on_change`` hears of every changed transaction once the change is durable.
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Connection

from twophase import failpoints
from twophase import protocol as p
from twophase.coordinator import maintenance
from twophase.coordinator import schema as s
from twophase.coordinator.db import Database, normalize_url
from twophase.coordinator.groupcommit import GroupCommitWriter, GroupStats
from twophase.coordinator.sql import Rows
from twophase.errors import TransactionNotFound
from twophase.names import validate_name
from twophase.protocol import TxnKey

__all__ = [
    "Listed",
    "Store",
    "normalize_url",
]

log = logging.getLogger("twophase.coordinator.store")

T = TypeVar("T")

Change = tuple[p.Transaction | None, p.Transaction]  # (before, after)
Tx = Callable[[Connection], tuple[T, list[Change]]]  # one change: its answer and what moved


@dataclass(frozen=True)
class Listed:
    """A transaction as listings show it, with the operational alert flag."""

    txn: p.Transaction
    alert: bool
    updated: float


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
        read_only: bool = False,
    ) -> None:
        self.db = Database(url, pool_size=pool_size, create=create and not read_only,
                           read_only=read_only)
        self.url = self.db.url
        self.is_sqlite = self.db.is_sqlite
        self.engine = self.db.engine
        self.read_engine = self.db.read_engine
        self.clock = clock
        self.on_change = on_change
        self.rows = Rows(pyformat=self.db.pyformat)
        self.writes = GroupCommitWriter(
            self.db, after_commit=self._durable, grouped=group_commit, max_group=max_group
        )
        try:
            if read_only:  # check the schema only, in a read-only transaction
                with self.db.read() as conn:
                    s.ensure(conn, create=False, where=self.safe_url)
                return
            with self.db.write() as conn:
                s.ensure(conn, create=create, where=self.safe_url)
        except BaseException:
            self.close()  # a store that is not up yet: no writer thread or pool left behind
            raise

    @property
    def safe_url(self) -> str:
        return self.db.safe_url

    @property
    def group_stats(self) -> GroupStats:
        return self.writes.stats

    def close(self) -> None:
        self.writes.close()
        self.db.close()

    # ----------------------------------------------------------------- plumbing

    def _write(self, fn: Tx[T]) -> T:
        """Run one change in a write transaction; answer once it is durable."""
        result, _changes = self.writes.write(fn)
        return result

    async def _write_async(self, fn: Tx[T]) -> T:
        """:meth:`_write` for the service's event loop."""
        result, _changes = await self.writes.write_async(fn)
        return result

    def _durable(self, out: tuple[Any, Sequence[Change]]) -> None:
        """The writer's hook: a change is durable, tell the log and ``on_change``."""
        changes = out[1]
        decided = False
        for _before, after in changes:
            self.rows.remember(after)
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

    def _persist(
        self,
        conn: Connection,
        old: p.Transaction | None,
        new: p.Transaction,
        evs: Sequence[tuple[p.Event | p.Begin, p.State]],
    ) -> None:
        now = self.clock()
        if old is None:
            self.rows.insert_txn(conn, new, now)
        else:
            if new.decision is not None and old.decision is None:
                failpoints.hit("coordinator_before_decision")
            self.rows.update_txn(conn, old, new, now)
        self.rows.insert_events(conn, new, evs, now)

    # ----------------------------------------------------------------- protocol calls

    def register(
        self, name: str, descriptors: Sequence[dict[str, Any]] | None = None
    ) -> p.SinkRecord:
        """Hand out the sink's next writer epoch (fences every older writer); with
        ``descriptors``, record how to rebuild the sink's participants (replacing the
        previous writer's set; ``None`` keeps it)."""
        return self._write(self._register_tx(name, descriptors))

    async def register_async(
        self, name: str, descriptors: Sequence[dict[str, Any]] | None = None
    ) -> p.SinkRecord:
        return await self._write_async(self._register_tx(name, descriptors))

    def _register_tx(
        self, name: str, descriptors: Sequence[dict[str, Any]] | None
    ) -> Tx[p.SinkRecord]:
        validate_name("sink name", name)  # the store's keys obey the one name rule too
        for d in descriptors or ():
            name_of = d.get("name")
            validate_name("participant name", name_of if isinstance(name_of, str) else "")

        def tx(conn: Connection) -> tuple[p.SinkRecord, list[Change]]:
            old, version = self.rows.load_sink(conn, name)
            new = p.register(old, name)
            self.rows.save_sink(conn, old, version, new)
            if descriptors is not None:
                self.rows.save_participants(conn, name, descriptors, self.clock())
            return new, []

        return tx

    def begin(self, req: p.Begin) -> p.BeginResult:
        return self._write(self._begin_tx(req))

    async def begin_async(self, req: p.Begin) -> p.BeginResult:
        return await self._write_async(self._begin_tx(req))

    def _begin_tx(self, req: p.Begin) -> Tx[p.BeginResult]:
        def tx(conn: Connection) -> tuple[p.BeginResult, list[Change]]:
            sink, version = self.rows.load_sink(conn, req.sink)
            attempts = self.rows.load_attempts(conn, req.sink, req.lineage, req.batch_id)
            elsewhere: tuple[p.Transaction, ...] = ()
            if sink is not None and sink.lineage not in (None, req.lineage):
                elsewhere = self.rows.load_committing_elsewhere(conn, req.sink, req.lineage)
            res = p.begin(sink, attempts, req, committing_elsewhere=elsewhere)
            if res.sink != sink:
                self.rows.save_sink(conn, sink, version, res.sink)
            by_attempt = {a.attempt: a for a in attempts}
            changes: list[Change] = []
            for t in res.changed:
                old = by_attempt.get(t.attempt)
                ev: p.Event | p.Begin = req
                if old is not None:
                    ev = p.Abandon(epoch=req.epoch, reason=t.reason or "abandoned", now=req.now)
                self._persist(conn, old, t, [(ev, t.state)])
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

    def _apply_tx(self, key: TxnKey, events: Sequence[p.Event]) -> Tx[p.Transaction]:
        def tx(conn: Connection) -> tuple[p.Transaction, list[Change]]:
            old = self.rows.load_txn(conn, key)
            if old is None:
                raise TransactionNotFound.for_key(key)
            new, applied = p.handle_all(old, events)
            if not applied:
                return old, []
            self._persist(conn, old, new, applied)
            if new.state == p.State.COMMITTED:
                sink, version = self.rows.load_sink(conn, new.sink)
                if sink is not None:
                    advanced = p.committed(sink, new)
                    if advanced != sink:
                        self.rows.save_sink(conn, sink, version, advanced)
            return new, [(old, new)]

        return tx

    def force(
        self, key: TxnKey, branch: str, outcome: p.Decision, reason: str | None = None
    ) -> p.Transaction:
        """Admin: state that a branch is settled (see :class:`twophase.protocol.ForceAck`)."""
        ev = p.ForceAck(branch=branch, outcome=outcome, now=self.clock(), reason=reason)
        return self.apply(key, [ev])

    # ----------------------------------------------------------------- reads

    def get(self, key: TxnKey) -> p.Transaction | None:
        with self.db.read() as conn:
            return self.rows.load_txn(conn, key)

    def sink(self, name: str) -> p.SinkRecord | None:
        with self.db.read() as conn:
            return self.rows.load_sink(conn, name)[0]

    def list(
        self,
        sink: str | None = None,
        state: str | None = None,
        limit: int = 100,
        *,
        alert: bool | None = None,
    ) -> builtins.list[Listed]:
        """Newest first. ``state`` is a protocol state name (or ``ALERT`` via ``alert``)."""
        with self.db.read() as conn:
            rows = self.rows.list_txns(conn, sink, state, limit, alert)
        return [Listed(txn, alert_, updated) for txn, alert_, updated in rows]

    def participants(self, sink: str) -> builtins.list[dict[str, Any]]:
        """The sink's participant descriptors as recorded at its last register."""
        with self.db.read() as conn:
            return self.rows.participants(conn, sink)

    def sinks_overview(self, now: float | None = None) -> builtins.list[dict[str, Any]]:
        """Per sink: its record, in-doubt count and age, alerts (``wire.SinkSummaryOut``)."""
        return maintenance.sinks_overview(self, now)

    def history(self, key: TxnKey) -> builtins.list[dict[str, Any]]:
        """The event history of one transaction, oldest first."""
        with self.db.read() as conn:
            return self.rows.history(conn, key)

    # ----------------------------------------------------------------- many at once
    # (coordinator/maintenance.py; here so that callers need only the store)

    def stats(self, now: float | None = None) -> dict[str, Any]:
        return maintenance.stats(self, now)

    def expire_due(
        self, now: float | None = None, limit: int = 500
    ) -> builtins.list[p.Transaction]:
        return maintenance.expire_due(self, now, limit)

    def mark_alerts(self, now: float, alert_after: float) -> int:
        return maintenance.mark_alerts(self, now, alert_after)

    def purge(self, cutoff: float, limit: int = 1000) -> int:
        return maintenance.purge(self, cutoff, limit)
