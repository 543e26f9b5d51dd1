"""``twophase txns``: transactions as a readable table (rich) or as JSON for scripts.

Reads either a store directly (``sqlite:///...``, ``postgresql://...``; read-only use) or
a daemon over HTTP (``http(s)://...``, token from ``--token`` or ``TWOPHASE_TOKEN``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import IO, Any

from rich.console import Console
from rich.table import Table

from twophase import wire

_STYLE = {
    "OPEN": "cyan", "PREPARING": "cyan", "COMMITTING": "yellow", "COMMITTED": "green",
    "ABORTING": "magenta", "ABORTED": "red",
}


def fetch(
    coordinator: str,
    *,
    sink: str | None = None,
    state: str | None = None,
    limit: int = 100,
    token: str | None = None,
) -> list[dict[str, Any]]:
    """Transactions as wire JSON (each with ``alert``), newest first."""
    if state is not None:
        state = state.upper()
    if coordinator.startswith(("http://", "https://")):
        from twophase.client import CoordinatorClient

        with CoordinatorClient(coordinator, token, retry_budget=10.0) as client:
            return client.list_raw(sink=sink, state=state, limit=limit)
    from coordinator.store import Store

    store = Store(coordinator, create=False)
    try:
        if state == "ALERT":
            rows = store.list(sink=sink, limit=limit, alert=True)
        else:
            rows = store.list(sink=sink, state=state, limit=limit)
        return [{**wire.encode_txn(r.txn), "alert": r.alert} for r in rows]
    finally:
        store.close()


def _age(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    secs = max(0.0, now - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs / size:.1f}{unit}"
    return f"{secs:.1f}s"


def table(txns: Sequence[dict[str, Any]], now: float | None = None) -> Table:
    now = time.time() if now is None else now
    t = Table(title=f"{len(txns)} transaction(s), newest first", header_style="bold")
    for col in ("sink", "lineage", "ckpt", "att", "epoch", "state", "votes", "acks", "age",
                "decided", "reason"):
        t.add_column(col, justify="right" if col in ("ckpt", "att", "epoch") else "left")
    for x in txns:
        branches = x["branches"].values()
        yes = sum(1 for b in branches if b["vote"] == "COMMIT")
        no = sum(1 for b in branches if b["vote"] == "ABORT")
        acked = sum(1 for b in branches if b["ack"] is not None)
        n = len(x["branches"])
        state = x["state"]
        label = f"[{_STYLE.get(state, 'white')}]{state}[/]"
        if x.get("alert"):
            label += " [bold red]ALERT[/]"
        t.add_row(
            x["sink"], x["lineage"], str(x["checkpoint"]), str(x["attempt"]), str(x["epoch"]),
            label, f"{yes}+{no}/{n}" if no else f"{yes}/{n}", f"{acked}/{n}",
            _age(x["created"], now), _age(x["decided_at"], now), x.get("reason") or "",
        )
    return t


def render(txns: Sequence[dict[str, Any]], *, as_json: bool, out: IO[str]) -> None:
    if as_json:
        json.dump(list(txns), out, indent=2)
        out.write("\n")
        return
    Console(file=out, width=160).print(table(txns))
