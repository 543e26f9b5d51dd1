"""A branch voted under the retired in-task prepare (twophase 0.3), in doubt across the
upgrade: its transaction lived in its Spark task, so no process of this version holds it.

What is left to do with one (docs/decisions.md, "Kafka's in-task prepare and the
barrier stage retired"): read whether it committed (the marker, then the partition log
from the voted offsets: tansu can leave a committed transaction's marker unapplied),
abort it by fencing its transactional.id (``init_transactions`` aborts what a dead
producer left open), and, when it did not commit under a COMMIT decision, say that it
must be redone; the redo prepares it again in the current mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from twophase.participant import BranchRef, BranchStatus, Handle, ParticipantError, PrepareRefused
from twophase.sinks.kafka.clients import PRODUCERS, parse_offsets
from twophase.sinks.kafka.log import read_branch
from twophase.sinks.kafka.producers import cache_key, new_producer, release
from twophase.sinks.kafka.records import headers

if TYPE_CHECKING:
    from twophase.sinks.kafka.participant import KafkaParticipant

__all__ = ["RETIRED", "abort", "commit", "committed_in_log", "is_in_task", "voted_status"]

RETIRED: Final = (
    'prepare="in_task" was retired in 0.4: use "resumable" (the default: the task\'s own '
    'transaction, committed by the driver, no barrier stage) or "staged"'
)
"""The refusal of the retired mode, at construction (:func:`.options.check_prepare`)."""


def is_in_task(handle: Handle | None) -> bool:
    """A 0.3 in-task vote: a transactional.id and no resumable or staged mode named."""
    return (handle is not None and "transactional_id" in handle
            and handle.get("prepare") not in ("resumable", "staged"))


def voted_status(p: KafkaParticipant, branch: BranchRef, voted: Handle) -> BranchStatus:
    """COMMITTED when the marker or the log from the voted offsets says so, else ABSENT."""
    found = p.status(branch)
    if (found is BranchStatus.ABSENT and voted.get("offsets")
            and committed_in_log(p, branch, voted)):
        return BranchStatus.COMMITTED
    return found


def commit(p: KafkaParticipant, branch: BranchRef, handle: Handle) -> None:
    """Done when it committed; otherwise it cannot be committed from here: redo it."""
    p._check_branch(branch)
    if handle.get("already_committed") == "yes":
        return
    if voted_status(p, branch, handle) is BranchStatus.COMMITTED:
        return
    raise ParticipantError(
        f"{p.describe()}: kafka branch {branch.branch_id} of batch {branch.batch_id} was "
        "prepared in its task by the retired in-task prepare (twophase 0.3) and cannot be "
        "committed from another process: it must be redone (prepare again and commit "
        "under the existing COMMIT decision; `twophase resolve` aborts it when undecided)"
    )


def abort(p: KafkaParticipant, branch: BranchRef, handle: Handle) -> None:
    """Fence the branch's in-task transactional.id: the broker aborts what it left open."""
    p._check_branch(branch)
    if handle.get("already_committed") == "yes":
        return
    PRODUCERS.drop(cache_key(p, branch))  # about to be fenced by the init below
    try:
        producer = new_producer(p, branch)
    except PrepareRefused as exc:
        raise ParticipantError(str(exc)) from exc
    release(p, branch, producer)


def committed_in_log(p: KafkaParticipant, branch: BranchRef, voted: Handle) -> bool:
    """Whether the partition logs show this branch's records committed, read from the
    voted offsets (the log is the ground truth: tansu applies a transactional offset
    commit only once every other transaction open on its partitions has ended). With
    settings the log reader cannot use (SASL GSSAPI or OAUTHBEARER) the marker alone is
    trusted."""
    if not p.log_readable():
        return False
    start = parse_offsets(voted.get("offsets", ""))
    try:
        seen = read_branch(p.config, p.topic, dict(headers(branch)), start,
                           timeout=p.connect_timeout_s)
    except ParticipantError as exc:
        raise ParticipantError(
            f"{p.describe()}: cannot read the log to check branch "
            f"{branch.branch_id} of batch {branch.batch_id}: {exc}"
        ) from exc
    return bool(seen.committed)
