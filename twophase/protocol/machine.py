"""The per-attempt state machine: events, the transition table, and :func:`handle`.

Model (one object per *attempt* of one checkpoint of one sink lineage)::

    OPEN --vote--> PREPARING --all YES--> COMMITTING --all acked--> COMMITTED
      |                |
      +---NO / deadline / abandon---> ABORTING --prepared branches acked--> ABORTED

A decision (COMMIT or ABORT) is written once and never changes. No decision means
abort (presumed abort). Every message is idempotent: the same message twice leaves the
transaction unchanged and gets the same reply.

:data:`TRANSITIONS` has exactly one entry for each of the 6 x 6 (state, event kind)
pairs: an :class:`Allow` (the states the machine may move to, and whether the event's
writer epoch is checked) or a :class:`Refuse` (the error and why). :func:`handle`
consults the table before anything else, so what is refused where can be read off the
table instead of being inferred from a missing key.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Final

from twophase.errors import IllegalTransition, ProtocolError, StaleEpoch, UnknownBranch
from twophase.protocol.records import BranchState, Decision, State, Transaction

__all__ = [
    "TRANSITIONS",
    "VOTE_CASES",
    "Abandon",
    "Ack",
    "AdminAbort",
    "Allow",
    "Event",
    "Expire",
    "ForceAck",
    "Kind",
    "Refuse",
    "Rule",
    "Vote",
    "VoteCase",
    "VoteOutcome",
    "handle",
    "handle_all",
    "kind_of",
    "vote_case",
]


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
    digest: str | None = None
    task: str | None = None  # the Spark task attempt voting (a retry or a speculative copy)


@dataclass(frozen=True)
class Expire:
    """The clock ticked: abort if the vote deadline has passed and nothing is decided."""

    now: float


@dataclass(frozen=True)
class Abandon:
    """The writer (or a newer one) gives up on an attempt: an undecided one is decided
    ABORT; a decided one is answered unchanged, so a writer whose job failed after the
    last vote learns the COMMIT and finishes it."""

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
    reason: str | None = None  # the operator's why, kept in the history


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


def kind_of(event: Event) -> Kind:
    """The table column an event belongs to."""
    return _KIND[type(event)]


# ---------------------------------------------------------------------------------------
# the transition table


@dataclass(frozen=True)
class Allow:
    """The event is handled: the machine stays or moves to one of ``to``. With ``epoch``
    a writer older than the transaction's is refused first (:class:`StaleEpoch`)."""

    to: frozenset[State]
    epoch: bool = False


@dataclass(frozen=True)
class Refuse:
    """The event is refused in this state, whatever it carries; nothing changes."""

    error: type[ProtocolError]
    why: str


Rule = Allow | Refuse


def _to(*states: State, epoch: bool = False) -> Allow:
    return Allow(frozenset(states), epoch=epoch)


S = State
K = Kind
_NOTHING_DECIDED = Refuse(
    IllegalTransition, "nothing is decided yet, so there is no outcome to acknowledge"
)

# Every (state, kind) pair has exactly one entry. A message that repeats one already
# applied stays in the same state, which is why every decided state lists itself; a
# decided state only moves within its own outcome (a decision never changes).
TRANSITIONS: Final[Mapping[tuple[State, Kind], Rule]] = MappingProxyType(
    {
        # undecided: votes decide; the deadline, the writer and the operator may abort
        (S.OPEN, K.VOTE): _to(S.PREPARING, S.COMMITTING, S.ABORTING, S.ABORTED, epoch=True),
        (S.OPEN, K.EXPIRE): _to(S.OPEN, S.ABORTED),
        (S.OPEN, K.ABANDON): _to(S.ABORTED, epoch=True),
        (S.OPEN, K.ADMIN_ABORT): _to(S.ABORTED),
        (S.OPEN, K.ACK): _NOTHING_DECIDED,
        (S.OPEN, K.FORCE_ACK): _NOTHING_DECIDED,
        (S.PREPARING, K.VOTE): _to(
            S.PREPARING, S.COMMITTING, S.ABORTING, S.ABORTED, epoch=True
        ),
        (S.PREPARING, K.EXPIRE): _to(S.PREPARING, S.ABORTING, S.ABORTED),
        (S.PREPARING, K.ABANDON): _to(S.ABORTING, S.ABORTED, epoch=True),
        (S.PREPARING, K.ADMIN_ABORT): _to(S.ABORTING, S.ABORTED),
        (S.PREPARING, K.ACK): _NOTHING_DECIDED,
        (S.PREPARING, K.FORCE_ACK): _NOTHING_DECIDED,
        # COMMIT decided: late votes, expiry, abandon and admin abort are answered with
        # the decision unchanged; acks finish it
        (S.COMMITTING, K.VOTE): _to(S.COMMITTING, epoch=True),
        (S.COMMITTING, K.EXPIRE): _to(S.COMMITTING),
        (S.COMMITTING, K.ABANDON): _to(S.COMMITTING, epoch=True),
        (S.COMMITTING, K.ADMIN_ABORT): _to(S.COMMITTING),
        (S.COMMITTING, K.ACK): _to(S.COMMITTING, S.COMMITTED, epoch=True),
        (S.COMMITTING, K.FORCE_ACK): _to(S.COMMITTING, S.COMMITTED),
        (S.COMMITTED, K.VOTE): _to(S.COMMITTED, epoch=True),
        (S.COMMITTED, K.EXPIRE): _to(S.COMMITTED),
        (S.COMMITTED, K.ABANDON): _to(S.COMMITTED, epoch=True),
        (S.COMMITTED, K.ADMIN_ABORT): _to(S.COMMITTED),
        (S.COMMITTED, K.ACK): _to(S.COMMITTED, epoch=True),
        (S.COMMITTED, K.FORCE_ACK): _to(S.COMMITTED),
        # ABORT decided: the same, on the abort side
        (S.ABORTING, K.VOTE): _to(S.ABORTING, epoch=True),
        (S.ABORTING, K.EXPIRE): _to(S.ABORTING),
        (S.ABORTING, K.ABANDON): _to(S.ABORTING, epoch=True),
        (S.ABORTING, K.ADMIN_ABORT): _to(S.ABORTING),
        (S.ABORTING, K.ACK): _to(S.ABORTING, S.ABORTED, epoch=True),
        (S.ABORTING, K.FORCE_ACK): _to(S.ABORTING, S.ABORTED),
        (S.ABORTED, K.VOTE): _to(S.ABORTED, epoch=True),
        (S.ABORTED, K.EXPIRE): _to(S.ABORTED),
        (S.ABORTED, K.ABANDON): _to(S.ABORTED, epoch=True),
        (S.ABORTED, K.ADMIN_ABORT): _to(S.ABORTED),
        (S.ABORTED, K.ACK): _to(S.ABORTED, epoch=True),
        (S.ABORTED, K.FORCE_ACK): _to(S.ABORTED),
    }
)


def handle(txn: Transaction, event: Event) -> Transaction:
    """Apply one event; return the new transaction (the same object if nothing changed).

    The table decides first (a :class:`Refuse` entry, then a stale epoch where the entry
    checks it); the event's handler then applies the rules that depend on the event's
    content. Raises a :class:`ProtocolError` for a refused message; a refused message
    never changes anything.
    """
    return handle_all(txn, (event,))[0]


def handle_all(
    txn: Transaction, events: Sequence[Event]
) -> tuple[Transaction, list[tuple[Event, State]]]:
    """Apply ``events`` in order, exactly as :func:`handle` one by one would (the version
    counts each change), and return the result with (event, state after it) for every
    event that changed something. The branches are copied once and each vote or ack
    costs O(1), so a driver's chunk of a thousand votes is not a thousand copies of
    every branch. A refused event raises and leaves ``txn`` as it was: all or nothing."""
    w = _Work(txn)
    changed: list[tuple[Event, State]] = []
    for event in events:
        kind = kind_of(event)
        before = w.txn.state
        rule = TRANSITIONS[(before, kind)]
        if isinstance(rule, Refuse):
            raise rule.error(f"{kind.value} is not allowed in state {before.value}: {rule.why}")
        if rule.epoch:
            _check_epoch(w.txn, _epoch_of(event))
        if not _HANDLERS[kind](w, event):
            continue
        if w.txn.state not in rule.to:  # pragma: no cover - guards the table against the code
            raise AssertionError(f"{before}->{w.txn.state} on {kind} is not in TRANSITIONS")
        w.version += 1
        changed.append((event, w.txn.state))
    if not changed:
        return txn, []
    return w.result(), changed


def _epoch_of(event: Event) -> int:
    if isinstance(event, Vote | Abandon | Ack):
        return event.epoch
    raise AssertionError(f"{type(event).__name__} carries no epoch")  # pragma: no cover


def _check_epoch(txn: Transaction, epoch: int) -> None:
    if epoch < txn.epoch:
        raise StaleEpoch(
            f"epoch {epoch} is older than the transaction's writer epoch {txn.epoch}"
        )


class _Work:
    """A transaction while a run of events changes it: its scalar fields in ``txn`` (whose
    ``branches`` are stale until :meth:`result`), its branches in a dict of their own,
    and the counts the rules ask for (every YES in; acks still awaited)."""

    __slots__ = ("branches", "txn", "unacked", "version", "yes", "yes_unacked")

    def __init__(self, txn: Transaction) -> None:
        self.txn = txn
        self.version = txn.version
        self.branches = dict(txn.branches)
        states = self.branches.values()
        self.yes = sum(1 for st in states if st.vote == Decision.COMMIT)
        self.unacked = sum(1 for st in states if st.ack is None)
        self.yes_unacked = sum(
            1 for st in states if st.vote == Decision.COMMIT and st.ack is None)

    def branch(self, bid: str) -> BranchState:
        try:
            return self.branches[bid]
        except KeyError:
            raise UnknownBranch(
                f"branch {bid!r} is not one of the {len(self.branches)} expected branches"
            ) from None

    def set_branch(self, bid: str, st: BranchState) -> None:
        old = self.branches[bid]
        if old.vote != Decision.COMMIT and st.vote == Decision.COMMIT:
            self.yes += 1
            self.yes_unacked += st.ack is None
        if old.ack is None and st.ack is not None:
            self.unacked -= 1
            self.yes_unacked -= st.vote == Decision.COMMIT
        self.branches[bid] = st

    def waiting(self) -> int:
        """How many acks the current decision still waits for (see pending_acks)."""
        if self.txn.state == State.COMMITTING:
            return self.unacked
        if self.txn.state == State.ABORTING:
            return self.yes_unacked
        return 0

    def result(self) -> Transaction:
        return replace(self.txn, branches=MappingProxyType(self.branches),
                       version=self.version)


def _decide(w: _Work, decision: Decision, now: float, reason: str | None) -> None:
    if decision == Decision.COMMIT:
        w.txn = replace(w.txn, state=State.COMMITTING, decided_at=now)
        return
    w.txn = replace(w.txn, state=State.ABORTING, decided_at=now, reason=reason)
    _maybe_finish(w, now)


def _maybe_finish(w: _Work, now: float) -> None:
    if w.txn.state in (State.COMMITTING, State.ABORTING) and not w.waiting():
        done = State.COMMITTED if w.txn.state == State.COMMITTING else State.ABORTED
        w.txn = replace(w.txn, state=done, finished_at=now)


class VoteOutcome(str, enum.Enum):
    """What one vote does to its branch (the right column of :data:`VOTE_CASES`)."""

    RECORD = "record"  # the branch's first vote: kept, and the decision taken when due
    UNCHANGED = "unchanged"  # answered with the record as it is; nothing is written
    CHANGED = "changed"  # refused: the same task attempt contradicts its own vote
    DEADLINE = "deadline"  # past the vote deadline: ABORT is decided instead


@dataclass(frozen=True)
class VoteCase:
    """One row of the vote table: when it applies to (transaction, branch, vote), and
    what the vote does."""

    name: str
    applies: Callable[[Transaction, BranchState, Vote], bool]
    outcome: VoteOutcome


def _other_attempt(current: BranchState, ev: Vote) -> bool:
    """The vote comes from another Spark task attempt than the one already recorded (a
    task retried after its executor died, or a speculative copy)."""
    return current.task is not None and ev.task is not None and current.task != ev.task


def _same_side(current: BranchState, ev: Vote) -> bool:
    return current.vote == (Decision.COMMIT if ev.yes else Decision.ABORT)


VOTE_CASES: Final[tuple[VoteCase, ...]] = (
    VoteCase(
        "another task attempt of a branch that has voted: the first vote wins, this one "
        "is not recorded (Spark's output commit coordinator authorises one attempt per "
        "partition the same way); what it prepared under the same name is the branch's, "
        "anything else it left is swept by recovery",
        lambda t, b, e: b.vote is not None and _other_attempt(b, e),
        VoteOutcome.UNCHANGED,
    ),
    VoteCase(
        "the same vote again (a retried call): harmless",
        lambda t, b, e: b.vote is not None and _same_side(b, e),
        VoteOutcome.UNCHANGED,
    ),
    VoteCase(
        "the same task attempt votes the other way: refused, a vote never changes",
        lambda t, b, e: b.vote is not None,
        VoteOutcome.CHANGED,
    ),
    VoteCase(
        "a late first vote (the deadline or another branch's NO decided ABORT): "
        "recorded nowhere; recovery aborts whatever it left prepared",
        lambda t, b, e: t.state.decided,
        VoteOutcome.UNCHANGED,
    ),
    VoteCase(
        "a first vote after the vote deadline: ABORT is decided",
        lambda t, b, e: e.now >= t.deadline,
        VoteOutcome.DEADLINE,
    ),
    VoteCase("the branch's first vote", lambda t, b, e: True, VoteOutcome.RECORD),
)
"""The vote table, first match wins; the last row always applies."""


def vote_case(txn: Transaction, ev: Vote) -> VoteCase:
    """The row of :data:`VOTE_CASES` a vote falls under (after the epoch checks)."""
    try:
        current = txn.branches[ev.branch]
    except KeyError:
        raise UnknownBranch(
            f"branch {ev.branch!r} is not one of the {len(txn.branches)} expected branches"
        ) from None
    return _vote_row(txn, current, ev)


def _vote_row(txn: Transaction, current: BranchState, ev: Vote) -> VoteCase:
    return next(c for c in VOTE_CASES if c.applies(txn, current, ev))


def _on_vote(w: _Work, ev: Event) -> bool:
    assert isinstance(ev, Vote)
    txn = w.txn
    if ev.epoch != txn.epoch:
        raise IllegalTransition(
            f"vote carries epoch {ev.epoch} but attempt {txn.attempt} belongs to epoch {txn.epoch}"
        )
    current = w.branch(ev.branch)
    case = _vote_row(txn, current, ev)
    if case.outcome == VoteOutcome.UNCHANGED:
        if txn.decision == Decision.COMMIT and current.vote is None:
            raise AssertionError("COMMIT decided without every vote")  # pragma: no cover
        return False
    if case.outcome == VoteOutcome.CHANGED:
        raise IllegalTransition(
            f"branch {ev.branch} already voted {current.vote.value}"  # type: ignore[union-attr]
            "; a vote never changes"
        )
    if case.outcome == VoteOutcome.DEADLINE:
        _decide(w, Decision.ABORT, ev.now, "vote deadline passed")
        return True
    vote = Decision.COMMIT if ev.yes else Decision.ABORT
    st = BranchState(
        vote=vote,
        handle=MappingProxyType(dict(ev.handle or {})) if ev.yes else None,
        reason=None if ev.yes else (ev.reason or "voted NO without a reason"),
        digest=ev.digest if ev.yes else None,
        task=ev.task,
    )
    w.set_branch(ev.branch, st)
    w.txn = replace(txn, state=State.PREPARING)
    if not ev.yes:
        _decide(w, Decision.ABORT, ev.now, f"{ev.branch} voted NO: {st.reason}")
    elif w.yes == len(w.branches):
        _decide(w, Decision.COMMIT, ev.now, None)
    return True


def _on_expire(w: _Work, ev: Event) -> bool:
    assert isinstance(ev, Expire)
    if w.txn.state.decided or ev.now < w.txn.deadline:
        return False
    missing = [b for b, s in w.branches.items() if s.vote is None]
    _decide(w, Decision.ABORT, ev.now,
            f"vote deadline passed; no vote from {', '.join(missing)}")
    return True


def _on_abandon(w: _Work, ev: Event) -> bool:
    assert isinstance(ev, Abandon)
    if w.txn.state.decided:
        return False  # the decision stands; the writer reads it from the answer
    _decide(w, Decision.ABORT, ev.now, ev.reason)
    return True


def _on_admin_abort(w: _Work, ev: Event) -> bool:
    assert isinstance(ev, AdminAbort)
    if w.txn.state.decided:
        return False
    _decide(w, Decision.ABORT, ev.now, f"admin: {ev.reason}")
    return True


def _apply_ack(w: _Work, bid: str, outcome: Decision, now: float) -> bool:
    current = w.branch(bid)
    decision = w.txn.decision
    assert decision is not None  # the table admits ACK only in decided states
    if outcome != decision:
        raise IllegalTransition(
            f"branch {bid} acknowledged {outcome.value} but the decision is {decision.value}"
        )
    if current.ack is not None:
        return False
    if decision == Decision.ABORT and current.vote != Decision.COMMIT:
        return False  # nothing was waited for: accepted, nothing to record
    w.set_branch(bid, replace(current, ack=outcome))
    _maybe_finish(w, now)
    return True


def _on_ack(w: _Work, ev: Event) -> bool:
    assert isinstance(ev, Ack)
    return _apply_ack(w, ev.branch, ev.outcome, ev.now)


def _on_force_ack(w: _Work, ev: Event) -> bool:
    assert isinstance(ev, ForceAck)
    return _apply_ack(w, ev.branch, ev.outcome, ev.now)


_HANDLERS: Final[Mapping[Kind, Callable[[_Work, Event], bool]]] = {
    Kind.VOTE: _on_vote,
    Kind.EXPIRE: _on_expire,
    Kind.ABANDON: _on_abandon,
    Kind.ADMIN_ABORT: _on_admin_abort,
    Kind.ACK: _on_ack,
    Kind.FORCE_ACK: _on_force_ack,
}
