"""What one task does for one partition of one micro-batch: its branches' share of 2PC.

This runs on a Spark executor (inside ``mapInArrow``), but nothing here imports Spark:
tests drive it directly with real participants and a real coordinator. One task owns
the branches ``(participant, p)`` of every participant for its partition ``p``:

1. settle what earlier attempts of this checkpoint left prepared (recovery rule);
2. ``prepare`` (a new attempt): prepare every branch and end, the votes going back with
   the job's result; the driver sends them (``twophase.engine.decide``) and applies the
   decision (``twophase.engine.commit``). Every participant's prepare outlives the task
   (``Participant`` refuses one that does not), so no task waits for the decision;
   ``finish``: COMMIT is already decided, so commit what is prepared and redo what is
   lost (Kafka), then acknowledge.

A vote names the Spark task attempt that cast it (``run_partition``'s ``task``): when
Spark runs a task again (its executor died, or a speculative copy) the first vote of the
branch is the one that counts (the protocol's vote table).

A participant that commits once per batch (``CommitScope.BATCH``: a table) is prepared and
aborted here like any other, but under COMMIT its branches are left for the driver, which
commits the whole batch at once and acknowledges them (``twophase.doors.foreachbatch``);
a finish that redoes such a branch returns the new handle in its outcome for that commit.

Under the sink (``BatchPlan.driver_acks``) a task does not send its acknowledgements: it
returns them in its outcome and the driver relays every task's in one call once the job
is done (``relay_acks``), a round trip per task saved. A task that dies after applying
the decision leaves its branches unacknowledged either way: the COMMIT recovery (or the
ABORT rule) finds them applied and acknowledges them then.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from functools import partial
from typing import TYPE_CHECKING

from twophase import failpoints
from twophase.client.wire import BranchMetrics, VoteIn, votes_body
from twophase.digest import RowsDigest
from twophase.engine.feed import first_rows, prepare_streaming
from twophase.engine.finish import (
    finish_commit,
    settle_earlier,
)
from twophase.engine.plan import BatchPlan, BranchOutcome
from twophase.errors import TargetProblem
from twophase.participant import (
    EMPTY_BRANCH,
    Handle,
    Participant,
    PrepareRefused,
)
from twophase.protocol import (
    CommitScope,
    Decision,
    branch_id,
)

if TYPE_CHECKING:
    import pyarrow as pa

    from twophase.client.api import CoordinatorClient

__all__ = ["run_partition"]


def _settle_earlier(
    plan: BatchPlan, partition: int, client: CoordinatorClient, out: BranchOutcome
) -> None:
    """The recovery rule for earlier attempts' branches of this partition
    (:func:`~twophase.engine.finish.settle_earlier`), acknowledged to the attempts still
    waiting."""
    for attempt in range(1, plan.key.attempt):
        acks, aborted = settle_earlier(plan, plan.participants, partition, attempt)
        out.recovered += aborted
        if attempt in plan.ack_earlier:  # the answer is not read: brief
            client.ack(plan.key._replace(attempt=attempt), plan.epoch, acks, brief=True)


def _batch_commits(part: Participant, decision: Decision) -> bool:
    """True when the driver, not this task, applies ``decision`` to ``part``'s branch (a
    COMMIT of a participant that commits once per batch)."""
    return decision == Decision.COMMIT and part.commit_scope == CommitScope.BATCH


def _run_attempt(
    plan: BatchPlan,
    partition: int,
    schema: pa.Schema,
    batches: Iterator[pa.RecordBatch],
    out: BranchOutcome,
    task: str | None,
) -> None:
    """Prepare this partition's branches of a new attempt and hand the votes over."""
    t0 = time.perf_counter()
    digest = RowsDigest(schema)  # stored with the vote: a redo must match it
    head, out.rows = first_rows(batches)
    if out.rows:
        results = prepare_streaming(
            [partial(_prepare_one, plan, part, partition, schema)
             for part in plan.participants], head, batches, out, digest)
    else:  # an empty partition writes nothing anywhere: its vote says so
        results = []
        for part in plan.participants:
            failpoints.hit("before_prepare", part.name, partition)
            results.append(EMPTY_BRANCH)
            failpoints.hit("after_prepare", part.name, partition)
    votes: list[VoteIn] = []
    unexpected: Exception | None = None
    for part, res in zip(plan.participants, results, strict=True):
        bid = branch_id(part.name, partition)
        if isinstance(res, PrepareRefused):
            votes.append(VoteIn(branch=bid, yes=False, reason=str(res), task=task))
        elif isinstance(res, Exception):
            # An unexpected failure while preparing: a NO vote with the cause (the task
            # fails unless the target refused for good: ``_hand_over_votes``)
            votes.append(VoteIn(branch=bid, yes=False, reason=f"{type(res).__name__}: {res}",
                                task=task))
            unexpected = unexpected or res
        else:
            # prepares run together: each branch's time is the partition's prepare time
            measured: BranchMetrics = {"prepare_s": time.perf_counter() - t0, "rows": out.rows}
            votes.append(VoteIn(branch=bid, yes=True, handle={**res, "split": plan.split},
                                metrics=measured, digest=digest.value(), task=task))
    _hand_over_votes(plan, votes, unexpected, out, t0)


def _hand_over_votes(
    plan: BatchPlan, votes: list[VoteIn], unexpected: Exception | None, out: BranchOutcome,
    t0: float,
) -> None:
    """A new attempt's votes go back with the job's result, and the driver
    sends every task's at once (``twophase.engine.decide``): one result per partition is what
    Spark keeps of a task run twice (a retry, a speculative copy), so the votes the
    coordinator sees are one task attempt's per branch. YES votes first: a NO then decides
    ABORT with every prepared branch recorded, so the driver aborts them all. An
    unexpected error fails the task instead (Spark runs it again; a new attempt finds
    what this one prepared under the same names); a target's permanent refusal is said
    in full by its NO vote."""
    if unexpected is not None and not isinstance(unexpected, TargetProblem):
        raise unexpected
    ordered = sorted(votes, key=lambda v: not v.yes)
    out.votes = json.dumps(votes_body(plan.epoch, ordered)["votes"])
    out.prepare_s = time.perf_counter() - t0
    refused = [v for v in ordered if not v.yes]
    if refused:
        out.error = f"{refused[0].branch} voted NO: {refused[0].reason}"


def _prepare_one(plan: BatchPlan, part: Participant, partition: int, schema: pa.Schema,
                 source: Iterator[pa.RecordBatch]) -> Handle:
    """One participant's prepare of this partition, between its failpoints."""
    failpoints.hit("before_prepare", part.name, partition)
    handle = part.prepare(plan.ref(part, partition), schema, source)
    failpoints.hit("after_prepare", part.name, partition)
    return handle


def run_partition(
    plan: BatchPlan,
    partition: int,
    schema: pa.Schema,
    batches: Iterable[pa.RecordBatch],
    client: CoordinatorClient | None = None,
    task: str | None = None,
) -> BranchOutcome:
    """Run this partition's branches of one attempt to the end (see module docstring);
    ``task`` names the Spark task attempt running it (its votes carry it).

    A new attempt streams the partition's rows into every participant as Spark hands
    them over (``twophase.engine.feed.prepare_streaming``); only a finish, which may redo a
    lost branch and must check its row count first, holds them.
    """
    started = time.perf_counter()
    cl = client or _shared_client(plan.coordinator_url, plan.token, plan.retry_budget,
                                  plan.ca_pem, plan.token_file)
    out = BranchOutcome(partition=partition)
    try:
        _settle_earlier(plan, partition, cl, out)
        if plan.mode == "finish":
            rows = list(batches)  # a redo is rare and must know the count first
            out.rows = sum(b.num_rows for b in rows)
            finish_commit(plan, partition, schema, rows, cl, out)
        else:
            _run_attempt(plan, partition, schema, iter(batches), out, task)
    finally:
        for part in plan.participants:
            part.close()
        out.task_s = time.perf_counter() - started
    return out


_CLIENTS: dict[tuple[str, str | None, float, str | None, str | None], CoordinatorClient] = {}
_CLIENTS_LOCK = threading.Lock()


def _shared_client(
    url: str, token: str | None, retry_budget: float, ca_pem: str | None,
    token_file: str | None = None,
) -> CoordinatorClient:
    """One client per coordinator in this process: Spark reuses its Python workers across
    tasks and batches, so a task finds the connection pool of the one before it instead
    of building a client and opening connections (the client is thread-safe)."""
    from twophase.client.api import CoordinatorClient, pinned

    key = (url, token, retry_budget, ca_pem, token_file)
    with _CLIENTS_LOCK:
        cl = _CLIENTS.get(key)
        if cl is None:
            # the token file only where this host has it (a mounted secret); else the
            # plan's token alone, which the driver renews each batch
            usable = token_file if token_file and os.path.isfile(token_file) else None
            cl = _CLIENTS[key] = CoordinatorClient(
                url, token, token_file=usable, verify=pinned(ca_pem),
                retry_budget=retry_budget)
        return cl
