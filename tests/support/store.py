"""Helpers shared by the coordinator store tests."""

from __future__ import annotations

import uuid

from twophase.coordinator.store import Store
from twophase.protocol import TxnKey


def new_sink() -> str:
    """A sink name no other test uses (the stores may be shared)."""
    return f"s{uuid.uuid4().hex[:10]}"


def decisions(st: Store, key: TxnKey) -> int:
    """How many events moved the transaction from undecided to decided (must be 1)."""
    undecided = {"OPEN", "PREPARING"}
    prev, n = "OPEN", 0
    for ev in st.history(key):
        if prev in undecided and ev["state"] not in undecided:
            n += 1
        prev = ev["state"]
    return n
