"""Transactions of a coordinator location, as wire JSON: for operators' tools.

The location is either a store (``sqlite:///...``, ``postgresql://...``; read-only use)
or a daemon over HTTP (``http(s)://...``, token from ``token`` or ``TWOPHASE_TOKEN``).
"""

from __future__ import annotations

from typing import Any

from twophase.client import wire

__all__ = ["fetch", "fetch_participants", "fetch_sinks"]


def fetch(
    coordinator: str,
    *,
    sink: str | None = None,
    state: str | None = None,
    limit: int = 100,
    token: str | None = None,
    token_file: str | None = None,
) -> list[dict[str, Any]]:
    """Transactions as wire JSON (each with ``alert``), newest first."""
    if state is not None:
        state = state.upper()
    if coordinator.startswith(("http://", "https://")):
        from twophase.client.api import CoordinatorClient

        with CoordinatorClient(coordinator, token, token_file=token_file,
                               retry_budget=10.0) as client:
            return client.list_raw(sink=sink, state=state, limit=limit)
    from twophase.coordinator.store import Store

    store = Store(coordinator, read_only=True)
    try:
        if state == "ALERT":
            rows = store.list(sink=sink, limit=limit, alert=True)
        else:
            rows = store.list(sink=sink, state=state, limit=limit)
        return [{**wire.encode_txn(r.txn), "alert": r.alert} for r in rows]
    finally:
        store.close()


def fetch_sinks(coordinator: str, *, token: str | None = None,
                token_file: str | None = None) -> list[dict[str, Any]]:
    """Every sink with its last committed batch, in-doubt count and age, alerts
    (``wire.SinkSummaryOut``), from a daemon or read from a store."""
    if coordinator.startswith(("http://", "https://")):
        from twophase.client.api import CoordinatorClient

        with CoordinatorClient(coordinator, token, token_file=token_file,
                               retry_budget=10.0) as client:
            return [dict(s) for s in client.sinks()]
    from twophase.coordinator.store import Store

    store = Store(coordinator, read_only=True)
    try:
        return store.sinks_overview()
    finally:
        store.close()


def fetch_participants(coordinator: str, sink: str, *, token: str | None = None,
                       token_file: str | None = None) -> list[dict[str, Any]]:
    """The sink's recorded participant descriptors, from a daemon or read from a store."""
    if coordinator.startswith(("http://", "https://")):
        from twophase.client.api import CoordinatorClient

        with CoordinatorClient(coordinator, token, token_file=token_file,
                               retry_budget=10.0) as client:
            return [dict(d) for d in client.participants(sink)]
    from twophase.coordinator.store import Store

    store = Store(coordinator, read_only=True)
    try:
        return store.participants(sink)
    finally:
        store.close()
