"""The two-phase-commit protocol as a pure state machine.

Nothing here does I/O or reads a clock: time arrives as ``now`` (seconds, any epoch)
inside each event. The coordinator's store loads a :class:`Transaction`, feeds it one
event through :func:`handle`, and writes the result back with a compare-and-set on the
row's ``version``; the HTTP layer only translates. Because every transition is a plain
function of (state, event), every transition is testable without a server, and the
property tests in ``tests/test_protocol_properties.py`` drive this module directly.

Model (one object per *attempt* of one checkpoint of one sink lineage)::

    OPEN --vote--> PREPARING --all YES--> COMMITTING --all acked--> COMMITTED
      |                |
      +---NO / deadline / abandon---> ABORTING --prepared branches acked--> ABORTED

A decision (COMMIT or ABORT) is written once and never changes. No decision means
abort (presumed abort). Every message is idempotent: the same message twice leaves the
transaction unchanged and gets the same reply.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Final, NamedTuple

from twophase.errors import (
    IllegalTransition,
    InvalidRequest,
    ProtocolError,
    StaleEpoch,
    UnknownBranch,
)
from twophase.names import validate_name

__all__ = [
    "TRANSITIONS",
    "Abandon",
    "Ack",
    "AdminAbort",
    "Begin",
    "BeginKind",
    "BeginResult",
    "BranchState",
    "Decision",
    "Event",
    "Expire",
    "ForceAck",
    "IllegalTransition",
    "ProtocolError",
    "SinkRecord",
    "StaleEpoch",
    "State",
    "Transaction",
    "TxnKey",
    "UnknownBranch",
    "Vote",
    "begin",
    "branch_id",
    "committed",
    "handle",
    "parse_branch_id",
    "register",
]


class State(str, enum.Enum):
    OPEN = "OPEN"
    PREPARING = "PREPARING"
    COMMITTING = "COMMITTING"
    COMMITTED = "COMMITTED"
    ABORTING = "ABORTING"
    ABORTED = "ABORTED"

    @property
    def decided(self) -> bool:
        return self in _DECIDED

    @property
    def finished(self) -> bool:
        return self in (State.COMMITTED, State.ABORTED)


class Decision(str, enum.Enum):
    COMMIT = "COMMIT"
    ABORT = "ABORT"


_DECIDED: Final = frozenset({State.COMMITTING, State.COMMITTED, State.ABORTING, State.ABORTED})
_COMMIT_STATES: Final = frozenset({State.COMMITTING, State.COMMITTED})


# ---------------------------------------------------------------------------------------
# identifiers

def branch_id(participant: str, partition: int) -> str:
    """Branch ids are ``participant/partition``; both parts are validated."""
    validate_name("participant name", participant)
    if not isinstance(partition, int) or isinstance(partition, bool) or partition < 0:
        raise InvalidRequest(f"partition must be a non-negative int, got {partition!r}")
    return f"{participant}/{partition}"


def parse_branch_id(bid: str) -> tuple[str, int]:
    participant, _, partition = bid.rpartition("/")
    if not participant or not partition.isdigit():
        raise InvalidRequest(f"malformed branch id {bid!r}")
    return participant, int(partition)


# ---------------------------------------------------------------------------------------
# records


class TxnKey(NamedTuple):
    """What names one transaction: an attempt of one batch of one sink lineage."""

    sink: str
    lineage: str
    batch_id: int
    attempt: int



@dataclass(frozen=True)
class BranchState:
    """One branch of one attempt as the coordinator sees it."""

    vote: Decision | None = None  # COMMIT means voted YES, ABORT means voted NO
    handle: Mapping[str, str] | None = None  # what the participant needs to commit later
    reason: str | None = None  # why it voted NO
    ack: Decision | None = None  # the outcome the branch confirmed it applied


@dataclass(frozen=True)
class Transaction:
    """One attempt of one checkpoint of one sink lineage.

    ``version`` increases by one on every change; stores compare-and-set on it.
    """

    sink: str
    lineage: str
    batch_id: int
    attempt: int
    epoch: int
    partitions: int
    branches: Mapping[str, BranchState]
    deadline: float
    state: State = State.OPEN
    reason: str | None = None  # why it aborted
    created: float = 0.0
    decided_at: float | None = None
    finished_at: float | None = None
    version: int = 0

    @property
    def decision(self) -> Decision | None:
        """The durable decision; ``None`` means undecided, which recovery reads as ABORT."""
        if self.state in _COMMIT_STATES:
            return Decision.COMMIT
        if self.state in (State.ABORTING, State.ABORTED):
            return Decision.ABORT
        return None

    @property
    def effective_decision(self) -> Decision:
        """Presumed abort: with no decision record the outcome is ABORT."""
        return self.decision or Decision.ABORT

    @property
    def key(self) -> TxnKey:
        return TxnKey(self.sink, self.lineage, self.batch_id, self.attempt)

    def pending_acks(self) -> list[str]:
        """Branches whose acknowledgement the current decision still waits for."""
        if self.state == State.COMMITTING:
            return [b for b, s in self.branches.items() if s.ack is None]
        if self.state == State.ABORTING:
            return [
                b for b, s in self.branches.items() if s.vote == Decision.COMMIT and s.ack is None
            ]
        return []


@dataclass(frozen=True)
class SinkRecord:
    """Per-sink registry row: the current writer epoch and lineage."""

    name: str
    epoch: int = 0
    lineage: str | None = None
    last_committed: int | None = None  # highest committed checkpoint of ``lineage``


# ---------------------------------------------------------------------------------------
# events


@dataclass(frozen=True)
class Vote:
    branch: str
    epoch: int
    yes: bool
    now: float
    handle: Mapping[str, str] | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Expire:
    """The clock ticked: abort if the vote deadline has passed and nothing is decided."""

    now: float


@dataclass(frozen=True)
class Abandon:
    """The writer (or a newer one) gives up on an undecided attempt: write ABORT."""

    epoch: int
    reason: str
    now: float


@dataclass(frozen=True)
class AdminAbort:
    """An operator writes ABORT for an undecided attempt whose writer is gone (no epoch
    check); a decided attempt keeps its decision."""

    reason: str
    now: float


@dataclass(frozen=True)
class Ack:
    branch: str
    epoch: int
    outcome: Decision
    now: float


@dataclass(frozen=True)
class ForceAck:
    """An operator states that a branch is settled (e.g. resolved by hand); no epoch check."""

    branch: str
    outcome: Decision
    now: float


Event = Vote | Expire | Abandon | AdminAbort | Ack | ForceAck


class Kind(str, enum.Enum):
    VOTE = "vote"
    EXPIRE = "expire"
    ABANDON = "abandon"
    ADMIN_ABORT = "admin_abort"
    ACK = "ack"
    FORCE_ACK = "force_ack"


_KIND: Final[Mapping[type, Kind]] = {
    Vote: Kind.VOTE,
    Expire: Kind.EXPIRE,
    Abandon: Kind.ABANDON,
    AdminAbort: Kind.ADMIN_ABORT,
    Ack: Kind.ACK,
    ForceAck: Kind.FORCE_ACK,
}

S = State
# The explicit transition table: for each (state, event kind) the states the machine may
# move to. A pair that is missing is illegal. A message that repeats one already applied
# stays in the same state, which is why every decided state lists itself.
TRANSITIONS: Final[Mapping[tuple[State, Kind], frozenset[State]]] = MappingProxyType(
    {
        (S.OPEN, Kind.VOTE): frozenset({S.PREPARING, S.COMMITTING, S.ABORTING, S.ABORTED}),
        (S.OPEN, Kind.EXPIRE): frozenset({S.OPEN, S.ABORTED}),
        (S.OPEN, Kind.ABANDON): frozenset({S.ABORTED}),
        (S.OPEN, Kind.ADMIN_ABORT): frozenset({S.ABORTED}),
        (S.PREPARING, Kind.VOTE): frozenset({S.PREPARING, S.COMMITTING, S.ABORTING, S.ABORTED}),
        (S.PREPARING, Kind.EXPIRE): frozenset({S.PREPARING, S.ABORTING, S.ABORTED}),
        (S.PREPARING, Kind.ABANDON): frozenset({S.ABORTING, S.ABORTED}),
        (S.PREPARING, Kind.ADMIN_ABORT): frozenset({S.ABORTING, S.ABORTED}),
        (S.COMMITTING, Kind.ADMIN_ABORT): frozenset({S.COMMITTING}),
        (S.COMMITTED, Kind.ADMIN_ABORT): frozenset({S.COMMITTED}),
        (S.ABORTING, Kind.ADMIN_ABORT): frozenset({S.ABORTING}),
        (S.ABORTED, Kind.ADMIN_ABORT): frozenset({S.ABORTED}),
        # decided: late votes are answered with the decision; repeats change nothing
        (S.COMMITTING, Kind.VOTE): frozenset({S.COMMITTING}),
        (S.COMMITTING, Kind.EXPIRE): frozenset({S.COMMITTING}),
        (S.COMMITTING, Kind.ACK): frozenset({S.COMMITTING, S.COMMITTED}),
        (S.COMMITTING, Kind.FORCE_ACK): frozenset({S.COMMITTING, S.COMMITTED}),
        (S.COMMITTED, Kind.VOTE): frozenset({S.COMMITTED}),
        (S.COMMITTED, Kind.EXPIRE): frozenset({S.COMMITTED}),
        (S.COMMITTED, Kind.ACK): frozenset({S.COMMITTED}),
        (S.COMMITTED, Kind.FORCE_ACK): frozenset({S.COMMITTED}),
        (S.ABORTING, Kind.VOTE): frozenset({S.ABORTING}),
        (S.ABORTING, Kind.EXPIRE): frozenset({S.ABORTING}),
        (S.ABORTING, Kind.ABANDON): frozenset({S.ABORTING}),
        (S.ABORTING, Kind.ACK): frozenset({S.ABORTING, S.ABORTED}),
        (S.ABORTING, Kind.FORCE_ACK): frozenset({S.ABORTING, S.ABORTED}),
        (S.ABORTED, Kind.VOTE): frozenset({S.ABORTED}),
        (S.ABORTED, Kind.EXPIRE): frozenset({S.ABORTED}),
        (S.ABORTED, Kind.ABANDON): frozenset({S.ABORTED}),
        (S.ABORTED, Kind.ACK): frozenset({S.ABORTED}),
        (S.ABORTED, Kind.FORCE_ACK): frozenset({S.ABORTED}),
    }
)


def handle(txn: Transaction, event: Event) -> Transaction:
    """Apply one event; return the new transaction (the same object if nothing changed).

    Raises a :class:`ProtocolError` for a refused message; a refused message never
    changes anything.
    """
    kind = _KIND[type(event)]
    allowed = TRANSITIONS.get((txn.state, kind))
    if allowed is None:
        raise IllegalTransition(f"{kind.value} is not allowed in state {txn.state.value}")
    new = _HANDLERS[kind](txn, event)
    if new is txn:
        return txn
    if new.state not in allowed:  # pragma: no cover - guards the table against the code
        raise AssertionError(f"{txn.state}->{new.state} on {kind} is not in TRANSITIONS")
    return replace(new, version=txn.version + 1)


def _check_epoch(txn: Transaction, epoch: int) -> None:
    if epoch < txn.epoch:
        raise StaleEpoch(
            f"epoch {epoch} is older than the transaction's writer epoch {txn.epoch}"
        )


def _branch(txn: Transaction, bid: str) -> BranchState:
    try:
        return txn.branches[bid]
    except KeyError:
        raise UnknownBranch(
            f"branch {bid!r} is not one of the {len(txn.branches)} expected branches"
        ) from None


def _with_branch(txn: Transaction, bid: str, st: BranchState) -> Transaction:
    branches = dict(txn.branches)
    branches[bid] = st
    return replace(txn, branches=MappingProxyType(branches))


def _decide(txn: Transaction, decision: Decision, now: float, reason: str | None) -> Transaction:
    if decision == Decision.COMMIT:
        return replace(txn, state=State.COMMITTING, decided_at=now)
    new = replace(txn, state=State.ABORTING, decided_at=now, reason=reason)
    return _maybe_finish(new, now)


def _maybe_finish(txn: Transaction, now: float) -> Transaction:
    if txn.state in (State.COMMITTING, State.ABORTING) and not txn.pending_acks():
        done = State.COMMITTED if txn.state == State.COMMITTING else State.ABORTED
        return replace(txn, state=done, finished_at=now)
    return txn


def _on_vote(txn: Transaction, ev: Event) -> Transaction:
    assert isinstance(ev, Vote)
    _check_epoch(txn, ev.epoch)
    if ev.epoch != txn.epoch:
        raise IllegalTransition(
            f"vote carries epoch {ev.epoch} but attempt {txn.attempt} belongs to epoch {txn.epoch}"
        )
    current = _branch(txn, ev.branch)
    vote = Decision.COMMIT if ev.yes else Decision.ABORT
    if current.vote is not None:
        if current.vote != vote:
            raise IllegalTransition(
                f"branch {ev.branch} already voted {current.vote.value}; a vote never changes"
            )
        return txn  # the same vote again: harmless
    if txn.state.decided:
        # A late first vote (after the deadline or another NO) does not alter a decision.
        # Record nothing: an ABORT decision does not wait for branches that were too late;
        # recovery aborts whatever they left prepared.
        if txn.decision == Decision.COMMIT:  # pragma: no cover - commit needs every vote
            raise AssertionError("COMMIT decided without every vote")
        return txn
    if ev.now >= txn.deadline:
        return _decide(txn, Decision.ABORT, ev.now, "vote deadline passed")
    st = BranchState(
        vote=vote,
        handle=MappingProxyType(dict(ev.handle or {})) if ev.yes else None,
        reason=None if ev.yes else (ev.reason or "voted NO without a reason"),
    )
    txn = _with_branch(replace(txn, state=State.PREPARING), ev.branch, st)
    if not ev.yes:
        return _decide(txn, Decision.ABORT, ev.now, f"{ev.branch} voted NO: {st.reason}")
    if all(s.vote == Decision.COMMIT for s in txn.branches.values()):
        return _decide(txn, Decision.COMMIT, ev.now, None)
    return txn


def _on_expire(txn: Transaction, ev: Event) -> Transaction:
    assert isinstance(ev, Expire)
    if txn.state.decided or ev.now < txn.deadline:
        return txn
    missing = [b for b, s in txn.branches.items() if s.vote is None]
    return _decide(
        txn, Decision.ABORT, ev.now, f"vote deadline passed; no vote from {', '.join(missing)}"
    )


def _on_abandon(txn: Transaction, ev: Event) -> Transaction:
    assert isinstance(ev, Abandon)
    _check_epoch(txn, ev.epoch)
    if txn.state.decided:
        return txn
    return _decide(txn, Decision.ABORT, ev.now, ev.reason)


def _on_admin_abort(txn: Transaction, ev: Event) -> Transaction:
    assert isinstance(ev, AdminAbort)
    if txn.state.decided:
        return txn
    return _decide(txn, Decision.ABORT, ev.now, f"admin: {ev.reason}")


def _apply_ack(txn: Transaction, bid: str, outcome: Decision, now: float) -> Transaction:
    current = _branch(txn, bid)
    decision = txn.decision
    assert decision is not None  # the table admits ACK only in decided states
    if outcome != decision:
        raise IllegalTransition(
            f"branch {bid} acknowledged {outcome.value} but the decision is {decision.value}"
        )
    if current.ack is not None:
        return txn
    if decision == Decision.ABORT and current.vote != Decision.COMMIT:
        return txn  # nothing was waited for: accepted, nothing to record
    return _maybe_finish(_with_branch(txn, bid, replace(current, ack=outcome)), now)


def _on_ack(txn: Transaction, ev: Event) -> Transaction:
    assert isinstance(ev, Ack)
    _check_epoch(txn, ev.epoch)
    return _apply_ack(txn, ev.branch, ev.outcome, ev.now)


def _on_force_ack(txn: Transaction, ev: Event) -> Transaction:
    assert isinstance(ev, ForceAck)
    return _apply_ack(txn, ev.branch, ev.outcome, ev.now)


_HANDLERS: Final = {
    Kind.VOTE: _on_vote,
    Kind.EXPIRE: _on_expire,
    Kind.ABANDON: _on_abandon,
    Kind.ADMIN_ABORT: _on_admin_abort,
    Kind.ACK: _on_ack,
    Kind.FORCE_ACK: _on_force_ack,
}


# ---------------------------------------------------------------------------------------
# begin: the sink-level step that picks or creates the attempt


@dataclass(frozen=True)
class Begin:
    sink: str
    lineage: str
    batch_id: int
    epoch: int
    participants: tuple[str, ...]
    partitions: int
    now: float
    vote_timeout: float = 300.0


class BeginKind(str, enum.Enum):
    NEW = "new"  # run a new attempt (``txn``); first settle ``recover`` if any
    COMMITTED = "committed"  # a replay of a finished batch: return at once
    IN_DOUBT = "in_doubt"  # COMMIT was decided but not every branch acked: finish it


@dataclass(frozen=True)
class BeginResult:
    kind: BeginKind
    sink: SinkRecord
    # the attempt to run, the committed one, or the one to finish; None only for a replay
    # of a checkpoint whose record retention already removed (it is below last_committed)
    txn: Transaction | None
    recover: tuple[Transaction, ...] = field(default=())  # earlier attempts to settle
    changed: tuple[Transaction, ...] = field(default=())  # attempts this step modified
    new_lineage: bool = False


def begin(
    sink: SinkRecord | None,
    attempts: tuple[Transaction, ...],
    req: Begin,
    *,
    committing_elsewhere: tuple[Transaction, ...] = (),
) -> BeginResult:
    """Decide what a driver's ``begin`` means, from the sink row and every earlier
    attempt of this checkpoint in this lineage (oldest first).

    ``committing_elsewhere`` are the sink's COMMITTING transactions of other lineages:
    a switch to a new lineage is refused while one exists, because the old lineage
    would never be replayed to finish it (a lost Kafka branch would stay lost).

    The caller persists ``result.sink`` and every transaction in ``result.changed``
    (including a new ``result.txn``) atomically.
    """
    if not req.participants:
        raise ProtocolError("a sink needs at least one participant")
    if len(set(req.participants)) != len(req.participants):
        raise ProtocolError(f"participant names must be unique, got {list(req.participants)}")
    if req.partitions < 1:
        raise ProtocolError(f"partitions must be >= 1, got {req.partitions}")
    if req.batch_id < 0:
        raise ProtocolError(f"batch id must be >= 0, got {req.batch_id}")
    rec = sink or SinkRecord(name=req.sink)
    if req.epoch < rec.epoch:
        raise StaleEpoch(f"epoch {req.epoch} is older than sink {req.sink!r}'s epoch {rec.epoch}")
    new_lineage = rec.lineage is not None and rec.lineage != req.lineage
    if new_lineage:
        pending = [t for t in committing_elsewhere if t.lineage != req.lineage]
        if pending:
            names = ", ".join(f"{t.lineage}/{t.batch_id}/attempt-{t.attempt}" for t in pending)
            raise ProtocolError(
                f"sink {req.sink!r} starts lineage {req.lineage} (a new checkpoint location) "
                f"while committed batches of an earlier lineage are unfinished: {names}. "
                "Restart the query from its old checkpoint to finish them, or run "
                "`twophase resolve` for the sink, then start the new checkpoint."
            )
    if attempts:
        stored = {parse_branch_id(b)[0] for b in attempts[0].branches}
        if stored != set(req.participants):
            added = sorted(set(req.participants) - stored)
            removed = sorted(stored - set(req.participants))
            raise ProtocolError(
                f"sink {req.sink!r} batch {req.batch_id} was begun with participants "
                f"{sorted(stored)}; this writer has {sorted(req.participants)} (added "
                f"{added}, removed {removed}). A batch must finish with the participants it "
                "started with: restore them until this batch commits, or resolve it."
            )
    rec = replace(
        rec,
        epoch=req.epoch,
        lineage=req.lineage,
        last_committed=None if new_lineage else rec.last_committed,
    )
    if not attempts:
        if (
            not new_lineage
            and rec.last_committed is not None
            and req.batch_id <= rec.last_committed
        ):
            return BeginResult(BeginKind.COMMITTED, rec, None)
        return BeginResult(
            BeginKind.NEW, rec, txn := _new_txn(req, 1, req.partitions), changed=(txn,),
            new_lineage=new_lineage,
        )
    latest = attempts[-1]
    if latest.state == State.COMMITTED:
        return BeginResult(BeginKind.COMMITTED, rec, latest, new_lineage=new_lineage)
    if latest.state == State.COMMITTING:
        aborting = tuple(a for a in attempts[:-1] if a.state == State.ABORTING)
        return BeginResult(
            BeginKind.IN_DOUBT, rec, latest, recover=(*aborting, latest),
            new_lineage=new_lineage,
        )
    changed: list[Transaction] = []
    if not latest.state.decided:
        if latest.epoch == req.epoch:
            # The same writer asks again (a retried HTTP call): the same answer.
            earlier = tuple(a for a in attempts[:-1] if a.state == State.ABORTING)
            return BeginResult(BeginKind.NEW, rec, latest, recover=earlier)
        latest = handle(
            latest,
            Abandon(
                epoch=req.epoch,
                reason=f"abandoned by writer epoch {req.epoch}: a new driver took over",
                now=req.now,
            ),
        )
        changed.append(latest)
        attempts = (*attempts[:-1], latest)
    # P is fixed at the first attempt so that a replayed batch splits the same way.
    txn = _new_txn(req, latest.attempt + 1, attempts[0].partitions)
    changed.append(txn)
    recover = tuple(a for a in attempts if a.state == State.ABORTING)
    return BeginResult(
        BeginKind.NEW, rec, txn, recover=recover, changed=tuple(changed), new_lineage=new_lineage
    )


def register(sink: SinkRecord | None, name: str) -> SinkRecord:
    """A writer (driver) starts: hand it the next epoch, which fences every older one."""
    rec = sink or SinkRecord(name=name)
    return replace(rec, epoch=rec.epoch + 1)


def committed(sink: SinkRecord, txn: Transaction) -> SinkRecord:
    """Advance ``last_committed`` once ``txn`` is COMMITTED (lets retention drop old rows)."""
    if txn.state != State.COMMITTED or sink.lineage != txn.lineage:
        return sink
    last = sink.last_committed
    newest = txn.batch_id if last is None else max(last, txn.batch_id)
    return replace(sink, last_committed=newest)


def _new_txn(req: Begin, attempt: int, partitions: int) -> Transaction:
    branches = {
        branch_id(p, i): BranchState() for p in req.participants for i in range(partitions)
    }
    return Transaction(
        sink=req.sink,
        lineage=req.lineage,
        batch_id=req.batch_id,
        attempt=attempt,
        epoch=req.epoch,
        partitions=partitions,
        branches=MappingProxyType(branches),
        deadline=req.now + req.vote_timeout,
        created=req.now,
    )
