"""How an attempt begins and ends behind Spark's data source door (``format("twophase")``).

Spark calls no driver code of the sink between planning a micro-batch and running its
tasks, and the driver code it does call (``streamWriter``) is given neither the batch id
nor the query. So an attempt is *begun by its first task*: every task reads the batch id
and the query id from its local properties and sends ``begin`` (the begin table,
:data:`~twophase.protocol.attempts.BEGIN_CASES`, unchanged): the first creates the
attempt, the others of the same writer epoch get the same answer ("the same writer asks
again"). The branch set is fixed at begin, before anyone knows how many partitions Spark
made, so the door begins with a bound (the sink's ``partitions``); a task past the bound
is refused, and the driver votes the bound's unused branches empty.

Two tables, first match wins:

- :data:`TASK_CASES`: what a task does with its begin's answer;
- :data:`COMMIT_CASES`: what the driver's ``commit(messages, batchId)`` does with the
  tasks' answers (one per partition, ``None`` for a failed task): one attempt to decide,
  or a refusal naming why (the batch then fails and Spark replays it on restart).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from twophase.errors import IllegalTransition, InvalidRequest, ProtocolError
from twophase.protocol.attempts import BeginKind
from twophase.protocol.records import TxnKey

__all__ = ["COMMIT_CASES", "TASK_CASES", "CommitCase", "DoorCommit", "TaskAction",
           "TaskAnswer", "TaskCase", "check_partition", "commit_case", "task_action"]


class TaskAction(str, enum.Enum):
    PREPARE = "prepare"  # prepare every branch; the votes go back as the commit message
    SKIP = "skip"  # write nothing: the batch is committed already
    FINISH = "finish"  # write nothing: the driver finishes the COMMIT-decided attempt


@dataclass(frozen=True)
class TaskCase:
    name: str
    kind: BeginKind
    action: TaskAction


TASK_CASES: Final[tuple[TaskCase, ...]] = (
    TaskCase("a new attempt (begun by this task or a sibling of the same writer): prepare",
             BeginKind.NEW, TaskAction.PREPARE),
    TaskCase("a replay of a committed batch: write nothing", BeginKind.COMMITTED,
             TaskAction.SKIP),
    TaskCase("COMMIT decided, acks missing: write nothing, the driver finishes the attempt "
             "from the coordinator's record", BeginKind.IN_DOUBT, TaskAction.FINISH),
)


def task_action(kind: BeginKind) -> TaskAction:
    """The row of :data:`TASK_CASES` for a begin's answer."""
    return next(c.action for c in TASK_CASES if c.kind == kind)


def check_partition(sink: str, partition: int, bound: int) -> None:
    """A task past the bound the attempt was begun with has no branch to write."""
    if partition >= bound:
        raise InvalidRequest(
            f"sink {sink!r}: the batch has a partition {partition} but the data source "
            f"begins each batch with {bound} branches per participant; set "
            f".option('partitions', N) (or TransactionalSink(partitions=N)) to at least "
            "the batch's partition count, or repartition the stream before the sink"
        )


@dataclass(frozen=True)
class TaskAnswer:
    """What one task tells the driver (inside its commit message), besides its votes."""

    key: TxnKey
    kind: BeginKind
    epoch: int
    partition: int


@dataclass(frozen=True)
class DoorCommit:
    """The attempt the driver decides and how: ``kind`` NEW (send the votes, decide,
    commit), IN_DOUBT (finish from the record) or COMMITTED (nothing to do)."""

    key: TxnKey
    kind: BeginKind
    epoch: int


@dataclass(frozen=True)
class CommitCase:
    name: str
    applies: Callable[[Sequence[TaskAnswer | None], int], bool]
    refusal: type[ProtocolError] | None  # None: the answers name one attempt to decide


def _keys(answers: Sequence[TaskAnswer | None]) -> set[tuple[TxnKey, BeginKind, int]]:
    return {(a.key, a.kind, a.epoch) for a in answers if a is not None}


COMMIT_CASES: Final[tuple[CommitCase, ...]] = (
    CommitCase("no task answered at all", lambda a, b: not a, ProtocolError),
    CommitCase("a task failed (its message is None): nothing to commit, abort",
               lambda a, b: any(x is None for x in a), IllegalTransition),
    CommitCase("an answer names another batch than the one Spark commits",
               lambda a, b: any(x is not None and x.key.batch_id != b for x in a),
               ProtocolError),
    CommitCase("the tasks joined different attempts (one was aborted while the job ran, "
               "or two writers raced): abort, the restarted query replays the batch",
               lambda a, b: len(_keys(a)) != 1, IllegalTransition),
    CommitCase("every task joined one attempt: decide it", lambda a, b: True, None),
)
"""The commit table, first match wins; the last row always applies."""


def commit_case(answers: Sequence[TaskAnswer | None], batch_id: int) -> DoorCommit:
    """The attempt ``commit(messages, batchId)`` decides, or the refusal of
    :data:`COMMIT_CASES` (a :class:`ProtocolError` naming the row)."""
    case = next(c for c in COMMIT_CASES if c.applies(answers, batch_id))
    if case.refusal is not None:
        raise case.refusal(f"data source commit of batch {batch_id} refused: {case.name}")
    key, kind, epoch = next(iter(_keys(answers)))
    return DoorCommit(key, kind, epoch)
