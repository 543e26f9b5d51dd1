"""The ``finish`` mode of a task, and the two steps every mode shares: COMMIT is already
decided for the attempt (a restart found it in doubt), so a prepared branch is committed
and a lost one (a Kafka branch dies with its producer) is written again, only when the
replay holds exactly the rows that were voted on (``check_redo``)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from twophase import failpoints
from twophase.client.wire import BranchMetrics, acks_body
from twophase.digest import KINDS, digest_kind, rows_digest
from twophase.engine.plan import BatchPlan, BranchOutcome, split_of
from twophase.errors import RedoMismatch
from twophase.participant import BranchRef, Handle, Participant, ParticipantError, is_empty_branch
from twophase.protocol import CommitScope, Decision, RecoveryAction, branch_id, recovery_action

if TYPE_CHECKING:
    import pyarrow as pa

    from twophase.client.api import CoordinatorClient

__all__ = ["acknowledge", "apply_decision", "check_redo", "finish_commit",
           "settle_earlier"]


def acknowledge(
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
    else:  # the answer is not read: brief (the whole record would be O(branches))
        client.ack(plan.key, plan.epoch, acks, measured, brief=True)



def settle_earlier(
    plan: BatchPlan, participants: Sequence[Participant], partition: int, attempt: int
) -> tuple[list[tuple[str, Decision]], int]:
    """The recovery rule for one earlier attempt's branches of ``partition`` (every
    earlier attempt is decided ABORT, or never decided: begin starts a new attempt only
    after an abort): abort what it left PREPARED, found by name. Returns the acks to send
    to that attempt and how many branches were aborted (a task does this for its
    partition, the driver for all of them when no task runs)."""
    acks: list[tuple[str, Decision]] = []
    aborted = 0
    for part in participants:
        ref = plan.ref(part, partition, attempt)
        if recovery_action(Decision.ABORT, part.status(ref)) == RecoveryAction.ABORT:
            part.abort(ref, None)
            aborted += 1
        acks.append((ref.branch_id, Decision.ABORT))
    return acks, aborted


def apply_decision(
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



def check_redo(
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


def finish_commit(
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
            apply_decision(part, ref, voted, Decision.COMMIT)
        elif action == RecoveryAction.COMMIT_BATCH:
            continue  # prepared and whole: the driver commits the batch and acknowledges
        elif action == RecoveryAction.REDO:
            # Lost (a Kafka branch dies with its producer): write it again and commit at
            # once; the participant's marker makes a second redo write nothing.
            check_redo(plan, part, partition, schema, batches)
            handle = part.redo(ref, schema, batches, voted)
            out.redone += 1
            if part.commit_scope == CommitScope.BATCH:
                redone[bid] = {**handle, "split": plan.split}  # the driver's batch commit
                continue
            apply_decision(part, ref, handle, Decision.COMMIT)
        acks.append((bid, Decision.COMMIT))
        measured[bid] = {"commit_s": time.perf_counter() - tc}
    if redone:
        out.redone_handles = json.dumps(redone)
    failpoints.hit("before_ack", None, partition)
    acknowledge(plan, client, out, acks, measured)
    out.commit_s = time.perf_counter() - t0
    out.decision = Decision.COMMIT.value

