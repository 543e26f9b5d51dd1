"""Work on many transactions of the log at once, for the background rounds and metrics.

Vote deadlines go through :meth:`Store.apply` like any other event (so two replicas
expiring one transaction write one ABORT); the alert flag and retention are plain
statements, since neither is protocol state; ``stats`` feeds the Prometheus gauges.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sqlalchemy import case, delete, func, select, update

from twophase import protocol as p
from twophase.coordinator import schema as s
from twophase.coordinator.sql import key_params, key_where
from twophase.errors import TransactionNotFound
from twophase.protocol import TxnKey

if TYPE_CHECKING:
    from twophase.coordinator.store import Store

__all__ = ["expire_due", "mark_alerts", "purge", "sinks_overview", "stats"]

log = logging.getLogger("twophase.coordinator.maintenance")

_T, _E = s.txns, s.events
_UNDECIDED = (p.State.OPEN.value, p.State.PREPARING.value)
_IN_DOUBT = (p.State.COMMITTING.value, p.State.ABORTING.value)
_FINISHED = (p.State.COMMITTED.value, p.State.ABORTED.value)


def expire_due(store: Store, now: float | None = None, limit: int = 500) -> list[p.Transaction]:
    """Feed ``Expire`` to undecided transactions whose vote deadline passed."""
    now = store.clock() if now is None else now
    q = (
        select(_T.c.sink, _T.c.lineage, _T.c.checkpoint, _T.c.attempt)
        .where(_T.c.state.in_(_UNDECIDED), _T.c.deadline <= now)
        .limit(limit)
    )
    with store.db.read() as conn:
        keys = [TxnKey(*r) for r in conn.execute(q).all()]
    out = []
    for key in keys:
        try:
            out.append(store.apply(key, [p.Expire(now=now)]))
        except TransactionNotFound:
            continue  # purged meanwhile by another replica
    return out


def mark_alerts(store: Store, now: float, alert_after: float) -> int:
    """Flag decided transactions whose branches have not all acknowledged in time."""
    stmt = (
        update(_T)
        .where(
            _T.c.state.in_(_IN_DOUBT),
            _T.c.decided_at <= now - alert_after,
            _T.c.alert.is_(False),
        )
        .values(alert=True)
    )
    with store.db.write() as conn:
        n = conn.execute(stmt).rowcount
    if n:
        log.warning("alert", extra={"transactions": n, "alert_after": alert_after})
    return int(n)


def purge(store: Store, cutoff: float, limit: int = 1000) -> int:
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
            _T.c.state.in_(_FINISHED),
            _T.c.finished_at < cutoff,
            (sk.c.lineage != _T.c.lineage) | (_T.c.checkpoint <= sk.c.last_committed),
        )
        .limit(limit)
    )
    with store.db.read() as conn:
        keys = [TxnKey(*r) for r in conn.execute(q).all()]
    if not keys:
        return 0
    params = [key_params(k) for k in keys]
    with store.db.write() as conn:
        conn.execute(delete(_E).where(key_where(_E)), params)
        conn.execute(delete(s.branches).where(key_where(s.branches)), params)
        conn.execute(delete(_T).where(key_where(_T)), params)
    log.info("purged", extra={"transactions": len(keys)})
    return len(keys)


def stats(store: Store, now: float | None = None) -> dict[str, Any]:
    """Counts by state, alerts, and the age of the oldest in-doubt transaction."""
    now = store.clock() if now is None else now
    with store.db.read() as conn:
        counts = {
            st: n
            for st, n in conn.execute(select(_T.c.state, func.count()).group_by(_T.c.state))
        }
        oldest = conn.execute(
            select(func.min(_T.c.decided_at)).where(_T.c.state.in_(_IN_DOUBT))
        ).scalar()
        alerts = conn.execute(
            select(func.count()).select_from(_T).where(_T.c.alert.is_(True))
        ).scalar()
    return {
        "by_state": {st.value: int(counts.get(st.value, 0)) for st in p.State},
        "in_doubt": sum(int(counts.get(x, 0)) for x in _IN_DOUBT),
        "oldest_in_doubt_age": max(0.0, now - oldest) if oldest is not None else 0.0,
        "alerts": int(alerts or 0),
    }


def sinks_overview(store: Store, now: float | None = None) -> list[dict[str, Any]]:
    """Every sink with its in-doubt count and age, undecided count and alerts, by name
    (``wire.SinkSummaryOut``): what ``twophase sinks`` and the console show."""
    now = store.clock() if now is None else now
    sk, pt = s.sinks, s.participants
    per_sink = (
        select(
            _T.c.sink,
            func.sum(case((_T.c.state.in_(_IN_DOUBT), 1), else_=0)),
            func.sum(case((_T.c.state.in_(_UNDECIDED), 1), else_=0)),
            func.min(case((_T.c.state.in_(_IN_DOUBT), _T.c.decided_at), else_=None)),
            func.sum(case((_T.c.alert.is_(True), 1), else_=0)),
        )
        .where(_T.c.state.notin_(_FINISHED))
        .group_by(_T.c.sink)
    )
    with store.db.read() as conn:
        sinks = conn.execute(
            select(sk.c.name, sk.c.epoch, sk.c.lineage, sk.c.last_committed)
            .where(sk.c.name != "__healthz__").order_by(sk.c.name)
        ).all()
        open_ = {r[0]: r[1:] for r in conn.execute(per_sink).all()}
        names: dict[str, list[str]] = {}
        for sink_name, part in conn.execute(select(pt.c.sink, pt.c.name).order_by(pt.c.name)):
            names.setdefault(sink_name, []).append(part)
    out = []
    for name, epoch, lineage, last in sinks:
        in_doubt, undecided, oldest, alerts = open_.get(name, (0, 0, None, 0))
        out.append({
            "name": name, "epoch": int(epoch), "lineage": lineage, "last_committed": last,
            "in_doubt": int(in_doubt or 0), "undecided": int(undecided or 0),
            "oldest_in_doubt_age": max(0.0, now - oldest) if oldest is not None else None,
            "alerts": int(alerts or 0), "participants": names.get(name, []),
        })
    return out
