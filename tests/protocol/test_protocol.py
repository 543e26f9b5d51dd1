"""Unit tests of the pure protocol machine: one transition at a time, no I/O."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from twophase import protocol as p
from twophase.protocol import (
    Abandon,
    Ack,
    Begin,
    BeginKind,
    Decision,
    Expire,
    ForceAck,
    State,
    Vote,
)

PARTS = ("pg", "files")


def _begin(epoch: int = 1, batch_id: int = 0, partitions: int = 2, **kw: object) -> Begin:
    args: dict[str, object] = dict(
        sink="orders", lineage="lin-a", batch_id=batch_id, epoch=epoch,
        participants=PARTS, partitions=partitions, now=100.0, vote_timeout=30.0,
    )
    args.update(kw)
    return Begin(**args)  # type: ignore[arg-type]


def _new(**kw: object) -> p.Transaction:
    res = p.begin(None, (), _begin(**kw))
    assert res.kind == BeginKind.NEW and res.txn is not None
    return res.txn


def _vote_all(txn: p.Transaction, yes: bool = True, now: float = 101.0) -> p.Transaction:
    for b in txn.branches:
        txn = p.handle(txn, Vote(branch=b, epoch=txn.epoch, yes=yes, now=now, handle={"h": b}))
        if txn.state.decided:
            break
    return txn


def test_begin_creates_branches_for_every_participant_and_partition() -> None:
    txn = _new(partitions=3)
    assert sorted(txn.branches) == sorted(f"{q}/{i}" for q in PARTS for i in range(3))
    assert txn.state == State.OPEN and txn.attempt == 1 and txn.deadline == 130.0
    assert txn.decision is None and txn.effective_decision == Decision.ABORT


def test_all_yes_commits_and_acks_finish() -> None:
    txn = _vote_all(_new())
    assert txn.state == State.COMMITTING and txn.decision == Decision.COMMIT
    assert txn.branches["pg/0"].handle == {"h": "pg/0"}
    for i, b in enumerate(sorted(txn.branches)):
        txn = p.handle(txn, Ack(branch=b, epoch=1, outcome=Decision.COMMIT, now=102.0))
        expected = State.COMMITTED if i == len(txn.branches) - 1 else State.COMMITTING
        assert txn.state == expected
    assert txn.finished_at == 102.0


def test_one_no_aborts_with_reason_and_later_yes_changes_nothing() -> None:
    txn = _new()
    txn = p.handle(txn, Vote(branch="pg/0", epoch=1, yes=True, now=101.0))
    txn = p.handle(txn, Vote(branch="pg/1", epoch=1, yes=False, now=101.0, reason="pk clash"))
    assert txn.state == State.ABORTING
    assert txn.reason is not None and "pk clash" in txn.reason and "pg/1" in txn.reason
    late = p.handle(txn, Vote(branch="files/0", epoch=1, yes=True, now=101.5))
    assert late is txn
    # only the YES voter must confirm its abort
    assert txn.pending_acks() == ["pg/0"]
    done = p.handle(txn, Ack(branch="pg/0", epoch=1, outcome=Decision.ABORT, now=102.0))
    assert done.state == State.ABORTED


def test_all_no_goes_straight_to_aborted() -> None:
    txn = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=False, now=101.0, reason="x"))
    assert txn.state == State.ABORTED


def test_deadline_aborts_undecided_and_names_missing_votes() -> None:
    txn = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=True, now=101.0))
    assert p.handle(txn, Expire(now=129.9)) is txn
    expired = p.handle(txn, Expire(now=130.0))
    assert expired.state == State.ABORTING
    assert expired.reason is not None and "files/0" in expired.reason
    # a vote arriving after the deadline also aborts rather than counting
    late = p.handle(txn, Vote(branch="pg/1", epoch=1, yes=True, now=131.0))
    assert late.decision == Decision.ABORT


def test_deadline_never_touches_a_decision() -> None:
    txn = _vote_all(_new())
    assert p.handle(txn, Expire(now=10_000.0)) is txn


def test_stale_epoch_refused_everywhere() -> None:
    txn = _new(epoch=5)
    with pytest.raises(p.StaleEpoch):
        p.handle(txn, Vote(branch="pg/0", epoch=4, yes=True, now=101.0))
    with pytest.raises(p.StaleEpoch):
        p.handle(txn, Abandon(epoch=4, reason="zombie", now=101.0))
    committing = _vote_all(txn)
    with pytest.raises(p.StaleEpoch):
        p.handle(committing, Ack(branch="pg/0", epoch=4, outcome=Decision.COMMIT, now=102.0))
    with pytest.raises(p.StaleEpoch):
        p.begin(p.SinkRecord("orders", epoch=5), (), _begin(epoch=4))


def test_a_vote_never_changes_and_unknown_branch_is_refused() -> None:
    txn = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=True, now=101.0))
    with pytest.raises(p.IllegalTransition, match="already voted"):
        p.handle(txn, Vote(branch="pg/0", epoch=1, yes=False, now=101.0))
    with pytest.raises(p.UnknownBranch):
        p.handle(txn, Vote(branch="kafka/0", epoch=1, yes=True, now=101.0))


def test_vote_table_first_task_attempt_wins() -> None:
    """Each row of VOTE_CASES, with its exact outcome: a retried or speculative task
    attempt's vote is answered and never recorded, whichever way it votes; the same
    attempt contradicting itself is refused; a late first vote changes nothing."""
    first = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=True, now=101.0,
                                  handle={"gid": "a"}, task="3/7"))
    assert first.branches["pg/0"].task == "3/7"
    # another attempt's YES with another handle: the first YES and its handle stay
    dup = Vote(branch="pg/0", epoch=1, yes=True, now=101.0, handle={"gid": "b"}, task="3/9")
    assert p.vote_case(first, dup).outcome == p.VoteOutcome.UNCHANGED
    assert p.handle(first, dup) is first
    # another attempt's NO (a speculative copy that failed): the batch is not aborted
    no = Vote(branch="pg/0", epoch=1, yes=False, now=101.0, reason="lost race", task="4/12")
    assert p.handle(first, no) is first and first.decision is None
    # the same attempt changing its vote: refused
    with pytest.raises(p.IllegalTransition, match="a vote never changes"):
        p.handle(first, Vote(branch="pg/0", epoch=1, yes=False, now=101.0, task="3/7"))
    # after COMMIT, a stage re-run's vote cannot replace the voted handle
    committed = _vote_all(first)
    assert committed.decision == Decision.COMMIT
    rerun = Vote(branch="pg/0", epoch=1, yes=True, now=103.0, handle={"gid": "c"}, task="5/30")
    assert p.handle(committed, rerun) is committed
    assert dict(committed.branches["pg/0"].handle or {}) == {"gid": "a"}
    # a late first vote after an ABORT: nothing recorded
    aborted = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=False, now=101.0, task="3/7"))
    late = Vote(branch="pg/1", epoch=1, yes=True, now=101.0, task="3/8")
    assert p.vote_case(aborted, late).name.startswith("a late first vote")
    assert p.handle(aborted, late) is aborted
    # a first vote past the deadline decides ABORT
    past = Vote(branch="pg/0", epoch=1, yes=True, now=200.0, task="3/7")
    assert p.vote_case(_new(), past).outcome == p.VoteOutcome.DEADLINE
    assert p.handle(_new(), past).decision == Decision.ABORT


def test_ack_must_match_the_decision_and_is_illegal_before_it() -> None:
    txn = _new()
    with pytest.raises(p.IllegalTransition, match="not allowed in state OPEN"):
        p.handle(txn, Ack(branch="pg/0", epoch=1, outcome=Decision.COMMIT, now=101.0))
    committing = _vote_all(txn)
    with pytest.raises(p.IllegalTransition, match="decision is COMMIT"):
        p.handle(committing, Ack(branch="pg/0", epoch=1, outcome=Decision.ABORT, now=102.0))


def test_abandon_by_newer_epoch_then_force_ack() -> None:
    txn = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=True, now=101.0))
    gone = p.handle(txn, Abandon(epoch=2, reason="new driver", now=105.0))
    assert gone.state == State.ABORTING and gone.reason == "new driver"
    with pytest.raises(p.IllegalTransition):
        p.handle(gone, ForceAck(branch="pg/0", outcome=Decision.COMMIT, now=106.0))
    done = p.handle(gone, ForceAck(branch="pg/0", outcome=Decision.ABORT, now=106.0))
    assert done.state == State.ABORTED


def test_version_increases_only_on_change() -> None:
    txn = _new()
    v1 = p.handle(txn, Vote(branch="pg/0", epoch=1, yes=True, now=101.0))
    assert v1.version == txn.version + 1
    assert p.handle(v1, Vote(branch="pg/0", epoch=1, yes=True, now=101.0)) is v1


def test_every_table_entry_is_reachable_from_some_event_kind() -> None:
    kinds = {k for (_, k) in p.TRANSITIONS}
    assert kinds == set(p.Kind)
    for (state, kind), rule in p.TRANSITIONS.items():
        if isinstance(rule, p.Refuse):
            continue
        targets = rule.to
        assert targets, f"{state} has an empty target set"
        if state.decided:
            # a decision never changes: decided states only move within their outcome
            commit_side = {State.COMMITTING, State.COMMITTED}
            assert (state in commit_side) == bool(targets & commit_side)
            assert not (targets - {state, State.COMMITTED, State.ABORTED})
        # the writer epoch is checked exactly for the events that carry one
        assert rule.epoch == (kind in {p.Kind.VOTE, p.Kind.ABANDON, p.Kind.ACK}), (state, kind)


def test_the_table_has_exactly_one_entry_for_every_state_and_kind() -> None:
    """Complete: every (state, kind) pair is an Allow or an explicit Refuse, none missing."""
    pairs = [(state, kind) for state in State for kind in p.Kind]
    assert len(pairs) == 36
    assert set(p.TRANSITIONS) == set(pairs) and len(p.TRANSITIONS) == len(pairs)
    for pair in pairs:
        rule = p.TRANSITIONS[pair]
        assert isinstance(rule, p.Allow | p.Refuse), pair
        if isinstance(rule, p.Refuse):
            assert issubclass(rule.error, p.ProtocolError) and rule.why, pair
    refused = {pair for pair, rule in p.TRANSITIONS.items() if isinstance(rule, p.Refuse)}
    # only acknowledging an undecided attempt is refused whatever the message carries
    assert refused == {
        (s, k) for s in (State.OPEN, State.PREPARING) for k in (p.Kind.ACK, p.Kind.FORCE_ACK)
    }
    # abandon is answered in every state (the race with the last vote: issue "abandon")
    assert all(isinstance(p.TRANSITIONS[(s, p.Kind.ABANDON)], p.Allow) for s in State)


def test_a_refuse_entry_raises_its_error_and_changes_nothing() -> None:
    txn = _new()
    for ev in (Ack(branch="pg/0", epoch=1, outcome=Decision.ABORT, now=101.0),
               ForceAck(branch="pg/0", outcome=Decision.ABORT, now=101.0)):
        with pytest.raises(p.IllegalTransition, match="nothing is decided yet"):
            p.handle(txn, ev)
    assert txn == _new()


# --------------------------------------------------------------------------- abandon race


def test_abandon_after_commit_answers_the_decision_unchanged() -> None:
    """The job failed after the last vote: abandon learns the COMMIT instead of a 409."""
    committing = _vote_all(_new())
    assert committing.state == State.COMMITTING
    assert p.handle(committing, Abandon(epoch=1, reason="job failed", now=103.0)) is committing
    # a newer writer's abandon is answered the same way
    assert p.handle(committing, Abandon(epoch=2, reason="new driver", now=103.0)) is committing
    done = committing
    for b in committing.branches:
        done = p.handle(done, Ack(branch=b, epoch=1, outcome=Decision.COMMIT, now=104.0))
    assert done.state == State.COMMITTED
    assert p.handle(done, Abandon(epoch=1, reason="job failed", now=105.0)) is done


def test_abandon_after_commit_still_checks_the_epoch() -> None:
    committing = _vote_all(_new(epoch=5))
    with pytest.raises(p.StaleEpoch):
        p.handle(committing, Abandon(epoch=4, reason="zombie", now=103.0))
    done = committing
    for b in committing.branches:
        done = p.handle(done, Ack(branch=b, epoch=5, outcome=Decision.COMMIT, now=104.0))
    with pytest.raises(p.StaleEpoch):
        p.handle(done, Abandon(epoch=4, reason="zombie", now=105.0))


def test_admin_abort_decides_only_the_undecided_and_ignores_epochs() -> None:
    txn = p.handle(_new(epoch=3), p.AdminAbort(reason="writer gone", now=101.0))
    assert txn.state == State.ABORTED and txn.reason == "admin: writer gone"
    committing = _vote_all(_new(epoch=3))
    assert p.handle(committing, p.AdminAbort(reason="oops", now=102.0)) is committing


# --------------------------------------------------------------------------- recovery rule


@pytest.mark.parametrize(
    "decision, status, action",
    [
        (Decision.COMMIT, p.BranchStatus.COMMITTED, p.RecoveryAction.NOTHING),
        (Decision.COMMIT, p.BranchStatus.PREPARED, p.RecoveryAction.COMMIT),
        (Decision.COMMIT, p.BranchStatus.ABSENT, p.RecoveryAction.REDO),
        (Decision.ABORT, p.BranchStatus.PREPARED, p.RecoveryAction.ABORT),
        (Decision.ABORT, p.BranchStatus.ABSENT, p.RecoveryAction.NOTHING),
        (Decision.ABORT, p.BranchStatus.COMMITTED, p.RecoveryAction.NOTHING),
        (None, p.BranchStatus.PREPARED, p.RecoveryAction.ABORT),
        (None, p.BranchStatus.ABSENT, p.RecoveryAction.NOTHING),
        (None, p.BranchStatus.COMMITTED, p.RecoveryAction.NOTHING),
    ],
)
def test_recovery_rule(
    decision: Decision | None, status: p.BranchStatus, action: p.RecoveryAction
) -> None:
    assert p.recovery_action(decision, status) == action


@pytest.mark.parametrize(
    "decision, status, action",
    [
        (Decision.COMMIT, p.BranchStatus.COMMITTED, p.RecoveryAction.NOTHING),
        (Decision.COMMIT, p.BranchStatus.PREPARED, p.RecoveryAction.COMMIT_BATCH),
        (Decision.COMMIT, p.BranchStatus.ABSENT, p.RecoveryAction.REDO),
        (Decision.ABORT, p.BranchStatus.PREPARED, p.RecoveryAction.ABORT),
        (Decision.ABORT, p.BranchStatus.ABSENT, p.RecoveryAction.NOTHING),
        (Decision.ABORT, p.BranchStatus.COMMITTED, p.RecoveryAction.NOTHING),
        (None, p.BranchStatus.PREPARED, p.RecoveryAction.ABORT),
        (None, p.BranchStatus.ABSENT, p.RecoveryAction.NOTHING),
        (None, p.BranchStatus.COMMITTED, p.RecoveryAction.NOTHING),
    ],
)
def test_recovery_rule_for_a_participant_that_commits_per_batch(
    decision: Decision | None, status: p.BranchStatus, action: p.RecoveryAction
) -> None:
    """A table's branch is never committed alone: under COMMIT a prepared branch waits
    for the driver's one commit of the batch."""
    assert p.recovery_action(decision, status, p.CommitScope.BATCH) == action


@given(st.sampled_from([*Decision, None]), st.sampled_from(list(p.BranchStatus)))
def test_the_batch_rule_differs_from_the_branch_rule_only_in_commit(
    decision: Decision | None, status: p.BranchStatus
) -> None:
    """Both scopes agree on every case but COMMIT + PREPARED, where the branch rule
    commits the branch and the batch rule defers to the batch commit; in particular no
    batch-scope branch is ever committed by itself."""
    branch = p.recovery_action(decision, status, p.CommitScope.BRANCH)
    batch = p.recovery_action(decision, status, p.CommitScope.BATCH)
    assert batch != p.RecoveryAction.COMMIT
    if (decision, status) == (Decision.COMMIT, p.BranchStatus.PREPARED):
        assert (branch, batch) == (p.RecoveryAction.COMMIT, p.RecoveryAction.COMMIT_BATCH)
    else:
        assert branch == batch


def test_branch_status_has_one_home() -> None:
    from twophase.participant import BranchStatus

    assert BranchStatus is p.BranchStatus


# --------------------------------------------------------------------------- next step


def _step(final: p.Transaction, **kw: object) -> p.Step:
    args: dict[str, object] = dict(
        aborted=0, finishing=0, max_attempts=3, backoff=1.0, job_error="boom"
    )
    args.update(kw)
    return p.next_step(final, **args)  # type: ignore[arg-type]


def _acked(txn: p.Transaction) -> p.Transaction:
    for b in txn.branches:
        txn = p.handle(txn, Ack(branch=b, epoch=txn.epoch, outcome=Decision.COMMIT, now=102.0))
    return txn


def test_next_step_returns_once_committed() -> None:
    step = _step(_acked(_vote_all(_new())))
    assert step.kind == p.StepKind.RETURN and step.delay == 0 and not step.warning


def test_next_step_abandon_answered_commit_finishes_the_commit() -> None:
    """The race: the job failed, abandon's answer shows COMMIT -> FINISH, uncounted."""
    committing = _vote_all(_new())
    step = _step(committing, aborted=1, finishing=0, abandoned=True)
    assert step.kind == p.StepKind.FINISH and step.delay == 0
    assert (step.aborted, step.finishing) == (1, 0)
    # even if every ack arrived meanwhile: begin again, which answers COMMITTED (replay)
    assert _step(_acked(committing), abandoned=True).kind == p.StepKind.FINISH


def test_next_step_undecided_abandons_then_counts_the_abort() -> None:
    open_ = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=True, now=101.0))
    step = _step(open_, job_error="")
    assert step.kind == p.StepKind.ABANDON and step.reason == "Spark job failed: unknown"
    step = _step(open_)
    assert step.kind == p.StepKind.ABANDON and step.reason == "Spark job failed: boom"
    gone = p.handle(open_, Abandon(epoch=1, reason=step.reason, now=102.0))
    retry = _step(gone, abandoned=True)
    assert retry.kind == p.StepKind.RETRY and retry.aborted == 1 and retry.delay == 1.0
    assert retry.reason == "Spark job failed: boom"
    assert retry.warning == "sink orders batch 0 attempt 1 aborted: Spark job failed: boom"


def test_next_step_aborts_back_off_then_give_up() -> None:
    aborted = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=False, now=101.0, reason="x"))
    second = _step(aborted, aborted=1, backoff=2.0)
    assert second.kind == p.StepKind.RETRY and second.delay == 4.0 and second.aborted == 2
    assert _step(aborted, aborted=9, max_attempts=20, backoff=1.0).delay == 30.0
    last = _step(aborted, aborted=2)
    assert last.kind == p.StepKind.GIVE_UP and last.aborted == 3
    assert last.reason == (
        "sink 'orders' batch 0: aborted 3 time(s), last attempt 1: pg/0 voted NO: x"
    )
    assert last.warning  # the last abort is logged too


def test_next_step_finishing_a_commit_is_bounded() -> None:
    committing = _vote_all(_new())
    first = _step(committing, backoff=0.5)
    assert first.kind == p.StepKind.FINISH and first.finishing == 1 and first.delay == 0.5
    assert first.warning == "sink orders batch 0: finishing committed attempt 1: boom"
    assert first.aborted == 0
    out = _step(committing, finishing=3)
    assert out.kind == p.StepKind.GIVE_UP and out.finishing == 4
    assert out.reason.startswith(
        "sink 'orders' batch 0: COMMIT was decided for attempt 1 but branches "
    )
    assert out.reason.endswith("could not be committed after 4 tries: boom")


@pytest.mark.parametrize(
    "reason",
    [
        "pg/0 voted NO: ModuleNotFoundError: No module named 'pyarrow'",
        "Spark job failed: PythonException: ImportError: cannot import name 'x'",
        "pg/1 voted NO: InvalidRequest: column 'x' is not a valid name",
        "Spark job failed: [PYTHON_VERSION_MISMATCH] Python in worker has different version",
        "Spark job failed: java.io.IOException: Cannot run program \"/nope/python\"",
    ],
)
def test_next_step_gives_up_at_once_on_a_cause_a_retry_cannot_heal(reason: str) -> None:
    aborted = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=False, now=101.0,
                                    reason=reason))
    step = _step(aborted, max_attempts=5)
    assert step.kind == p.StepKind.GIVE_UP and step.aborted == 1 and step.delay == 0
    assert "not retried" in step.reason and reason in step.reason
    # the job's error alone (the abort reason says less) is enough too
    plain = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=False, now=101.0, reason="x"))
    assert _step(plain, job_error=reason).kind == p.StepKind.GIVE_UP


def test_next_step_retries_what_may_heal() -> None:
    for reason in ("could not serialize access", "connection refused", "timeout"):
        assert not p.permanent(reason)
        aborted = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=False, now=101.0,
                                        reason=reason))
        assert _step(aborted).kind == p.StepKind.RETRY


# --------------------------------------------------------------------------- begin


def test_begin_replay_of_committed_batch() -> None:
    txn = _vote_all(_new())
    for b in txn.branches:
        txn = p.handle(txn, Ack(branch=b, epoch=1, outcome=Decision.COMMIT, now=102.0))
    res = p.begin(p.SinkRecord("orders", epoch=1, lineage="lin-a"), (txn,), _begin(epoch=2))
    assert res.kind == BeginKind.COMMITTED and res.txn is txn and not res.changed


def test_begin_after_commit_decision_without_acks_is_in_doubt() -> None:
    txn = _vote_all(_new())
    res = p.begin(p.SinkRecord("orders", epoch=1, lineage="lin-a"), (txn,), _begin(epoch=2))
    assert res.kind == BeginKind.IN_DOUBT and res.txn is txn and res.recover == (txn,)


def test_begin_by_new_epoch_abandons_undecided_and_keeps_partitions() -> None:
    first = p.handle(_new(partitions=3), Vote(branch="pg/0", epoch=1, yes=True, now=101.0))
    rec = p.SinkRecord("orders", epoch=1, lineage="lin-a")
    res = p.begin(rec, (first,), _begin(epoch=2, partitions=7))
    assert res.kind == BeginKind.NEW
    assert res.txn is not None and res.txn.attempt == 2 and res.txn.partitions == 3
    old = res.changed[0]
    assert old.attempt == 1 and old.decision == Decision.ABORT
    assert res.recover == (old,)  # pg/0 may be prepared: settle it first


def test_begin_same_epoch_repeated_is_idempotent() -> None:
    txn = _new()
    rec = p.SinkRecord("orders", epoch=1, lineage="lin-a")
    res = p.begin(rec, (txn,), _begin(epoch=1))
    assert res.kind == BeginKind.NEW and res.txn is txn and not res.changed


def test_begin_after_abort_starts_next_attempt() -> None:
    txn = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=False, now=101.0, reason="bad"))
    rec = p.SinkRecord("orders", epoch=1, lineage="lin-a")
    res = p.begin(rec, (txn,), _begin(epoch=1))
    assert res.txn is not None and res.txn.attempt == 2 and res.recover == ()


def test_new_lineage_is_never_skipped_as_committed() -> None:
    rec = p.SinkRecord("orders", epoch=1, lineage="lin-a", last_committed=10)
    same = p.begin(rec, (), _begin(epoch=2, batch_id=3))
    assert same.kind == BeginKind.COMMITTED and same.txn is None
    reset = p.begin(rec, (), _begin(epoch=2, batch_id=3, lineage="lin-b"))
    assert reset.kind == BeginKind.NEW and reset.new_lineage
    assert reset.sink.lineage == "lin-b" and reset.sink.last_committed is None


def test_register_and_committed_advance_the_sink() -> None:
    rec = p.register(None, "orders")
    assert rec.epoch == 1 and p.register(rec, "orders").epoch == 2
    txn = _vote_all(_new())
    for b in txn.branches:
        txn = p.handle(txn, Ack(branch=b, epoch=1, outcome=Decision.COMMIT, now=102.0))
    rec = p.SinkRecord("orders", epoch=1, lineage="lin-a")
    assert p.committed(rec, txn).last_committed == 0


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"participants": ()}, "at least one participant"),
        ({"participants": ("a", "a")}, "unique"),
        ({"partitions": 0}, "partitions"),
        ({"batch_id": -1}, "batch id"),
    ],
)
def test_begin_rejects_bad_requests(kw: dict[str, object], msg: str) -> None:
    with pytest.raises(p.ProtocolError, match=msg):
        p.begin(None, (), _begin(**kw))


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 65, "semi;colon", "sp ace"])
def test_branch_id_validation(bad: str) -> None:
    with pytest.raises(ValueError):
        p.branch_id(bad, 0)
    assert p.parse_branch_id(p.branch_id("pg.orders-1", 12)) == ("pg.orders-1", 12)


def test_begin_refuses_a_changed_participant_set() -> None:
    txn = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=True, now=101.0))
    rec = p.SinkRecord("orders", epoch=1, lineage="lin-a")
    with pytest.raises(p.ProtocolError, match=r"added \['kafka'\], removed \['files'\]"):
        p.begin(rec, (txn,), _begin(epoch=2, participants=("pg", "kafka")))


def test_in_doubt_also_settles_earlier_aborting_attempts() -> None:
    first = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=True, now=101.0))
    rec = p.SinkRecord("orders", epoch=1, lineage="lin-a")
    res = p.begin(rec, (first,), _begin(epoch=2))
    aborting, second = res.changed
    assert aborting.state == State.ABORTING
    committing = _vote_all(second)
    again = p.begin(res.sink, (aborting, committing), _begin(epoch=3))
    assert again.kind == BeginKind.IN_DOUBT
    assert [t.attempt for t in again.recover] == [1, 2]


def test_begin_table_is_named_and_ends_with_a_catch_all() -> None:
    names = [c.name for c in p.BEGIN_CASES]
    assert len(set(names)) == len(names) == 7
    assert p.BEGIN_CASES[-1].name.startswith("the latest attempt aborted")


def test_begin_same_writer_after_an_abort_gets_the_same_new_attempt() -> None:
    first = p.handle(_new(), Vote(branch="pg/0", epoch=1, yes=False, now=101.0, reason="x"))
    rec = p.SinkRecord("orders", epoch=1, lineage="lin-a")
    res = p.begin(rec, (first,), _begin(epoch=1))
    again = p.begin(res.sink, (first, *res.changed), _begin(epoch=1))
    assert again.kind == BeginKind.NEW and again.txn == res.txn and not again.changed


def test_new_lineage_refused_while_an_old_lineage_batch_is_committing() -> None:
    committing = _vote_all(_new())
    rec = p.SinkRecord("orders", epoch=1, lineage="lin-a")
    with pytest.raises(p.ProtocolError, match="twophase resolve"):
        p.begin(rec, (), _begin(epoch=2, lineage="lin-b"), committing_elsewhere=(committing,))


_EVENTS = st.one_of(
    st.builds(lambda b, y, t, now: Vote(branch=b, epoch=1, yes=y, now=now,
                                        handle={"h": b} if y else None, task=t),
              st.sampled_from(["pg/0", "pg/1", "files/0", "files/1"]), st.booleans(),
              st.sampled_from([None, "1/1", "1/2"]), st.sampled_from([101.0, 200.0])),
    st.builds(lambda b, o: Ack(branch=b, epoch=1, outcome=o, now=102.0),
              st.sampled_from(["pg/0", "pg/1", "files/0", "files/1"]),
              st.sampled_from([Decision.COMMIT, Decision.ABORT])),
    st.builds(lambda now: Expire(now=now), st.sampled_from([101.0, 200.0])),
    st.just(Abandon(epoch=1, reason="gave up", now=103.0)),
)


@given(st.lists(_EVENTS, max_size=14))
def test_handle_all_is_handle_one_by_one(events: list[p.Event]) -> None:
    """The store applies a request's events with ``handle_all`` (the branches copied once,
    O(1) per vote or ack); it must answer exactly as ``handle`` event by event: the same
    record, the same version, the same states after each change, the same refusal."""
    txn = _new()
    want, states, refused = txn, [], None
    for ev in events:
        try:
            nxt = p.handle(want, ev)
        except p.ProtocolError as exc:
            refused = type(exc)
            break
        if nxt is not want:
            states.append((ev, nxt.state))
        want = nxt
    if refused is not None:
        with pytest.raises(refused):
            p.handle_all(txn, events)
        return
    got, changed = p.handle_all(txn, events)
    assert changed == states
    assert (got is txn) == (want is txn)
    assert dict(got.branches) == dict(want.branches)
    assert (got.state, got.version, got.reason, got.decided_at, got.finished_at) == (
        want.state, want.version, want.reason, want.decided_at, want.finished_at)
