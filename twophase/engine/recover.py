"""The driver finishes an attempt a restart found in doubt (COMMIT decided, not every
branch acknowledged), with no Spark task: the protocol's commit step for a recovery.

Every participant of a barrier-free sink prepares durably, so a branch under COMMIT is
committed from its vote's handle, by name, and needs none of its rows: PostgreSQL's
``COMMIT PREPARED``, a rename, a multipart completion, a staged Kafka branch's copy, a
table's adoption. Only a branch whose prepared state is gone (ABSENT: a staged Kafka
branch whose records left with the staging topic's retention, or a branch never voted)
must be written again from the replayed rows, and a redo is the tasks' ``finish``
(``twophase.engine.finish``, digest-checked). So :func:`finish_on_driver` first asks every
branch's state; when one needs its rows it changes nothing but earlier attempts'
leftovers and returns None, and the caller runs the tasks' finish as before.

Before this, the finish of a sink of Python participants ran a Spark job over the whole
batch to commit what the driver could commit alone (issue 30: the right shape is the
driver's, as Spark's DataSource V2 committer and the native path do). The batch still
runs through Spark's ``noop`` sink (``run_through``): a stateful query commits its state
stores only when the batch's plan runs.
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Final, TypeVar

from twophase.client.wire import acks_body
from twophase.engine.commit import COMMIT_THREADS
from twophase.engine.finish import apply_decision, settle_earlier
from twophase.engine.plan import BatchPlan, BranchOutcome
from twophase.participant import Handle, Participant, is_empty_branch
from twophase.protocol import Decision, RecoveryAction, branch_id, recovery_action
from twophase.spark.session import run_through

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from twophase.client.api import CoordinatorClient
    from twophase.participant import BranchRef

__all__ = ["finish_on_driver", "settle_all_earlier"]

log = logging.getLogger("twophase.sink")

_Item = tuple["Participant", "BranchRef", Handle]
_R = TypeVar("_R")

BRANCHES_PER_LANE: Final = 8
"""Branches a lane of the driver's finish takes before another lane (and its new
connections) pays: measured at 200 PostgreSQL branches, 8 lanes took status and commit
from 206-332 ms to 143-158 ms; at 2 branches a second lane's new connections cost more
than they save (docs/performance.md)."""


def _in_lanes(items: Sequence[_Item], run: Callable[[Participant, BranchRef, Handle], _R]
              ) -> list[_R]:
    """``run`` over ``items``, in lanes as the driver's commits run: a recovery of 200
    partitions asks 200 statuses and commits 200 branches. One lane per
    :data:`BRANCHES_PER_LANE` items, at most :data:`~twophase.engine.commit.COMMIT_THREADS`: a
    lane past the first works on its own copies of the participants (one holds one
    connection, not to be shared between threads), and a new connection costs about what
    a few branches do, so a small batch stays on the first lane, the sink's own
    participants and their open connections. Results in ``items``' order; the first
    error is raised once every lane has stopped."""
    lanes = min(COMMIT_THREADS, -(-len(items) // BRANCHES_PER_LANE))
    if lanes <= 1:
        return [run(*item) for item in items]

    def lane(i: int) -> list[tuple[int, _R]]:
        own: dict[str, Participant] = {}
        try:
            out = []
            for n in range(i, len(items), lanes):
                part, ref, handle = items[n]
                mine = part if i == 0 else own.get(part.name)
                if mine is None:  # a fresh copy opens its own connection when first used
                    mine = own[part.name] = pickle.loads(pickle.dumps(part))  # noqa: S301
                out.append((n, run(mine, ref, handle)))
            return out
        finally:
            for p in own.values():
                p.close()

    with ThreadPoolExecutor(lanes, thread_name_prefix="twophase-finish") as pool:
        futures = [pool.submit(lane, i) for i in range(lanes)]
        done = [f.result() for f in futures]  # the first lane's error is raised here
    return [r for _, r in sorted((pair for chunk in done for pair in chunk),
                                 key=lambda pair: pair[0])]


def settle_all_earlier(participants: Sequence[Participant], plan: BatchPlan,
                       client: CoordinatorClient) -> int:
    """The recovery rule for earlier attempts, every partition, from the driver (what
    each task does for its own partition): abort what they left PREPARED and acknowledge
    the attempts still waiting. Returns how many branches were aborted."""
    recovered = 0
    for attempt in range(1, plan.key.attempt):
        acks = []
        for p in range(plan.partitions):
            mine, aborted = settle_earlier(plan, participants, p, attempt)
            acks += mine
            recovered += aborted
        if attempt in plan.ack_earlier:
            client.ack(plan.key._replace(attempt=attempt), plan.epoch, acks, brief=True)
    return recovered


def finish_on_driver(participants: Sequence[Participant], df: DataFrame, plan: BatchPlan,
                     client: CoordinatorClient) -> list[dict[str, Any]] | None:
    """COMMIT is decided (``plan.mode`` finish): commit every prepared branch by name
    and hand back the acks as one outcome, which the driver relays. None, having changed
    nothing but earlier attempts' leftovers, when a branch needs its rows again (see the
    module docstring). A table's branches (``commit_scope`` BATCH) are left to the
    driver's batch commit, as the tasks' finish leaves them."""
    t0 = time.perf_counter()
    recovered = settle_all_earlier(participants, plan, client)
    acks: list[tuple[str, Decision]] = []
    asked: list[_Item] = []
    for part in participants:
        for p in range(plan.partitions):
            bid = branch_id(part.name, p)
            voted = plan.handles.get(bid)
            if voted is None:
                return None
            if is_empty_branch(voted):
                acks.append((bid, Decision.COMMIT))
            else:
                asked.append((part, plan.ref(part, p), voted))
    actions = _in_lanes(asked, lambda part, ref, voted: recovery_action(
        Decision.COMMIT, part.voted_status(ref, voted), part.commit_scope))
    todo: list[_Item] = []
    for (part, ref, voted), action in zip(asked, actions, strict=True):
        if action == RecoveryAction.COMMIT:
            todo.append((part, ref, voted))
        elif action == RecoveryAction.COMMIT_BATCH:
            continue  # a table's: the driver commits the batch and acknowledges
        elif action != RecoveryAction.NOTHING:
            log.info("sink %s batch %d: %s partition %d needs its rows again (%s): "
                     "the batch is finished by Spark tasks", plan.key.sink,
                     plan.key.batch_id, part.describe(), ref.partition, action.value)
            return None
        acks.append((ref.branch_id, Decision.COMMIT))
    run_through(df)  # a stateful query commits its state only when the batch runs
    _in_lanes(todo, lambda part, ref, voted: apply_decision(part, ref, voted,
                                                            Decision.COMMIT))
    took = time.perf_counter() - t0
    log.info("sink %s batch %d: finished from the driver: %d branch(es) committed, %d "
             "already, in %.0f ms", plan.key.sink, plan.key.batch_id, len(todo),
             len(acks) - len(todo), took * 1000)
    # the batch's rows, as its tasks report them: each partition's (every participant
    # wrote the same rows of it), summed over the partitions
    rows = sum(max((int(plan.handles.get(branch_id(part.name, p), {}).get("rows", 0))
                    for part in participants), default=0) for p in range(plan.partitions))
    out = BranchOutcome(partition=0, rows=rows, recovered=recovered, commit_s=took,
                        task_s=took, decision=Decision.COMMIT.value,
                        acks=json.dumps(acks_body(plan.epoch, acks, {})["acks"]))
    return [out.as_dict()]
