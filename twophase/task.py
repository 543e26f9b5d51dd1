"""What one task does for one partition of one micro-batch: its branches' share of 2PC.

This runs on a Spark executor (inside ``mapInArrow``), but nothing here imports Spark:
tests drive it directly with real participants and a real coordinator. One task owns
the branches ``(participant, p)`` of every participant for its partition ``p``:

1. settle what earlier attempts of this checkpoint left prepared (recovery rule);
2. ``run``: prepare every branch, vote, wait for the decision, apply it, acknowledge;
   ``finish``: COMMIT is already decided, so commit what is prepared and redo what is
   lost (Kafka), then acknowledge.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twophase import failpoints
from twophase.digest import rows_digest
from twophase.errors import RedoMismatch
from twophase.participant import (
    BranchRef,
    Handle,
    Participant,
    ParticipantError,
    PrepareRefused,
)
from twophase.protocol import Decision, RecoveryAction, TxnKey, branch_id, recovery_action
from twophase.wire import BranchMetrics, VoteIn

if TYPE_CHECKING:
    import pyarrow as pa

    from twophase.client import CoordinatorClient

__all__ = ["BatchPlan", "BranchOutcome", "run_partition"]


@dataclass(frozen=True)
class BatchPlan:
    """Everything a task needs, shipped from the driver (must pickle)."""

    key: TxnKey  # the attempt this task runs
    epoch: int
    partitions: int
    mode: str  # "run" a new attempt, or "finish" one whose decision is COMMIT
    coordinator_url: str
    token: str | None = field(repr=False)  # never in logs or Spark's task descriptions
    participants: tuple[Participant, ...]
    handles: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # finish mode
    digests: Mapping[str, str] = field(default_factory=dict)  # finish mode: voted digests
    ack_earlier: tuple[int, ...] = ()  # earlier attempts still waiting for abort acks
    decision_timeout: float = 600.0
    ca_pem: str | None = field(default=None, repr=False)  # an embedded coordinator's TLS cert
    retry_budget: float = 120.0  # seconds a coordinator may stay unreachable (sink option)

    def ref(
        self, participant: Participant, partition: int, attempt: int | None = None
    ) -> BranchRef:
        key = self.key if attempt is None else self.key._replace(attempt=attempt)
        return BranchRef(*key, participant=participant.name, partition=partition)


@dataclass
class BranchOutcome:
    """What a task reports back to the driver (one per partition)."""

    partition: int
    rows: int = 0
    decision: str = ""
    recovered: int = 0  # leftovers of earlier attempts aborted
    redone: int = 0  # lost branches written again under a COMMIT decision
    prepare_s: float = 0.0
    wait_s: float = 0.0
    commit_s: float = 0.0
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _settle_earlier(
    plan: BatchPlan, partition: int, client: CoordinatorClient, out: BranchOutcome
) -> None:
    """Recovery rule for earlier attempts (all decided ABORT, or never decided: begin
    only starts a new attempt after an abort): abort whatever they left PREPARED, then
    acknowledge to the attempts still waiting."""
    for attempt in range(1, plan.key.attempt):
        acks: list[tuple[str, Decision]] = []
        for part in plan.participants:
            ref = plan.ref(part, partition, attempt)
            action = recovery_action(Decision.ABORT, part.status(ref))
            if action == RecoveryAction.ABORT:
                part.abort(ref, None)
                out.recovered += 1
            acks.append((branch_id(part.name, partition), Decision.ABORT))
        if attempt in plan.ack_earlier:
            client.ack(plan.key._replace(attempt=attempt), plan.epoch, acks)


def _apply(
    part: Participant, ref: BranchRef, handle: Handle | None, decision: Decision
) -> None:
    """Apply the decision to one branch, between the commit failpoints."""
    failpoints.hit("before_commit", part.name, ref.partition)
    if decision == Decision.COMMIT:
        part.commit(ref, handle)
    else:
        part.abort(ref, handle)
    failpoints.hit("after_commit", part.name, ref.partition)


def _check_redo(plan: BatchPlan, part: Participant, partition: int, digest: str) -> None:
    """A redo must write what was voted on: the replayed partition's content digest must
    equal the one stored with the vote. If it differs (a nondeterministic column or
    source), refuse rather than land other rows, and say how the operator settles it.
    A vote without a digest (an older client) is not checked."""
    bid = branch_id(part.name, partition)
    voted = plan.digests.get(bid)
    if voted is None or voted == digest:
        return
    k = plan.key
    raise RedoMismatch(
        f"{part.describe()}: cannot redo branch {bid} of sink {k.sink!r} batch {k.batch_id} "
        f"(attempt {k.attempt}, lineage {k.lineage}): the replayed partition {partition} has "
        f"other rows than were voted on (digest {digest}, voted {voted}); the query's "
        "input or transformation is not deterministic, so the lost branch cannot be redone "
        "exactly and nothing was written. Settle it: either re-drive (make the replay "
        "return the voted rows, e.g. restore the source files, and restart the query: it "
        "redoes the branch) or accept the loss of this branch's rows with POST "
        f"{{coordinator}}/v1/admin/txns/{k.sink}/{k.lineage}/{k.batch_id}/{k.attempt}/force-ack "
        f'{{"branch": "{bid}", "outcome": "COMMIT"}} (see docs/coordinator-api.md)'
    )


def _finish_commit(
    plan: BatchPlan,
    partition: int,
    schema: pa.Schema,
    batches: Sequence[pa.RecordBatch],
    client: CoordinatorClient,
    out: BranchOutcome,
) -> None:
    """COMMIT is decided: COMMITTED -> nothing, PREPARED -> commit, ABSENT -> redo."""
    t0 = time.perf_counter()
    acks: list[tuple[str, Decision]] = []
    measured: dict[str, BranchMetrics] = {}
    for part in plan.participants:
        ref = plan.ref(part, partition)
        bid = branch_id(part.name, partition)
        tc = time.perf_counter()
        action = recovery_action(Decision.COMMIT, part.status(ref))
        if action == RecoveryAction.COMMIT:
            _apply(part, ref, plan.handles.get(bid), Decision.COMMIT)
        elif action == RecoveryAction.REDO:
            # Lost (a Kafka branch dies with its producer): write it again and commit at
            # once; the participant's marker makes a second redo write nothing.
            _check_redo(plan, part, partition, rows_digest(schema, batches))
            _apply(part, ref, part.prepare(ref, schema, batches), Decision.COMMIT)
            out.redone += 1
        acks.append((bid, Decision.COMMIT))
        measured[bid] = {"commit_s": time.perf_counter() - tc}
    failpoints.hit("before_ack", None, partition)
    client.ack(plan.key, plan.epoch, acks, measured)
    out.commit_s = time.perf_counter() - t0
    out.decision = Decision.COMMIT.value


def _run_attempt(
    plan: BatchPlan,
    partition: int,
    schema: pa.Schema,
    batches: Sequence[pa.RecordBatch],
    client: CoordinatorClient,
    out: BranchOutcome,
) -> None:
    t0 = time.perf_counter()
    prepared: list[tuple[Participant, BranchRef, Handle]] = []
    votes: list[VoteIn] = []
    digest = rows_digest(schema, batches)  # stored with the vote: a redo must match it
    try:
        for part in plan.participants:
            ref = plan.ref(part, partition)
            bid = branch_id(part.name, partition)
            failpoints.hit("before_prepare", part.name, partition)
            tp = time.perf_counter()
            try:
                handle = part.prepare(ref, schema, batches)
            except PrepareRefused as exc:
                votes.append(VoteIn(branch=bid, yes=False, reason=str(exc)))
                break  # one NO decides ABORT: preparing the rest would be wasted work
            prepared.append((part, ref, handle))
            failpoints.hit("after_prepare", part.name, partition)
            measured: BranchMetrics = {"prepare_s": time.perf_counter() - tp, "rows": out.rows}
            votes.append(VoteIn(branch=bid, yes=True, handle=dict(handle), metrics=measured,
                                digest=digest))
    except Exception as exc:
        # An unexpected failure while preparing: vote NO with the cause so the batch
        # aborts now instead of at the vote deadline, undo what this task prepared,
        # and fail the task so the driver sees the error.
        bid = branch_id(part.name, partition)
        votes.append(VoteIn(branch=bid, yes=False, reason=f"{type(exc).__name__}: {exc}"))
        _vote_and_abort(plan, client, votes, prepared)
        raise
    out.prepare_s = time.perf_counter() - t0
    answer = client.vote(plan.key, plan.epoch, votes)
    failpoints.hit("after_vote", None, partition)

    t1 = time.perf_counter()
    # The last voter's answer already carries the decision: no long-poll needed then.
    decision = answer.decision or _await_decision(plan, client)
    out.wait_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    acks: list[tuple[str, Decision]] = []
    measured_acks: dict[str, BranchMetrics] = {}
    for part, ref, handle in prepared:
        tc = time.perf_counter()
        _apply(part, ref, handle, decision)
        acks.append((ref.branch_id, decision))
        measured_acks[ref.branch_id] = {"wait_s": out.wait_s,
                                        "commit_s": time.perf_counter() - tc}
    failpoints.hit("before_ack", None, partition)
    if acks:
        client.ack(plan.key, plan.epoch, acks, measured_acks)
    out.commit_s = time.perf_counter() - t2
    out.decision = decision.value
    refused = [v for v in votes if not v.yes]
    if refused:
        out.error = f"{refused[0].branch} voted NO: {refused[0].reason}"


def _vote_and_abort(
    plan: BatchPlan,
    client: CoordinatorClient,
    votes: list[Any],
    prepared: list[tuple[Participant, BranchRef, Handle]],
) -> None:
    try:
        client.vote(plan.key, plan.epoch, votes)
    finally:
        for part, ref, handle in prepared:
            part.abort(ref, handle)


def _await_decision(plan: BatchPlan, client: CoordinatorClient) -> Decision:
    deadline = time.monotonic() + plan.decision_timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ParticipantError(
                f"no decision for {plan.key.sink} batch {plan.key.batch_id} attempt "
                f"{plan.key.attempt} within {plan.decision_timeout:.0f}s"
            )
        txn = client.await_decision(plan.key, timeout=min(remaining, 30.0))
        if txn.decision is not None:
            return txn.decision


def run_partition(
    plan: BatchPlan,
    partition: int,
    schema: pa.Schema,
    batches: Iterable[pa.RecordBatch],
    client: CoordinatorClient | None = None,
) -> BranchOutcome:
    """Run this partition's branches of one attempt to the end (see module docstring).

    The partition's rows are held in memory as Arrow batches: every participant reads
    them, and a redo may need them again.
    """
    from twophase.client import CoordinatorClient, pinned

    own_client = client is None
    cl = client or CoordinatorClient(plan.coordinator_url, plan.token,
                                     verify=pinned(plan.ca_pem),
                                     retry_budget=plan.retry_budget)
    rows = list(batches)
    out = BranchOutcome(partition=partition, rows=sum(b.num_rows for b in rows))
    try:
        _settle_earlier(plan, partition, cl, out)
        if plan.mode == "finish":
            _finish_commit(plan, partition, schema, rows, cl, out)
        else:
            _run_attempt(plan, partition, schema, rows, cl, out)
    finally:
        for part in plan.participants:
            part.close()
        if own_client:
            cl.close()
    return out
