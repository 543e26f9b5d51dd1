"""An attempt a restart found in doubt (COMMIT decided, not every branch acknowledged):
does it need a Spark task at all? The driver commits it either way, as it commits a new
attempt (``twophase.engine.commit``: one commit path).

Every participant of a barrier-free sink prepares durably, so a branch under COMMIT is
committed from its vote's handle, by name, and needs none of its rows: PostgreSQL's
``COMMIT PREPARED``, a rename, a multipart completion, a staged Kafka branch's copy, a
table's adoption. Only a branch whose prepared state is gone (ABSENT: a resumable Kafka
branch whose transaction the broker ended, a staged one whose records left with the
staging topic's retention, or a branch never voted) must be written again from the
replayed rows, and a redo is the tasks' ``finish`` (``twophase.engine.finish``,
digest-checked). So :func:`finish_from_votes` asks every branch's state (in lanes: a
recovery of 200 partitions asks 200); when one needs its rows it changes nothing but
earlier attempts' leftovers and returns None, and the caller runs the tasks' finish.

Without a task the batch still runs through Spark's ``noop`` sink (``run_through``): a
stateful query commits its state stores only when the batch's plan runs.

A new attempt of a batch Spark planned with no partition at all (an empty relation)
needs no task either: :func:`vote_empty` settles earlier attempts and votes every
branch empty from the driver, and the batch goes on through the same decide and commit
as any other.
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Final, TypeVar

from twophase.client.wire import VoteIn, votes_body
from twophase.engine.commit import COMMIT_THREADS
from twophase.engine.finish import settle_earlier
from twophase.engine.plan import BatchPlan, BranchOutcome
from twophase.participant import EMPTY_BRANCH, Handle, Participant, is_empty_branch
from twophase.protocol import Decision, RecoveryAction, branch_id, recovery_action
from twophase.spark.session import run_through

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from twophase.client.api import CoordinatorClient
    from twophase.participant import BranchRef

__all__ = ["finish_from_votes", "settle_all_earlier", "vote_empty"]

log = logging.getLogger("twophase.sink")

_Item = tuple["Participant", "BranchRef", Handle]
_R = TypeVar("_R")

BRANCHES_PER_LANE: Final = 8
"""Branches a lane of the driver's status checks takes before another lane (and its new
connections) pays: measured at 200 PostgreSQL branches, 8 lanes took status and commit
from 206-332 ms to 143-158 ms; at 2 branches a second lane's new connections cost more
than they save (docs/performance.md)."""


def _in_lanes(items: Sequence[_Item], run: Callable[[Participant, BranchRef, Handle], _R]
              ) -> list[_R]:
    """``run`` over ``items``, in lanes as the driver's commits run: a recovery of 200
    partitions asks 200 statuses. One lane per
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


def finish_from_votes(participants: Sequence[Participant], df: DataFrame, plan: BatchPlan,
                      client: CoordinatorClient) -> list[dict[str, Any]] | None:
    """COMMIT is decided (``plan.mode`` finish): does any branch need its rows again? None
    when one does (the tasks' finish redoes it, ``twophase.engine.finish.redo_lost``);
    else the batch runs through Spark's noop sink and the one outcome the report reads
    comes back, and the driver's committer commits every branch from its vote's handle
    (``Committer.apply``, as for a new attempt). Earlier attempts' leftovers are settled
    first, either way."""
    t0 = time.perf_counter()
    recovered = settle_all_earlier(participants, plan, client)
    asked: list[_Item] = []
    for part in participants:
        for p in range(plan.partitions):
            bid = branch_id(part.name, p)
            if bid in plan.acked:
                continue  # applied, or its loss accepted (an operator's force-ack)
            voted = plan.handles.get(bid)
            if voted is None:
                return None  # never voted with a handle: only its rows can make it
            if not is_empty_branch(voted):
                asked.append((part, plan.ref(part, p), voted))
    actions = _in_lanes(asked, lambda part, ref, voted: recovery_action(
        Decision.COMMIT, part.voted_status(ref, voted), part.commit_scope))
    for (part, ref, _), action in zip(asked, actions, strict=True):
        if action == RecoveryAction.REDO:
            log.info("sink %s batch %d: %s partition %d needs its rows again (%s): "
                     "the batch's lost branches are redone by Spark tasks", plan.key.sink,
                     plan.key.batch_id, part.describe(), ref.partition, action.value)
            return None
    run_through(df)  # a stateful query commits its state only when the batch runs
    took = time.perf_counter() - t0
    log.info("sink %s batch %d: no branch lost, %d to commit from their votes (asked in "
             "%.0f ms)", plan.key.sink, plan.key.batch_id, len(asked), took * 1000)
    # the batch's rows, as its tasks report them: each partition's (every participant
    # wrote the same rows of it), summed over the partitions
    rows = sum(max((int(plan.handles.get(branch_id(part.name, p), {}).get("rows", 0))
                    for part in participants), default=0) for p in range(plan.partitions))
    return [BranchOutcome(partition=0, rows=rows, recovered=recovered, task_s=took).as_dict()]


def vote_empty(participants: Sequence[Participant], plan: BatchPlan,
               client: CoordinatorClient) -> list[dict[str, Any]]:
    """A new attempt of a batch without partitions (``plan.split`` is ``EMPTY_SPLIT``):
    settle earlier attempts' leftovers, then the one outcome a task would return, with
    an empty YES vote for every branch not voted yet. No Spark job runs (nor
    ``run_through``: a relation without partitions has no state to commit)."""
    t0 = time.perf_counter()
    recovered = settle_all_earlier(participants, plan, client)
    votes = [VoteIn(branch=bid, yes=True, handle={**EMPTY_BRANCH, "split": plan.split})
             for part in participants for p in range(plan.partitions)
             if (bid := branch_id(part.name, p)) not in plan.handles]
    out = BranchOutcome(partition=0, recovered=recovered,
                        votes=json.dumps(votes_body(plan.epoch, votes)["votes"]))
    out.task_s = time.perf_counter() - t0
    return [out.as_dict()]
