"""The recovery rule: what to do with one branch, from the decision and what the
participant's own system says about the branch.

| decision      | status    | action  |
|---------------|-----------|---------|
| COMMIT        | COMMITTED | nothing |
| COMMIT        | PREPARED  | commit  |
| COMMIT        | ABSENT    | redo: write again, commit at once (the marker stops a 2nd write) |
| ABORT or none | PREPARED  | abort   |
| ABORT or none | ABSENT    | nothing |
| ABORT or none | COMMITTED | nothing (committed by another attempt of the batch) |

The same function answers an in-place retry, a driver restart (Spark replay), a job whose
tasks died after the decision, and the operator's ``twophase resolve``.
"""

from __future__ import annotations

import enum

from twophase.protocol.records import Decision

__all__ = ["BranchStatus", "RecoveryAction", "recovery_action"]


class BranchStatus(str, enum.Enum):
    """A branch as its participant's system shows it (never from memory)."""

    COMMITTED = "COMMITTED"
    PREPARED = "PREPARED"
    ABSENT = "ABSENT"


class RecoveryAction(str, enum.Enum):
    NOTHING = "nothing"
    COMMIT = "commit"
    ABORT = "abort"
    REDO = "redo"  # lost under COMMIT (Kafka): write again and commit at once


def recovery_action(decision: Decision | None, status: BranchStatus) -> RecoveryAction:
    """The action for one branch; ``decision=None`` (undecided) is presumed ABORT."""
    if decision == Decision.COMMIT:
        if status == BranchStatus.PREPARED:
            return RecoveryAction.COMMIT
        if status == BranchStatus.ABSENT:
            return RecoveryAction.REDO
        return RecoveryAction.NOTHING
    if status == BranchStatus.PREPARED:
        return RecoveryAction.ABORT
    return RecoveryAction.NOTHING
