"""The participant contract: five required hooks, optional ones with defaults, the
operator interfaces apart, and what the verifier relies on."""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
import pytest

from twophase.errors import InvalidRequest, ProtocolError
from twophase.participant import (
    BatchParticipant,
    BranchRef,
    BranchStatus,
    CommitScope,
    Handle,
    Participant,
    ReadBack,
    Verifiable,
    descriptor_of,
    known_kinds,
    rebuild,
)
from twophase.protocol import TxnKey
from twophase.sinks.kafka import KafkaParticipant
from twophase.testing.verify import verify


class _Bare(Participant):
    kind = "bare"

    def prepare(self, branch: BranchRef, schema: pa.Schema,
                batches: Iterable[pa.RecordBatch]) -> Handle:
        return {}

    def commit(self, branch: BranchRef, handle: Handle | None) -> None:
        pass

    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        pass

    def status(self, branch: BranchRef) -> BranchStatus:
        return BranchStatus.ABSENT

    def in_doubt(self, sink: str) -> list[BranchRef]:
        return []


class _Reads(_Bare, Verifiable):
    def __init__(self, name: str, back: ReadBack) -> None:
        super().__init__(name)
        self.back = back

    def read_back(self, column: str) -> ReadBack:
        return self.back


def test_defaults_no_vote_window_rule_and_no_reader() -> None:
    p = _Bare("bare")
    p.check_vote_window(10**9)  # no rule by default
    with pytest.raises(NotImplementedError, match="does not implement read_back"):
        verify([p], [1])


def test_open_transactions_and_reader_mismatch_fail_aborted_rows_do_not() -> None:
    """Aborted rows are reported (expected after a kill); an open transaction or a second
    reader disagreeing fails the verdict, like a duplicate."""
    assert verify([_Reads("a", ReadBack((1, 2), aborted=3))], [1, 2]).ok
    opened = verify([_Reads("o", ReadBack((1, 2), open=1))], [1, 2])
    assert not opened.ok and opened.systems[0].open_transactions == 1
    assert "open_transactions=1" in "\n".join(opened.lines())
    assert not verify([_Reads("m", ReadBack((1, 2), mismatch=1))], [1, 2]).ok
    assert not verify([_Reads("d", ReadBack((1, 1, 2)))], [1, 2]).ok


def test_a_second_commit_of_one_batch_fails_the_verdict() -> None:
    """A table committed twice for one batch fails even when every id is there once
    (e.g. the second snapshot added no rows): one commit per batch is the rule."""
    once = verify([_Reads("t", ReadBack((1, 2), commits=2))], [1, 2])
    assert once.ok and "table commits=2 extra_commits=0" in "\n".join(once.lines())
    twice = verify([_Reads("t", ReadBack((1, 2), commits=3, extra_commits=1))], [1, 2])
    assert not twice.ok and twice.systems[0].extra_commits == 1


def test_kafka_vote_window() -> None:
    kafka = KafkaParticipant("t", {"bootstrap.servers": "127.0.0.1:1"},
                             transaction_timeout_ms=400_000)
    kafka.check_vote_window(300)
    with pytest.raises(ValueError, match=r"transaction_timeout_ms=400000 must exceed the "
                       r"sink's vote window \(vote_timeout 340s \+ 60s\)"):
        kafka.check_vote_window(340)


def test_the_required_hooks_are_exactly_the_protocols_five() -> None:
    assert Participant.__abstractmethods__ == frozenset(
        {"prepare", "commit", "abort", "status", "in_doubt"})
    # a batch-committing participant swaps commit for commit_batch
    assert BatchParticipant.__abstractmethods__ == frozenset(
        {"prepare", "commit_batch", "abort", "status", "in_doubt"})


def test_a_bare_participant_is_not_rebuildable_and_commits_per_branch() -> None:
    p = _Bare("bare")
    assert descriptor_of(p) is None
    assert p.commit_scope == CommitScope.BRANCH
    with pytest.raises(ProtocolError, match="commits each branch itself"):
        p.commit_batch(TxnKey("s", "l", 0, 1), {})


class _Table(BatchParticipant):
    kind = "table"

    def prepare(self, branch: BranchRef, schema: pa.Schema,
                batches: Iterable[pa.RecordBatch]) -> Handle:
        return {}

    def commit_batch(self, key: TxnKey, handles: object) -> None:
        pass

    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        pass

    def status(self, branch: BranchRef) -> BranchStatus:
        return BranchStatus.ABSENT

    def in_doubt(self, sink: str) -> list[BranchRef]:
        return []


def test_a_batch_participant_never_commits_one_branch_alone() -> None:
    t = _Table("t")
    assert t.commit_scope == CommitScope.BATCH
    with pytest.raises(ProtocolError, match="commits once per batch"):
        t.commit(BranchRef("s", "l", 0, 1, "t", 0), {})


def test_built_in_kinds_come_from_the_entry_point_group() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name for ep in entry_points(group="twophase.participants")}
    assert {"postgres", "files", "kafka", "iceberg"} <= eps
    assert {"postgres", "files", "kafka", "iceberg"} <= set(known_kinds())


def test_rebuild_refuses_an_unknown_kind_naming_the_entry_point_group() -> None:
    with pytest.raises(InvalidRequest, match=r"twophase\.participants"):
        rebuild({"kind": "nosuchkind", "name": "x", "target": "", "options": {}})


class _TaskBound(_Bare):
    """A third-party participant of 0.3's kind: its prepared branch dies with its task."""

    kind = "taskbound"
    durable_prepare = False


def test_a_prepare_that_dies_with_its_task_is_refused_by_both_doors() -> None:
    """The barrier stage that kept such tasks alive until the decision was retired in
    0.4: both doors refuse the participant before anything starts, naming it and the fix;
    a durable participant beside it is not what is named."""
    from twophase import TransactionalSink
    from twophase.engine.door import DoorSpec

    parts = (_Bare("fine"), _TaskBound("bound"))
    want = (r"sink 'orders': taskbound participant 'bound' declares durable_prepare = "
            r"False .* no longer runs: since 0\.4 the tasks end before the decision .* "
            r"Make its prepare durable")
    with pytest.raises(InvalidRequest, match=want) as raised:
        TransactionalSink("orders", parts, "sqlite:///:memory:")
    assert "'fine'" not in str(raised.value)
    with pytest.raises(InvalidRequest, match=want):
        DoorSpec("orders", parts, "http://127.0.0.1:1", 1, 2)
    sink = TransactionalSink("orders", parts[:1], "sqlite:///:memory:")
    assert sink.participants == parts[:1]


def test_cluster_wait_is_accepted_with_a_warning_naming_its_retirement() -> None:
    from twophase import TransactionalSink

    with pytest.warns(DeprecationWarning, match=r"cluster_wait=\.\.\.\) has no effect since 0\.4"):
        TransactionalSink("orders", (_Bare("fine"),), "sqlite:///:memory:", cluster_wait=5)
