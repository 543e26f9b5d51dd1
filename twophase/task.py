"""What one task does for one partition of one micro-batch: its branches' share of 2PC.

This runs on a Spark executor (inside ``mapInArrow``), but nothing here imports Spark:
tests drive it directly with real participants and a real coordinator. One task owns
the branches ``(participant, p)`` of every participant for its partition ``p``:

1. settle what earlier attempts of this checkpoint left prepared (recovery rule);
2. ``prepare`` (the default, in ordinary tasks): prepare every branch and end, the votes
   going back with the job's result; the driver sends them (``twophase.decide``) and
   applies the decision (``twophase.commit``);
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
commits the whole batch at once and acknowledges them (``twophase.driver``); a finish that
redoes such a branch returns the new handle in its outcome for that commit.

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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from twophase import failpoints
from twophase.digest import KINDS, RowsDigest, digest_kind, rows_digest
from twophase.errors import RedoMismatch, TargetProblem
from twophase.feed import first_rows, prepare_streaming
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
    RecoveryAction,
    Transaction,
    TxnKey,
    branch_id,
    recovery_action,
)
from twophase.wire import AckBody, BranchMetrics, VoteIn, acks_body, votes_body

if TYPE_CHECKING:
    import pyarrow as pa

    from twophase.client import CoordinatorClient

__all__ = ["INPUT_SPLIT", "PREPARE", "BatchPlan", "BranchOutcome", "redone_handles",
           "relay_acks", "run_partition", "split_of"]

PREPARE: Final = "prepare"
"""The plan's mode when every participant's prepare is durable: tasks prepare and hand
their votes back with the job's result; the driver sends them and commits (no task waits
for the decision, no barrier stage)."""

INPUT_SPLIT = "input"
"""The batch's partitions as Spark read them (the other split is "hash", of every column)."""


def split_of(handle: Mapping[str, str]) -> str:
    """How the partition behind a vote was split (votes from before this was recorded
    were all split by hash)."""
    return handle.get("split", "hash")


@dataclass(frozen=True)
class BatchPlan:
    """Everything a task needs, shipped from the driver (must pickle)."""

    key: TxnKey  # the attempt this task runs
    epoch: int
    partitions: int
    mode: str  # PREPARE or "run" a new attempt, or "finish" one whose decision is COMMIT
    coordinator_url: str
    token: str | None = field(repr=False)  # never in logs or Spark's task descriptions
    participants: tuple[Participant, ...]
    handles: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # finish mode
    digests: Mapping[str, str] = field(default_factory=dict)  # finish mode: voted digests
    ack_earlier: tuple[int, ...] = ()  # earlier attempts still waiting for abort acks
    decision_timeout: float = 600.0
    ca_pem: str | None = field(default=None, repr=False)  # an embedded coordinator's TLS cert
    split: str = "hash"  # how the driver split the batch: "hash" or INPUT_SPLIT
    retry_budget: float = 120.0  # seconds a coordinator may stay unreachable (sink option)
    driver_acks: bool = False  # the task returns its acks for the driver to relay (sink)
    token_file: str | None = None  # re-read after a 401 where readable (a rotated token)

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
    prepare_s: float = 0.0  # first row asked of Spark -> every participant prepared
    wait_s: float = 0.0  # vote answered -> decision known
    commit_s: float = 0.0  # decision known -> branches committed, acks ready
    vote_s: float = 0.0  # the vote call
    task_s: float = 0.0  # the whole of run_partition: the job's time minus this is Spark's
    error: str = ""
    acks: str = ""  # driver_acks: this task's acks as the wire's ack bodies (JSON list)
    redone_handles: str = ""  # batch scope: {branch id: handle} of branches redone (JSON)
    votes: str = ""  # prepare mode: this task's votes as the wire's vote bodies (JSON list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


PLAN_PROPERTY: Final = "twophase.batch.plan"  # the Spark job's local property: see below


def plan_property(plan: BatchPlan) -> str:
    """The batch's part of ``plan`` as JSON, for ``PLAN_PROPERTY``: the driver plans the
    job's DataFrame once, before it knows the batch's attempt, so the task reads the
    attempt from the job. Only what names the batch: participants, coordinator and token
    stay in the task's function (Spark's event log records job properties)."""
    return json.dumps({
        "key": list(plan.key), "epoch": plan.epoch, "partitions": plan.partitions,
        "mode": plan.mode, "handles": plan.handles, "digests": plan.digests,
        "ack_earlier": list(plan.ack_earlier), "split": plan.split,
    })


def plan_from_property(template: BatchPlan, value: str | None) -> BatchPlan:
    """``template`` (the sink's fixed part) with the batch read from ``plan_property``."""
    if not value:
        raise ParticipantError(
            f"the task found no {PLAN_PROPERTY} property on its job: the sink's job was "
            "started without it (a twophase bug: please report it)")
    d = json.loads(value)
    return replace(template, key=TxnKey(*d["key"]), epoch=d["epoch"],
                   partitions=d["partitions"], mode=d["mode"], handles=d["handles"],
                   digests=d["digests"], ack_earlier=tuple(d["ack_earlier"]),
                   split=d["split"])


def _acknowledge(
    plan: BatchPlan,
    client: CoordinatorClient,
    out: BranchOutcome,
    acks: Sequence[tuple[str, Decision]],
    measured: Mapping[str, BranchMetrics],
) -> None:
    """Send this task's acks, or (``driver_acks``) hand them to the driver."""
    if not acks:
        return
    if plan.driver_acks:
        out.acks = json.dumps(acks_body(plan.epoch, acks, measured)["acks"])
    else:
        client.ack(plan.key, plan.epoch, acks, measured)


def relay_acks(
    client: CoordinatorClient, key: TxnKey, epoch: int, outcomes: Iterable[Mapping[str, Any]]
) -> Transaction | None:
    """The driver's half of ``driver_acks``: every task's acks in one call. Returns the
    transaction as the coordinator has it afterwards, or None when no task had any."""
    bodies: list[AckBody] = [a for o in outcomes for a in json.loads(o.get("acks") or "[]")]
    if not bodies:
        return None
    return client.ack(key, epoch, [(a["branch"], Decision(a["outcome"])) for a in bodies],
                      {a["branch"]: a["metrics"] for a in bodies if "metrics" in a})


def redone_handles(outcomes: Iterable[Mapping[str, Any]]) -> dict[str, Handle]:
    """The handles of batch-scope branches the tasks redid (branch id -> handle): the
    driver commits those instead of the lost ones the coordinator recorded."""
    out: dict[str, Handle] = {}
    for o in outcomes:
        out.update(json.loads(o.get("redone_handles") or "{}"))
    return out


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


def _batch_commits(part: Participant, decision: Decision) -> bool:
    """True when the driver, not this task, applies ``decision`` to ``part``'s branch (a
    COMMIT of a participant that commits once per batch)."""
    return decision == Decision.COMMIT and part.commit_scope == CommitScope.BATCH


def _apply(
    part: Participant, ref: BranchRef, handle: Handle | None, decision: Decision
) -> None:
    """Apply the decision to one branch, between the commit failpoints."""
    failpoints.hit("before_commit", part.name, ref.partition)
    if is_empty_branch(handle):
        pass  # nothing was prepared, so there is nothing to make visible or discard
    elif decision == Decision.COMMIT:
        part.commit(ref, handle)
    else:
        part.abort(ref, handle)
    failpoints.hit("after_commit", part.name, ref.partition)


def _check_redo(
    plan: BatchPlan,
    part: Participant,
    partition: int,
    schema: pa.Schema,
    batches: Sequence[pa.RecordBatch],
) -> None:
    """A redo must write what was voted on. The replay must be split as the vote was
    (else it holds other rows), and the replayed partition's content digest, computed
    the way the voted one was (``twophase.digest``: a vote stored by an older version
    is checked with its own algorithm), must equal the one stored with the vote. If
    either differs (changed Spark settings, a nondeterministic column or source), refuse
    rather than land other rows, and say how the operator settles it. A vote without a
    digest (an older client) is not checked; one made by an algorithm this version does
    not know (a newer version voted) is refused."""
    bid = branch_id(part.name, partition)
    handle = plan.handles.get(bid, {})
    if handle and split_of(handle) != plan.split:
        raise ParticipantError(
            f"{part.describe()} partition {partition}: the committed vote's rows were split "
            f"{split_of(handle)!r} but this replay is split {plan.split!r} (Spark now reads "
            "the batch into another number of partitions); restart with the settings the "
            "batch was first run with so the lost branch can be redone exactly"
        )
    voted = plan.digests.get(bid)
    if voted is None:
        return
    k = plan.key
    kind = digest_kind(voted)
    if kind not in KINDS:
        raise RedoMismatch(
            f"{part.describe()}: cannot redo branch {bid} of sink {k.sink!r} batch "
            f"{k.batch_id} (attempt {k.attempt}, lineage {k.lineage}): its vote carries a "
            f"content digest of kind {kind!r}, which this version of twophase cannot "
            f"compute (it knows {', '.join(KINDS)}), so the replay cannot be checked and "
            "nothing was written. Restart the query with the twophase version that voted "
            "(or a newer one) to redo the branch."
        )
    digest = rows_digest(schema, batches, kind)
    if voted == digest:
        return
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
    redone: dict[str, Handle] = {}
    for part in plan.participants:
        ref = plan.ref(part, partition)
        bid = branch_id(part.name, partition)
        voted = plan.handles.get(bid)
        if is_empty_branch(voted):
            acks.append((bid, Decision.COMMIT))  # voted with no rows: nothing to finish
            continue
        tc = time.perf_counter()
        status = part.voted_status(ref, voted)
        action = recovery_action(Decision.COMMIT, status, part.commit_scope)
        if action == RecoveryAction.COMMIT:
            _apply(part, ref, voted, Decision.COMMIT)
        elif action == RecoveryAction.COMMIT_BATCH:
            continue  # prepared and whole: the driver commits the batch and acknowledges
        elif action == RecoveryAction.REDO:
            # Lost (a Kafka branch dies with its producer): write it again and commit at
            # once; the participant's marker makes a second redo write nothing.
            _check_redo(plan, part, partition, schema, batches)
            handle = part.redo(ref, schema, batches, voted)
            out.redone += 1
            if part.commit_scope == CommitScope.BATCH:
                redone[bid] = {**handle, "split": plan.split}  # the driver's batch commit
                continue
            _apply(part, ref, handle, Decision.COMMIT)
        acks.append((bid, Decision.COMMIT))
        measured[bid] = {"commit_s": time.perf_counter() - tc}
    if redone:
        out.redone_handles = json.dumps(redone)
    failpoints.hit("before_ack", None, partition)
    _acknowledge(plan, client, out, acks, measured)
    out.commit_s = time.perf_counter() - t0
    out.decision = Decision.COMMIT.value


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
        _acknowledge(plan, client, out, [(ref.branch_id, Decision.ABORT)
                                         for _, ref, _ in prepared], {})
        out.decision = Decision.ABORT.value
        out.error = next((v.reason or "" for v in votes if not v.yes), "")
        return
    out.prepare_s = time.perf_counter() - t0
    answer = client.vote(plan.key, plan.epoch, votes)
    failpoints.hit("after_vote", None, partition)

    t1 = time.perf_counter()
    out.vote_s = t1 - t0 - out.prepare_s
    refused = [v for v in votes if not v.yes]
    if refused:
        out.error = f"{refused[0].branch} voted NO: {refused[0].reason}"
    # The last voter's answer already carries the decision: no long-poll needed then.
    decision = answer.decision or _await_decision(plan, client)
    out.wait_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    acks: list[tuple[str, Decision]] = []
    measured_acks: dict[str, BranchMetrics] = {}
    for part, ref, handle in prepared:
        if _batch_commits(part, decision):
            continue  # the driver commits the batch's files at once and acknowledges
        tc = time.perf_counter()
        _apply(part, ref, handle, decision)
        acks.append((ref.branch_id, decision))
        measured_acks[ref.branch_id] = {"wait_s": out.wait_s,
                                        "commit_s": time.perf_counter() - tc}
    failpoints.hit("before_ack", None, partition)
    _acknowledge(plan, client, out, acks, measured_acks)
    out.commit_s = time.perf_counter() - t2
    out.decision = decision.value


def _hand_over_votes(
    plan: BatchPlan, votes: list[VoteIn], unexpected: Exception | None, out: BranchOutcome,
    t0: float,
) -> None:
    """``prepare`` mode: the task's votes go back with the job's result, and the driver
    sends every task's at once (``twophase.decide``): one result per partition is what
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
        client.vote(plan.key, plan.epoch, votes)
    finally:
        for part, ref, handle in prepared:
            if not is_empty_branch(handle):
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
    task: str | None = None,
) -> BranchOutcome:
    """Run this partition's branches of one attempt to the end (see module docstring);
    ``task`` names the Spark task attempt running it (its votes carry it).

    A new attempt streams the partition's rows into every participant as Spark hands
    them over (``twophase.feed.prepare_streaming``); only a finish, which may redo a lost branch
    and must check its row count first, holds them.
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
            _finish_commit(plan, partition, schema, rows, cl, out)
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
    from twophase.client import CoordinatorClient, pinned

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
