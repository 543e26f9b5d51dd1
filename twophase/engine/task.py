"""What one task does for one partition of one micro-batch: its branches' share of 2PC.

This runs on a Spark executor (inside ``mapInArrow``), but nothing here imports Spark:
tests drive it directly with real participants and a real coordinator. One task owns
the branches ``(participant, p)`` of every participant for its partition ``p``:

1. settle what earlier attempts of this checkpoint left prepared (recovery rule);
2. ``prepare`` (the default, in ordinary tasks): prepare every branch and end, the votes
   going back with the job's result; the driver sends them (``twophase.engine.decide``) and
   applies the decision (``twophase.engine.commit``);
   ``run`` (a participant whose prepare dies with its process, Kafka's in-task
   transaction; one barrier stage): prepare, vote, wait for the decision, apply it,
   acknowledge;
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
from typing import TYPE_CHECKING, Any

from twophase import failpoints
from twophase.client.wire import BranchMetrics, VoteIn, votes_body
from twophase.digest import RowsDigest
from twophase.engine.feed import first_rows, prepare_streaming
from twophase.engine.finish import (
    acknowledge,
    apply_decision,
    check_recorded,
    finish_commit,
    settle_earlier,
)
from twophase.engine.plan import PREPARE, BatchPlan, BranchOutcome
from twophase.errors import RedoMismatch, TargetProblem
from twophase.participant import (
    EMPTY_BRANCH,
    BranchRef,
    Handle,
    Participant,
    ParticipantError,
    PrepareRefused,
    is_empty_branch,
)
from twophase.protocol import (
    CommitScope,
    Decision,
    branch_id,
)

if TYPE_CHECKING:
    import pyarrow as pa

    from twophase.client.api import CoordinatorClient
    from twophase.protocol import Transaction

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
    client: CoordinatorClient,
    out: BranchOutcome,
    task: str | None,
) -> None:
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
    prepared: list[tuple[Participant, BranchRef, Handle]] = []
    votes: list[VoteIn] = []
    unexpected: Exception | None = None
    for part, res in zip(plan.participants, results, strict=True):
        ref, bid = plan.ref(part, partition), branch_id(part.name, partition)
        if isinstance(res, PrepareRefused):
            votes.append(VoteIn(branch=bid, yes=False, reason=str(res), task=task))
        elif isinstance(res, Exception):
            # An unexpected failure while preparing: vote NO with the cause so the batch
            # aborts now instead of at the vote deadline, undo what this task prepared,
            # and fail the task so the driver sees the error.
            votes.append(VoteIn(branch=bid, yes=False, reason=f"{type(res).__name__}: {res}",
                                task=task))
            unexpected = unexpected or res
        else:
            prepared.append((part, ref, res))
            # prepares run together: each branch's time is the partition's prepare time
            measured: BranchMetrics = {"prepare_s": time.perf_counter() - t0, "rows": out.rows}
            votes.append(VoteIn(branch=bid, yes=True, handle={**res, "split": plan.split},
                                metrics=measured, digest=digest.value(), task=task))
    if plan.mode == PREPARE:
        _hand_over_votes(plan, votes, unexpected, out, t0)
        return
    if unexpected is not None:
        _vote_and_abort(plan, client, votes, prepared)
        if not isinstance(unexpected, TargetProblem):
            raise unexpected
        # A target's permanent refusal is said in full by the NO vote (the driver leads
        # its error with it): end the task quietly rather than add Spark's wall of frames.
        acknowledge(plan, client, out, [(ref.branch_id, Decision.ABORT)
                                         for _, ref, _ in prepared], {})
        out.decision = Decision.ABORT.value
        out.error = next((v.reason or "" for v in votes if not v.yes), "")
        return
    out.prepare_s = time.perf_counter() - t0
    # The answer carries this task's branches only (O(own branches), not O(P)): all that
    # check_recorded needs, as a recorded vote (its task and digest) never changes after.
    answer = client.vote(plan.key, plan.epoch, votes, touched=True)
    failpoints.hit("after_vote", None, partition)

    t1 = time.perf_counter()
    out.vote_s = t1 - t0 - out.prepare_s
    refused = [v for v in votes if not v.yes]
    if refused:
        out.error = f"{refused[0].branch} voted NO: {refused[0].reason}"
    # The last voter's answer already carries the decision: no long-poll needed then.
    decided = answer if answer.decision is not None else _await_decision(plan, client)
    decision = decided.decision
    assert decision is not None
    out.wait_s = time.perf_counter() - t1
    if decision == Decision.COMMIT:
        try:  # a stage run again after the decision: only the voted rows may commit
            check_recorded(plan, answer, votes, task)
        except RedoMismatch:
            for part, ref, handle in prepared:
                if not is_empty_branch(handle):
                    part.abort(ref, handle)
            raise
    t2 = time.perf_counter()
    acks: list[tuple[str, Decision]] = []
    measured_acks: dict[str, BranchMetrics] = {}
    for part, ref, handle in prepared:
        if _batch_commits(part, decision):
            continue  # the driver commits the batch's files at once and acknowledges
        tc = time.perf_counter()
        apply_decision(part, ref, handle, decision)
        acks.append((ref.branch_id, decision))
        measured_acks[ref.branch_id] = {"wait_s": out.wait_s,
                                        "commit_s": time.perf_counter() - tc}
    failpoints.hit("before_ack", None, partition)
    acknowledge(plan, client, out, acks, measured_acks)
    out.commit_s = time.perf_counter() - t2
    out.decision = decision.value


def _hand_over_votes(
    plan: BatchPlan, votes: list[VoteIn], unexpected: Exception | None, out: BranchOutcome,
    t0: float,
) -> None:
    """``prepare`` mode: the task's votes go back with the job's result, and the driver
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


def _vote_and_abort(
    plan: BatchPlan,
    client: CoordinatorClient,
    votes: list[Any],
    prepared: list[tuple[Participant, BranchRef, Handle]],
) -> None:
    try:
        client.vote(plan.key, plan.epoch, votes, brief=True)  # the answer is not read
    finally:
        for part, ref, handle in prepared:
            if not is_empty_branch(handle):
                part.abort(ref, handle)


def _await_decision(plan: BatchPlan, client: CoordinatorClient) -> Transaction:
    deadline = time.monotonic() + plan.decision_timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ParticipantError(
                f"no decision for {plan.key.sink} batch {plan.key.batch_id} attempt "
                f"{plan.key.attempt} within {plan.decision_timeout:.0f}s"
            )
        # brief: the state and decision only, not every branch of the batch (P tasks
        # each waiting would fetch O(P) bytes each: O(P^2) in all)
        txn = client.await_decision(plan.key, timeout=min(remaining, 30.0), brief=True)
        if txn.decision is not None:
            return txn


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
            _run_attempt(plan, partition, schema, iter(batches), cl, out, task)
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
