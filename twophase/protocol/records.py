"""The protocol's values: states, decisions, transactions, sink rows, branch ids.

Plain frozen records with no behaviour beyond reading themselves; every rule that changes
them lives in :mod:`~twophase.protocol.machine` (messages) and
:mod:`~twophase.protocol.attempts` (the sink-level begin).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, NamedTuple

from twophase.errors import InvalidRequest
from twophase.names import validate_name

__all__ = [
    "BranchState",
    "Decision",
    "SinkRecord",
    "State",
    "Transaction",
    "TxnKey",
    "branch_id",
    "parse_branch_id",
]


class State(str, enum.Enum):
    OPEN = "OPEN"
    PREPARING = "PREPARING"
    COMMITTING = "COMMITTING"
    COMMITTED = "COMMITTED"
    ABORTING = "ABORTING"
    ABORTED = "ABORTED"

    @property
    def decided(self) -> bool:
        return self in _DECIDED

    @property
    def finished(self) -> bool:
        return self in (State.COMMITTED, State.ABORTED)


class Decision(str, enum.Enum):
    COMMIT = "COMMIT"
    ABORT = "ABORT"


_DECIDED: Final = frozenset({State.COMMITTING, State.COMMITTED, State.ABORTING, State.ABORTED})
_COMMIT_STATES: Final = frozenset({State.COMMITTING, State.COMMITTED})


# ---------------------------------------------------------------------------------------
# identifiers


def branch_id(participant: str, partition: int) -> str:
    """Branch ids are ``participant/partition``; both parts are validated."""
    validate_name("participant name", participant)
    if not isinstance(partition, int) or isinstance(partition, bool) or partition < 0:
        raise InvalidRequest(f"partition must be a non-negative int, got {partition!r}")
    return f"{participant}/{partition}"


def parse_branch_id(bid: str) -> tuple[str, int]:
    participant, _, partition = bid.rpartition("/")
    if not participant or not partition.isdigit():
        raise InvalidRequest(f"malformed branch id {bid!r}")
    return participant, int(partition)


# ---------------------------------------------------------------------------------------
# records


class TxnKey(NamedTuple):
    """What names one transaction: an attempt of one batch of one sink lineage."""

    sink: str
    lineage: str
    batch_id: int
    attempt: int


@dataclass(frozen=True)
class BranchState:
    """One branch of one attempt as the coordinator sees it."""

    vote: Decision | None = None  # COMMIT means voted YES, ABORT means voted NO
    handle: Mapping[str, str] | None = None  # what the participant needs to commit later
    reason: str | None = None  # why it voted NO
    ack: Decision | None = None  # the outcome the branch confirmed it applied
    digest: str | None = None  # content digest of the rows voted on (a redo must match it)
    task: str | None = None  # the Spark task attempt whose vote counts (the first one)


@dataclass(frozen=True)
class Transaction:
    """One attempt of one checkpoint of one sink lineage.

    ``version`` increases by one on every change; stores compare-and-set on it.
    """

    sink: str
    lineage: str
    batch_id: int
    attempt: int
    epoch: int
    partitions: int
    branches: Mapping[str, BranchState]
    deadline: float
    state: State = State.OPEN
    reason: str | None = None  # why it aborted
    created: float = 0.0
    decided_at: float | None = None
    finished_at: float | None = None
    version: int = 0

    @property
    def decision(self) -> Decision | None:
        """The durable decision; ``None`` means undecided, which recovery reads as ABORT."""
        if self.state in _COMMIT_STATES:
            return Decision.COMMIT
        if self.state in (State.ABORTING, State.ABORTED):
            return Decision.ABORT
        return None

    @property
    def effective_decision(self) -> Decision:
        """Presumed abort: with no decision record the outcome is ABORT."""
        return self.decision or Decision.ABORT

    @property
    def key(self) -> TxnKey:
        return TxnKey(self.sink, self.lineage, self.batch_id, self.attempt)

    def coherent(self) -> bool:
        """Whether the branches fit the state as :mod:`.machine` leaves every record:
        undecided only while a vote is missing, no acknowledgement but the decision's,
        COMMIT only with every vote YES, finished exactly when every branch the decision
        waits for (all under COMMIT, the YES ones under ABORT) is acknowledged. A record
        pieced together from parts (the driver's copy and a bounded answer) that is not
        coherent means another writer moved a branch in between."""
        states = self.branches.values()
        decision = self.decision
        if decision is None:
            return any(st.vote is None for st in states) and all(st.ack is None for st in states)
        if any(st.ack not in (None, decision) for st in states):
            return False
        if decision == Decision.COMMIT and any(st.vote != Decision.COMMIT for st in states):
            return False
        waited = [st for st in states if st.vote == Decision.COMMIT]
        return self.state.finished == all(st.ack is not None for st in waited)

    def pending_acks(self) -> list[str]:
        """Branches whose acknowledgement the current decision still waits for."""
        if self.state == State.COMMITTING:
            return [b for b, s in self.branches.items() if s.ack is None]
        if self.state == State.ABORTING:
            return [
                b for b, s in self.branches.items() if s.vote == Decision.COMMIT and s.ack is None
            ]
        return []


@dataclass(frozen=True)
class SinkRecord:
    """Per-sink registry row: the current writer epoch and lineage."""

    name: str
    epoch: int = 0
    lineage: str | None = None
    last_committed: int | None = None  # highest committed checkpoint of ``lineage``
