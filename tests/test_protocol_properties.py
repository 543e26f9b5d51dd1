"""Stateful property tests: random interleavings of every protocol message.

Hypothesis drives the pure machine (``twophase.protocol``) the way drivers, tasks, the
deadline timer and crashed-and-restarted drivers would: begin, vote YES/NO, deadline,
abandon, ack, crash-and-replay (a new writer epoch), stale-epoch calls, and exact repeats
of the previous message. After every step the invariants below must hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from twophase import protocol as p
from twophase.protocol import Decision, State

PARTICIPANTS = ("pg", "kafka")
PARTITIONS = 2
CHECKPOINTS = (0, 1, 2)
VOTE_TIMEOUT = 10.0


@dataclass
class LastCall:
    batch_id: int
    attempt: int
    event: p.Event


class ProtocolMachine(RuleBasedStateMachine):
    """A model coordinator built only from the pure functions."""

    def __init__(self) -> None:
        super().__init__()
        self.sink: p.SinkRecord | None = None
        self.epoch = 0
        self.now = 0.0
        self.attempts: dict[int, list[p.Transaction]] = {}
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

    def _latest(self, batch_id: int) -> p.Transaction | None:
        lst = self.attempts.get(batch_id)
        return lst[-1] if lst else None

    def _apply(self, batch_id: int, event: p.Event) -> None:
        txn = self._latest(batch_id)
        assert txn is not None
        try:
            new = p.handle(txn, event)
        except p.ProtocolError:
            assert self._latest(batch_id) is txn
            return
        self._store(new)
        self.last = LastCall(batch_id, new.attempt, event)

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
        participant=st.sampled_from(PARTICIPANTS),
        partition=st.integers(0, PARTITIONS - 1),
        yes=st.booleans(),
    )
    def vote(self, batch_id: int, participant: str, partition: int, yes: bool) -> None:
        txn = self._latest(batch_id)
        if txn is None:
            return
        bid = p.branch_id(participant, partition)
        self._apply(
            batch_id,
            p.Vote(branch=bid, epoch=txn.epoch, yes=yes, now=self.now,
                   handle={"gid": bid} if yes else None, reason=None if yes else "refused"),
        )

    @precondition(lambda self: self.epoch > 0 and self.attempts)
    @rule(batch_id=st.sampled_from(CHECKPOINTS), acks=st.booleans())
    def healthy_round(self, batch_id: int, acks: bool) -> None:
        """Every branch votes YES, then (or the driver dies first) every branch acks."""
        txn = self._latest(batch_id)
        if txn is None:
            return
        for bid in txn.branches:
            self._apply(batch_id, p.Vote(branch=bid, epoch=txn.epoch, yes=True, now=self.now))
        decided = self._latest(batch_id)
        assert decided is not None
        if acks and decided.decision is not None:
            for bid in decided.branches:
                self._apply(
                    batch_id,
                    p.Ack(branch=bid, epoch=self.epoch, outcome=decided.decision, now=self.now),
                )

    @precondition(lambda self: self.epoch > 0 and self.attempts)
    @rule(batch_id=st.sampled_from(CHECKPOINTS), participant=st.sampled_from(PARTICIPANTS),
          partition=st.integers(0, PARTITIONS - 1))
    def ack(self, batch_id: int, participant: str, partition: int) -> None:
        txn = self._latest(batch_id)
        if txn is None or txn.decision is None:
            return
        self._apply(
            batch_id,
            p.Ack(branch=p.branch_id(participant, partition), epoch=self.epoch,
                  outcome=txn.decision, now=self.now),
        )

    @precondition(lambda self: self.epoch > 0 and self.attempts)
    @rule(batch_id=st.sampled_from(CHECKPOINTS))
    def abandon(self, batch_id: int) -> None:
        if self._latest(batch_id) is not None:
            self._apply(batch_id, p.Abandon(epoch=self.epoch, reason="gave up", now=self.now))

    @rule(dt=st.floats(0.0, VOTE_TIMEOUT * 1.5))
    def tick(self, dt: float) -> None:
        """Time passes; the background timer expires every undecided attempt due."""
        self.now += dt
        for cp in list(self.attempts):
            self._apply(cp, p.Expire(now=self.now))

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
        txn = self._latest(batch_id)
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
        try:
            p.handle(txn, ev)
        except p.ProtocolError as exc:
            assert isinstance(exc, p.StaleEpoch | p.IllegalTransition)
        else:
            raise AssertionError("a stale-epoch message was accepted")
        assert self._latest(batch_id) is txn

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
