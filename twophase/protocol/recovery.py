"""The recovery rule: what to do with one branch, from the decision and what the
participant's own system says about the branch.

| decision      | status    | action  |
|---------------|-----------|---------|
| COMMIT        | COMMITTED | nothing |
| COMMIT        | PREPARED  | commit  |
| COMMIT        | ABSENT    | redo: write again, then commit (the marker stops a 2nd write) |
| ABORT or none | PREPARED  | abort   |
| ABORT or none | ABSENT    | nothing |
| ABORT or none | COMMITTED | nothing (committed by another attempt of the batch) |

A participant that commits once per batch (``CommitScope.BATCH``: a lakehouse table)
reads the same table with two rows changed, because no branch is ever committed alone:

| decision      | status    | action  |
|---------------|-----------|---------|
| COMMIT        | PREPARED  | commit-batch: the driver commits every branch at once |
| COMMIT        | ABSENT    | redo: write the files again; the batch commit takes them |

and COMMITTED means "the table's marker of this batch names this attempt" (committed by
the batch commit).

The same function answers an in-place retry, a driver restart (Spark replay), a job whose
tasks died after the decision, and the operator's ``twophase resolve``. Whoever acts on
it, a commit is the driver's: a redo (a finish's task) hands its new handle back, and the
driver commits the branch from it with every other branch of the batch.
"""

from __future__ import annotations

import enum

from twophase.protocol.records import Decision

__all__ = ["BranchStatus", "CommitScope", "RecoveryAction", "recovery_action"]


class CommitScope(str, enum.Enum):
    """Where a participant's COMMIT is applied."""

    BRANCH = "branch"
    """Each branch is committed on its own (PostgreSQL, files, Kafka, SQL databases)."""
    BATCH = "batch"
    """The driver commits every branch of the batch at once (a table: one snapshot or
    log entry per micro-batch; Flink Sink V2's global committer)."""


class BranchStatus(str, enum.Enum):
    """A branch as its participant's system shows it (never from memory)."""

    COMMITTED = "COMMITTED"
    PREPARED = "PREPARED"
    ABSENT = "ABSENT"


class RecoveryAction(str, enum.Enum):
    NOTHING = "nothing"
    COMMIT = "commit"
    ABORT = "abort"
    REDO = "redo"  # lost under COMMIT (Kafka): write again, then commit from the new handle
    COMMIT_BATCH = "commit-batch"  # batch scope: the driver commits all branches at once


def recovery_action(
    decision: Decision | None,
    status: BranchStatus,
    scope: CommitScope = CommitScope.BRANCH,
) -> RecoveryAction:
    """The action for one branch; ``decision=None`` (undecided) is presumed ABORT."""
    if decision == Decision.COMMIT:
        if status == BranchStatus.PREPARED:
            if scope == CommitScope.BATCH:
                return RecoveryAction.COMMIT_BATCH
            return RecoveryAction.COMMIT
        if status == BranchStatus.ABSENT:
            return RecoveryAction.REDO
        return RecoveryAction.NOTHING
    if status == BranchStatus.PREPARED:
        return RecoveryAction.ABORT
    return RecoveryAction.NOTHING
