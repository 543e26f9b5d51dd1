"""Long-poll wakeups: a waiter for a transaction hears of its change the moment it is
durable in this process (other replicas' changes are seen by the waiters' polling)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from twophase import protocol as p
from twophase.protocol import TxnKey

__all__ = ["DecisionHub"]


class DecisionHub:
    """Futures per transaction key, resolved from any thread on the waiter's own loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[TxnKey, set[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]]]
        self._waiters = {}

    def subscribe(self, key: TxnKey) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._waiters.setdefault(key, set()).add((loop, fut))
        return fut

    def unsubscribe(self, key: TxnKey, fut: asyncio.Future[Any]) -> None:
        with self._lock:
            ws = self._waiters.get(key)
            if ws is not None:
                ws.discard((fut.get_loop(), fut))
                if not ws:
                    del self._waiters[key]

    def publish(self, txn: p.Transaction) -> None:
        if not self._waiters:
            return
        with self._lock:
            ws = list(self._waiters.get(txn.key, ()))
        for loop, fut in ws:
            loop.call_soon_threadsafe(_resolve, fut, txn)


def _resolve(fut: asyncio.Future[Any], txn: p.Transaction) -> None:
    if not fut.done():
        fut.set_result(txn)
