"""The data source door's rules (``twophase.protocol.door``): what a task does with its
begin's answer, and which attempt the driver's ``commit(messages, batchId)`` decides or
which refusal it gets. Property tests generate the tasks' answers; an independent model
(written from the module's prose) says which refusal applies, and each is asserted."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from twophase import protocol as p
from twophase.errors import IllegalTransition, InvalidRequest, ProtocolError
from twophase.protocol.door import (
    COMMIT_CASES,
    TASK_CASES,
    TaskAction,
    TaskAnswer,
    check_partition,
    commit_case,
    task_action,
)

KEYS = [p.TxnKey("orders", "q1", 3, 1), p.TxnKey("orders", "q1", 3, 2),
        p.TxnKey("orders", "q2", 3, 1), p.TxnKey("orders", "q1", 4, 1)]


def test_every_begin_kind_has_exactly_one_task_row() -> None:
    kinds = [c.kind for c in TASK_CASES]
    assert sorted(kinds) == sorted(p.BeginKind)
    assert task_action(p.BeginKind.NEW) == TaskAction.PREPARE
    assert task_action(p.BeginKind.COMMITTED) == TaskAction.SKIP
    assert task_action(p.BeginKind.IN_DOUBT) == TaskAction.FINISH


@given(partition=st.integers(0, 50), bound=st.integers(1, 50))
def test_a_partition_past_the_bound_is_refused_with_the_fix(partition: int, bound: int) -> None:
    if partition < bound:
        check_partition("orders", partition, bound)
        return
    with pytest.raises(InvalidRequest, match="option\\('partitions', N\\)"):
        check_partition("orders", partition, bound)


answers = st.one_of(
    st.none(),
    st.builds(TaskAnswer, key=st.sampled_from(KEYS), kind=st.sampled_from(list(p.BeginKind)),
              epoch=st.sampled_from([4, 5]), partition=st.integers(0, 7)),
)


def _expected(got: list[TaskAnswer | None], batch: int) -> type[ProtocolError] | None:
    """The model: the refusal the commit table must give, from its prose."""
    if not got:
        return ProtocolError
    if any(a is None for a in got):
        return IllegalTransition  # a failed task: Spark should have called abort
    real = [a for a in got if a is not None]
    if any(a.key.batch_id != batch for a in real):
        return ProtocolError
    if len({(a.key, a.kind, a.epoch) for a in real}) != 1:
        return IllegalTransition
    return None


@given(got=st.lists(answers, max_size=6), batch=st.sampled_from([3, 4]))
def test_commit_table_gives_the_modelled_refusal(got: list[TaskAnswer | None],
                                                  batch: int) -> None:
    want = _expected(got, batch)
    if want is None:
        door = commit_case(got, batch)
        first = got[0]
        assert first is not None
        assert (door.key, door.kind, door.epoch) == (first.key, first.kind, first.epoch)
        return
    with pytest.raises(want) as info:
        commit_case(got, batch)
    assert type(info.value) is want  # the row's own class, not a subclass or a parent
    assert "refused" in str(info.value)


def test_the_commit_table_ends_with_a_row_that_always_applies() -> None:
    assert COMMIT_CASES[-1].refusal is None
    assert all(c.refusal is not None for c in COMMIT_CASES[:-1])


def test_attempts_joined_by_tasks_of_two_writers_are_refused() -> None:
    a = TaskAnswer(KEYS[0], p.BeginKind.NEW, 4, 0)
    b = TaskAnswer(KEYS[0], p.BeginKind.NEW, 5, 1)
    with pytest.raises(IllegalTransition, match="different attempts"):
        commit_case([a, b], 3)


def test_tasks_of_one_writer_join_one_attempt_through_the_begin_table() -> None:
    """The door's begin-on-first-task is the begin table unchanged: the first task's
    begin creates the attempt, a sibling's (same writer epoch) gets the same one, and a
    restarted writer takes it over as the next attempt."""
    req = p.Begin("orders", "q1", 3, 4, ("pg", "files"), 8, now=0.0)
    first = p.begin(p.register(None, "orders"), (), req)
    assert first.kind == p.BeginKind.NEW and first.txn is not None
    sibling = p.begin(first.sink, (first.txn,), req)
    assert sibling.kind == p.BeginKind.NEW and sibling.txn == first.txn
    newer = p.begin(first.sink, (first.txn,), p.Begin("orders", "q1", 3, 5, ("pg", "files"),
                                                      8, now=1.0))
    assert newer.txn is not None and newer.txn.attempt == 2
    with pytest.raises(p.StaleEpoch):  # the old writer's late task is fenced
        p.begin(newer.sink, (*newer.changed,), req)
