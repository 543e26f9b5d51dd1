"""The ``finish`` mode of a task, and the recovery rule for earlier attempts every mode
shares: COMMIT is already decided for the attempt (a restart found it in doubt), so a
lost branch (a Kafka branch dies with its producer) is written again, only when the
replay holds exactly the rows that were voted on (``check_redo``); the driver commits it
with every other branch, as it commits a new attempt's (``twophase.engine.commit``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from twophase.digest import KINDS, digest_kind, rows_digest
from twophase.engine.plan import BatchPlan, BranchOutcome, split_of
from twophase.errors import RedoMismatch
from twophase.participant import Handle, Participant, ParticipantError, is_empty_branch
from twophase.protocol import Decision, RecoveryAction, branch_id, recovery_action

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["check_redo", "redo_lost", "settle_earlier"]


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


def redo_lost(
    plan: BatchPlan,
    partition: int,
    schema: pa.Schema,
    batches: Sequence[pa.RecordBatch],
    out: BranchOutcome,
) -> None:
    """COMMIT is decided: write again each of this partition's branches that is lost
    (ABSENT: a Kafka branch dies with its producer), once the replay is checked to hold
    the voted rows, and hand the new handles back in ``out.redone_handles``. Nothing is
    committed or acknowledged here: the driver commits every branch from its vote's
    handle, a redone one from its new handle (``Committer.apply``). A second redo of a
    branch the driver committed meanwhile writes nothing (the participant's marker)."""
    redone: dict[str, Handle] = {}
    for part in plan.participants:
        ref = plan.ref(part, partition)
        bid = branch_id(part.name, partition)
        voted = plan.handles.get(bid)
        if is_empty_branch(voted) or bid in plan.acked:
            continue  # voted with no rows, or applied (or given up) already
        action = recovery_action(Decision.COMMIT, part.voted_status(ref, voted),
                                 part.commit_scope)
        if action == RecoveryAction.REDO:
            check_redo(plan, part, partition, schema, batches)
            redone[bid] = {**part.redo(ref, schema, batches, voted), "split": plan.split}
            out.redone += 1
    if redone:
        out.redone_handles = json.dumps(redone)
