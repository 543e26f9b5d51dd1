"""Stateful property tests: random interleavings of every protocol message.

Hypothesis drives the pure machine (``twophase.protocol``) the way drivers, tasks, the
deadline timer, operators and crashed-and-restarted drivers would: begin, vote YES/NO,
deadline, abandon, admin abort, ack, force-ack, crash-and-replay (a new writer epoch),
stale-epoch and wrong-branch calls, and exact repeats of the previous message.

Every message is checked against :class:`Model`, an independent model of one attempt
written from the protocol's prose (DESIGN.md, "Protocol"), not from the transition
table: the model says *which* refusal the message gets in the current state (an error
class, or none), and what the attempt looks like afterwards. A refused message must raise
exactly that class and change nothing; an accepted one must not raise. After every step
the named invariants below must hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from twophase import protocol as p
from twophase.protocol import Decision, State

PARTICIPANTS = ("pg", "kafka")
PARTITIONS = 2
CHECKPOINTS = (0, 1, 2)
VOTE_TIMEOUT = 10.0
BRANCHES = tuple(f"{q}/{i}" for q in PARTICIPANTS for i in range(PARTITIONS))
UNKNOWN_BRANCH = "files/0"  # not a participant of the sink
EPOCHS = ("writer", "stale", "newer")  # relative to the attempt's writer epoch
TASKS = (None, "3/7", "3/9", "4/12")  # Spark task attempts (stage/task attempt id)
Refusal = type[p.ProtocolError] | None


@dataclass
class Model:
    """One attempt as the protocol's prose describes it (no code shared with the machine).

    A vote is recorded only while undecided and before the deadline; one NO, a deadline,
    an abandon or an admin abort decides ABORT; every YES decides COMMIT; a decision never
    changes; acks must name the decision, and the attempt is finished once every branch
    (COMMIT) or every YES voter (ABORT) acked. A vote names its Spark task attempt: the
    first vote of a branch wins, another attempt's vote is answered and never recorded,
    and only the same attempt (or one that names none) contradicting itself is refused.
    """

    epoch: int
    deadline: float
    votes: dict[str, Decision] = field(default_factory=dict)
    tasks: dict[str, str | None] = field(default_factory=dict)  # the winning task attempts
    decision: Decision | None = None
    acks: set[str] = field(default_factory=set)
    changes: int = 0  # accepted messages that changed the attempt

    @classmethod
    def of(cls, txn: p.Transaction) -> Model:
        assert txn.state == State.OPEN and txn.version == 0
        assert set(txn.branches) == set(BRANCHES)
        return cls(epoch=txn.epoch, deadline=txn.deadline)

    # -------------------------------------------------------------- which refusal
    def refusal(self, ev: p.Event) -> Refusal:
        """The error class the message must be refused with here, or None."""
        if isinstance(ev, p.Ack | p.ForceAck) and self.decision is None:
            return p.IllegalTransition  # nothing to acknowledge yet
        if isinstance(ev, p.Vote | p.Abandon | p.Ack) and ev.epoch < self.epoch:
            return p.StaleEpoch  # a zombie writer or task
        if isinstance(ev, p.Vote):
            if ev.epoch != self.epoch:
                return p.IllegalTransition  # a vote belongs to its attempt's writer
            if ev.branch not in BRANCHES:
                return p.UnknownBranch
            earlier = self.votes.get(ev.branch)
            winner = self.tasks.get(ev.branch)
            another = winner is not None and ev.task is not None and winner != ev.task
            if earlier is not None and earlier != _vote(ev) and not another:
                return p.IllegalTransition  # a vote never changes
        if isinstance(ev, p.Ack | p.ForceAck):
            if ev.branch not in BRANCHES:
                return p.UnknownBranch
            if ev.outcome != self.decision:
                return p.IllegalTransition  # an ack names the decision
        return None  # expire, admin abort and abandon (at any decision) are never refused

    # -------------------------------------------------------------- accepted messages
    def accept(self, ev: p.Event) -> bool:
        """Apply an accepted message; True if the attempt changed."""
        before = (dict(self.votes), self.decision, set(self.acks))
        if isinstance(ev, p.Vote):
            if ev.branch not in self.votes and self.decision is None:
                if ev.now >= self.deadline:
                    self.decision = Decision.ABORT
                else:
                    self.votes[ev.branch] = _vote(ev)
                    self.tasks[ev.branch] = ev.task
                    if not ev.yes:
                        self.decision = Decision.ABORT
                    elif len(self.votes) == len(BRANCHES):
                        self.decision = Decision.COMMIT
        elif isinstance(ev, p.Expire):
            if self.decision is None and ev.now >= self.deadline:
                self.decision = Decision.ABORT
        elif isinstance(ev, p.Abandon | p.AdminAbort):
            if self.decision is None:
                self.decision = Decision.ABORT
        else:  # Ack, ForceAck: only what the decision waits for is recorded
            waits = self.decision == Decision.COMMIT or self.votes.get(ev.branch) == Decision.COMMIT
            if waits:
                self.acks.add(ev.branch)
        changed = before != (self.votes, self.decision, self.acks)
        self.changes += changed
        return changed

    @property
    def state(self) -> State:
        if self.decision is None:
            return State.PREPARING if self.votes else State.OPEN
        if self.decision == Decision.COMMIT:
            return State.COMMITTED if self.acks == set(BRANCHES) else State.COMMITTING
        yes = {b for b, v in self.votes.items() if v == Decision.COMMIT}
        return State.ABORTED if yes <= self.acks else State.ABORTING

    def check(self, txn: p.Transaction) -> None:
        """The machine's attempt looks like the model's."""
        assert txn.state == self.state, (txn.state, self.state, self)
        assert txn.decision == self.decision
        assert {b: s.vote for b, s in txn.branches.items() if s.vote} == self.votes
        assert {b: s.task for b, s in txn.branches.items() if s.vote} == self.tasks
        assert {b for b, s in txn.branches.items() if s.ack} == self.acks
        assert txn.version == self.changes, "version increases by one per change"


def _vote(ev: p.Vote) -> Decision:
    return Decision.COMMIT if ev.yes else Decision.ABORT


@dataclass
class LastCall:
    batch_id: int
    attempt: int
    event: p.Event


class ProtocolMachine(RuleBasedStateMachine):
    """A model coordinator built only from the pure functions, checked against Model."""

    def __init__(self) -> None:
        super().__init__()
        self.sink: p.SinkRecord | None = None
        self.epoch = 0
        self.now = 0.0
        self.attempts: dict[int, list[p.Transaction]] = {}
        self.models: dict[tuple[int, int], Model] = {}
        self.decisions: dict[tuple[int, int], Decision] = {}
        self.last: LastCall | None = None

    # ------------------------------------------------------------------ helpers
    def _store(self, txn: p.Transaction) -> None:
        lst = self.attempts.setdefault(txn.batch_id, [])
        if txn.attempt <= len(lst):
            lst[txn.attempt - 1] = txn
        else:
            assert txn.attempt == len(lst) + 1, "attempts are numbered without gaps"
            lst.append(txn)
        event(f"reached {txn.state.value}")
        if txn.decision is not None:
            self.decisions.setdefault((txn.batch_id, txn.attempt), txn.decision)

    def _target(self, batch_id: int, back: int = 0) -> p.Transaction | None:
        """The latest attempt of the batch, or one ``back`` attempts earlier."""
        lst = self.attempts.get(batch_id)
        if not lst:
            return None
        return lst[max(0, len(lst) - 1 - back)]

    def _apply(self, txn: p.Transaction, ev: p.Event) -> None:
        """Send one message; the model says whether (and how) it must be refused."""
        model = self.models[(txn.batch_id, txn.attempt)]
        expected = model.refusal(ev)
        kind = p.kind_of(ev).value
        event(f"{kind} in {txn.state.value}: {expected.__name__ if expected else 'accepted'}")
        try:
            new = p.handle(txn, ev)
        except p.ProtocolError as exc:
            assert expected is not None, f"{ev} in {txn.state} was refused: {exc!r}"
            assert type(exc) is expected, f"{ev} in {txn.state}: {exc!r}, want {expected}"
            # a refused message changes nothing
            assert self.attempts[txn.batch_id][txn.attempt - 1] is txn
            model.check(txn)
            return
        assert expected is None, f"{ev} in {txn.state} was accepted, want {expected.__name__}"
        changed = model.accept(ev)
        assert (new is not txn) == changed, "the machine changes exactly when the model does"
        model.check(new)
        if changed:
            assert new.version == txn.version + 1
            self._store(new)
        self.last = LastCall(new.batch_id, new.attempt, ev)

    def _epoch(self, txn: p.Transaction, which: str) -> int:
        if which == "stale":
            return txn.epoch - 1
        if which == "newer":
            return max(self.epoch, txn.epoch + 1)
        return txn.epoch

    # ------------------------------------------------------------------ rules
    @rule()
    def start_writer(self) -> None:
        """A driver (re)starts: crash-and-replay begins with a new writer epoch."""
        self.sink = p.register(self.sink, "orders")
        self.epoch = self.sink.epoch

    @precondition(lambda self: self.epoch > 0)
    @rule(batch_id=st.sampled_from(CHECKPOINTS))
    def begin(self, batch_id: int) -> None:
        req = p.Begin(
            sink="orders", lineage="lin", batch_id=batch_id, epoch=self.epoch,
            participants=PARTICIPANTS, partitions=PARTITIONS, now=self.now,
            vote_timeout=VOTE_TIMEOUT,
        )
        earlier = tuple(self.attempts.get(batch_id, ()))
        res = p.begin(self.sink, earlier, req)
        self.sink = res.sink
        for t in res.changed:
            key = (t.batch_id, t.attempt)
            if key in self.models:  # a new writer abandoned the undecided attempt
                model = self.models[key]
                ev = p.Abandon(epoch=self.epoch, reason="taken over", now=self.now)
                assert model.refusal(ev) is None and model.accept(ev)
            else:
                self.models[key] = model = Model.of(t)
            model.check(t)
            self._store(t)
        event(f"begin -> {res.kind.value}")
        if res.kind == p.BeginKind.NEW:
            assert res.txn is not None and not res.txn.state.decided
            # a new attempt only ever follows attempts whose outcome is ABORT
            for t in self.attempts[batch_id][:-1]:
                assert t.decision == Decision.ABORT
        elif res.kind == p.BeginKind.COMMITTED:
            assert res.txn is not None and res.txn.state == State.COMMITTED
        else:
            assert res.txn is not None and res.txn.state == State.COMMITTING

    @precondition(lambda self: self.epoch > 0 and self.attempts)
    @rule(
        batch_id=st.sampled_from(CHECKPOINTS),
        back=st.sampled_from([0, 0, 0, 1]),
        branch=st.sampled_from((*BRANCHES, UNKNOWN_BRANCH)),
        yes=st.booleans(),
        epoch=st.sampled_from(EPOCHS),
        task=st.sampled_from(TASKS),
    )
    def vote(
        self, batch_id: int, back: int, branch: str, yes: bool, epoch: str, task: str | None
    ) -> None:
        """A task attempt votes: a retried or speculative copy of a task (another ``task``)
        may vote after the first attempt of its branch did, either way."""
        txn = self._target(batch_id, back)
        if txn is None:
            return
        self._apply(
            txn,
            p.Vote(branch=branch, epoch=self._epoch(txn, epoch), yes=yes, now=self.now,
                   handle={"gid": branch} if yes else None, reason=None if yes else "refused",
                   task=task),
        )

    @precondition(lambda self: self.epoch > 0 and self.attempts)
    @rule(batch_id=st.sampled_from(CHECKPOINTS), acks=st.booleans())
    def healthy_round(self, batch_id: int, acks: bool) -> None:
        """Every branch votes YES, then (or the driver dies first) every branch acks."""
        if self._target(batch_id) is None:
            return
        for bid in BRANCHES:
            txn = self._target(batch_id)
            assert txn is not None
            self._apply(txn, p.Vote(branch=bid, epoch=txn.epoch, yes=True, now=self.now))
        decided = self._target(batch_id)
        assert decided is not None
        if acks and decided.decision is not None:
            for bid in BRANCHES:
                txn = self._target(batch_id)
                assert txn is not None
                self._apply(
                    txn, p.Ack(branch=bid, epoch=self.epoch, outcome=decided.decision, now=self.now)
                )

    @precondition(lambda self: self.epoch > 0 and self.attempts)
    @rule(
        batch_id=st.sampled_from(CHECKPOINTS),
        back=st.sampled_from([0, 0, 0, 1]),
        branch=st.sampled_from((*BRANCHES, UNKNOWN_BRANCH)),
        outcome=st.sampled_from(["decision", "other"]),
        epoch=st.sampled_from(EPOCHS),
        force=st.booleans(),
    )
    def ack(
        self, batch_id: int, back: int, branch: str, outcome: str, epoch: str, force: bool
    ) -> None:
        """A task (or, forced, an operator) confirms an outcome, right or wrong, early or
        late, for a real or unknown branch."""
        txn = self._target(batch_id, back)
        if txn is None:
            return
        out = txn.effective_decision
        if outcome == "other":
            out = Decision.COMMIT if out == Decision.ABORT else Decision.ABORT
        ev: p.Event
        if force:
            ev = p.ForceAck(branch=branch, outcome=out, now=self.now)
        else:
            ev = p.Ack(branch=branch, epoch=self._epoch(txn, epoch), outcome=out, now=self.now)
        self._apply(txn, ev)

    @precondition(lambda self: self.epoch > 0 and self.attempts)
    @rule(batch_id=st.sampled_from(CHECKPOINTS), back=st.sampled_from([0, 0, 0, 1]),
          epoch=st.sampled_from(EPOCHS))
    def abandon(self, batch_id: int, back: int, epoch: str) -> None:
        """The writer gives up (its job failed), possibly after the last vote decided
        COMMIT: the answer is the decision, never a refusal (unless the writer is stale)."""
        txn = self._target(batch_id, back)
        if txn is not None:
            ev = p.Abandon(epoch=self._epoch(txn, epoch), reason="gave up", now=self.now)
            self._apply(txn, ev)

    @precondition(lambda self: self.attempts)
    @rule(batch_id=st.sampled_from(CHECKPOINTS), back=st.sampled_from([0, 1]))
    def admin_abort(self, batch_id: int, back: int) -> None:
        """An operator aborts (no epoch): only an undecided attempt changes."""
        txn = self._target(batch_id, back)
        if txn is not None:
            self._apply(txn, p.AdminAbort(reason="writer gone", now=self.now))

    @rule(dt=st.floats(0.0, VOTE_TIMEOUT * 1.5))
    def tick(self, dt: float) -> None:
        """Time passes; the background timer expires every undecided attempt due."""
        self.now += dt
        for cp in list(self.attempts):
            txn = self._target(cp)
            assert txn is not None
            self._apply(txn, p.Expire(now=self.now))

    @precondition(lambda self: self.epoch > 1 and self.attempts)
    @rule(
        batch_id=st.sampled_from(CHECKPOINTS),
        participant=st.sampled_from(PARTICIPANTS),
        partition=st.integers(0, PARTITIONS - 1),
        kind=st.sampled_from(["vote", "ack", "abandon"]),
    )
    def stale_epoch_call(
        self, batch_id: int, participant: str, partition: int, kind: str
    ) -> None:
        """A zombie from an older epoch: refused, and nothing changes."""
        txn = self._target(batch_id)
        if txn is None or txn.epoch <= 1:
            return
        stale = txn.epoch - 1
        bid = p.branch_id(participant, partition)
        ev: p.Event
        if kind == "vote":
            ev = p.Vote(branch=bid, epoch=stale, yes=True, now=self.now)
        elif kind == "ack":
            ev = p.Ack(branch=bid, epoch=stale, outcome=txn.effective_decision, now=self.now)
        else:
            ev = p.Abandon(epoch=stale, reason="zombie", now=self.now)
        expected = self.models[(batch_id, txn.attempt)].refusal(ev)
        # an ack of an undecided attempt is refused by the table before its epoch is read
        assert expected is (p.IllegalTransition if kind == "ack" and not txn.state.decided
                            else p.StaleEpoch)
        try:
            p.handle(txn, ev)
        except p.ProtocolError as exc:
            assert isinstance(exc, p.StaleEpoch | p.IllegalTransition)
            assert type(exc) is expected
        else:
            raise AssertionError("a stale-epoch message was accepted")
        assert self._target(batch_id) is txn

    @precondition(lambda self: self.last is not None)
    @rule()
    def repeat_last(self) -> None:
        """The network delivers the previous message again."""
        assert self.last is not None
        lst = self.attempts[self.last.batch_id]
        txn = lst[self.last.attempt - 1]
        again = p.handle(txn, self.last.event)
        assert again is txn, f"repeating {self.last.event} changed the transaction"

    # ------------------------------------------------------------------ invariants
    @invariant()
    def machine_matches_the_model(self) -> None:
        """Every stored attempt is what the independent model says (state, decision,
        votes, acks, and a version that counts the changes one by one)."""
        for lst in self.attempts.values():
            for t in lst:
                self.models[(t.batch_id, t.attempt)].check(t)

    @invariant()
    def no_mixed_outcomes(self) -> None:
        """No transaction ends with branches of different outcomes: every ack equals the
        decision, and no branch is acked before a decision exists."""
        for lst in self.attempts.values():
            for t in lst:
                acks = {s.ack for s in t.branches.values() if s.ack is not None}
                if t.decision is None:
                    assert not acks
                else:
                    assert acks <= {t.decision}

    @invariant()
    def every_record_is_coherent(self) -> None:
        """Every record the machine leaves passes ``Transaction.coherent`` (what the
        driver checks a merged bounded answer with)."""
        for lst in self.attempts.values():
            for t in lst:
                assert t.coherent(), t

    @invariant()
    def decision_never_changes(self) -> None:
        """Once a decision is recorded for an attempt it stays the same forever."""
        for (cp, attempt), d in self.decisions.items():
            assert self.attempts[cp][attempt - 1].decision == d

    @invariant()
    def presumed_abort_and_single_commit(self) -> None:
        """Without a decision record the outcome is abort; per checkpoint at most one
        attempt ever commits, and only the latest one can be undecided."""
        for lst in self.attempts.values():
            for t in lst:
                if t.decision is None:
                    assert t.effective_decision == Decision.ABORT
            assert sum(t.decision == Decision.COMMIT for t in lst) <= 1
            assert all(t.decision is not None for t in lst[:-1])

    @invariant()
    def commit_only_with_every_yes(self) -> None:
        """COMMIT is decided only when every expected branch voted YES."""
        for lst in self.attempts.values():
            for t in lst:
                if t.decision == Decision.COMMIT:
                    assert all(s.vote == Decision.COMMIT for s in t.branches.values())
                if t.state == State.COMMITTED:
                    assert all(s.ack == Decision.COMMIT for s in t.branches.values())


ProtocolMachine.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestProtocolMachine = ProtocolMachine.TestCase
