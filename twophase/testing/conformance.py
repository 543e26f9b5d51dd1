"""The participant conformance suite: one set of checks every participant must pass.

A participant module plugs in with a :class:`Harness`: a factory of fresh *targets* (a new
table, directory or topic per check) and flags saying what the system can promise. A
:class:`Target` hands out participant objects (a new object per call, as a new process
would build one) and reads the rows a plain reader of the system sees now::

    HARNESS = Harness(id="postgres", new_target=lambda: PgTarget(dsn))

    @pytest.mark.parametrize("check", applicable_checks(HARNESS), ids=lambda c: c.__name__)
    def test_conformance(check): check(HARNESS)

Checks are plain functions taking the harness; they raise ``AssertionError`` on a
violation, so any test runner can call them (pytest's parametrize in the examples). The
cross-process checks run :mod:`twophase.testing._prepare_and_die` in a child Python that
prepares a branch and SIGKILLs itself through the ``after_prepare`` failpoint; they apply
only to harnesses with ``durable=True``.

This is the installed kit every participant must pass, built in or not
(docs/writing-a-participant.md); keep these names stable.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from twophase.participant import BranchRef, BranchStatus, CommitScope, Handle, Participant

__all__ = [
    "ALL_CHECKS",
    "CROSS_PROCESS_CHECKS",
    "HOSTILE_CASES",
    "SCHEMA",
    "Harness",
    "Target",
    "applicable_checks",
    "batch_for",
    "commit_branch",
    "make_branch",
    "rows_for",
]

CHILD = "twophase.testing._prepare_and_die"
"""The module the crash checks run in a child interpreter (``python -m``)."""

SCHEMA = pa.schema([("id", pa.int64()), ("label", pa.string()), ("amount", pa.float64())])
"""The rows every check writes: ids unique per (checkpoint, partition), awkward labels."""

_AWKWARD = ['plain', 'quote " and , comma', "new\nline\ttab\\slash", None, "ünïcødé ✓", ""]


class Target(Protocol):
    """One fresh destination (table, directory, topic) for one check."""

    def participant(self) -> Participant:
        """A new participant object for this target (as another process would build it)."""
        ...

    def rows(self) -> list[dict[str, Any]]:
        """The rows a plain reader sees now (committed data only), any order."""
        ...

    def close(self) -> None:
        """Drop what the target created."""
        ...


@dataclass(frozen=True)
class Harness:
    """How to test one participant kind.

    ``durable``: a prepared branch survives the death of the preparing process and can be
    committed or aborted from another process (Postgres, files; not Kafka).
    ``status_sees_prepared``: ``status()`` can report PREPARED from the system itself.
    ``in_doubt_finds_prepared``: ``in_doubt(sink)`` lists prepared leftovers, so a
    recovery can commit a branch it found by name, without its vote's handle. False for a
    participant whose prepared branch holds nothing (Kafka's staged records): a COMMIT
    decision holds every branch's handle, so it is never committed without one.
    """

    id: str
    new_target: Callable[[], Target]
    durable: bool = True
    status_sees_prepared: bool = True
    in_doubt_finds_prepared: bool = True


def make_branch(
    p: Participant,
    *,
    sink: str = "conf",
    lineage: str | None = None,
    batch_id: int = 0,
    attempt: int = 0,
    partition: int = 0,
) -> BranchRef:
    return BranchRef(
        sink=sink,
        lineage=lineage or uuid.uuid4().hex[:16],
        batch_id=batch_id,
        attempt=attempt,
        participant=p.name,
        partition=partition,
    )


def rows_for(branch: BranchRef, n: int = 6) -> list[dict[str, Any]]:
    """Deterministic rows of a branch (a redo writes the very same rows)."""
    base = branch.batch_id * 1_000_000 + branch.partition * 10_000
    return [
        {
            "id": base + i,
            "label": _AWKWARD[i % len(_AWKWARD)],
            "amount": (i * 1.25) if i % 4 else None,
        }
        for i in range(n)
    ]


def batch_for(branch: BranchRef, n: int = 6) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(rows_for(branch, n), schema=SCHEMA)


def _sorted(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: r["id"])


def _prepare(p: Participant, branch: BranchRef, n: int = 6) -> dict[str, str]:
    return dict(p.prepare(branch, SCHEMA, [batch_for(branch, n)]))


def commit_branch(p: Participant, branch: BranchRef, handle: Handle | None) -> None:
    """Commit one branch the way the protocol would: by itself, or (a participant that
    commits per batch) as the only branch of its batch's commit. ``handle`` None is a
    recovery that found the branch by name and holds no vote: a batch participant then
    gets an empty handle and must find the branch's files by name."""
    if p.commit_scope == CommitScope.BATCH:
        p.commit_batch(branch.key, {branch.partition: dict(handle or {})})
    else:
        p.commit(branch, handle)


def _with_target(h: Harness, body: Callable[[Target, Participant], None]) -> None:
    target = h.new_target()
    try:
        p = target.participant()
        p.check(SCHEMA)
        try:
            body(target, p)
        finally:
            p.close()
    finally:
        target.close()


# -- checks ---------------------------------------------------------------------------------


def check_prepared_data_invisible_until_commit(h: Harness) -> None:
    def body(t: Target, p: Participant) -> None:
        b = make_branch(p)
        handle = _prepare(p, b)
        assert t.rows() == [], "prepared rows are visible before commit"
        commit_branch(p, b, handle)
        assert _sorted(t.rows()) == rows_for(b)

    _with_target(h, body)


def check_status_before_and_after_each_step(h: Harness) -> None:
    def body(t: Target, p: Participant) -> None:
        b = make_branch(p)
        assert p.status(b) is BranchStatus.ABSENT
        handle = _prepare(p, b)
        if h.status_sees_prepared:
            assert p.status(b) is BranchStatus.PREPARED
        commit_branch(p, b, handle)
        assert p.status(b) is BranchStatus.COMMITTED
        other = t.participant()  # a fresh object reads the system, not memory
        assert other.status(b) is BranchStatus.COMMITTED
        other.close()

        a = make_branch(p, lineage=b.lineage, batch_id=1)
        handle_a = _prepare(p, a)
        if h.status_sees_prepared:
            assert p.status(a) is BranchStatus.PREPARED
        p.abort(a, handle_a)
        assert p.status(a) is BranchStatus.ABSENT
        assert _sorted(t.rows()) == rows_for(b)

    _with_target(h, body)


def check_commit_is_idempotent(h: Harness) -> None:
    def body(t: Target, p: Participant) -> None:
        b = make_branch(p)
        handle = _prepare(p, b)
        commit_branch(p, b, handle)
        commit_branch(p, b, handle)
        commit_branch(p, b, None)
        again = t.participant()
        commit_branch(again, b, handle)
        again.close()
        assert _sorted(t.rows()) == rows_for(b)
        assert p.status(b) is BranchStatus.COMMITTED

    _with_target(h, body)


def check_abort_is_idempotent(h: Harness) -> None:
    def body(t: Target, p: Participant) -> None:
        b = make_branch(p)
        handle = _prepare(p, b)
        p.abort(b, handle)
        p.abort(b, handle)
        p.abort(b, None)
        never = make_branch(p, lineage=b.lineage, batch_id=7)
        p.abort(never, None)  # aborting a branch that was never prepared is success
        assert t.rows() == []
        assert p.status(b) is BranchStatus.ABSENT
        assert p.in_doubt(b.sink) == []

    _with_target(h, body)


def check_branches_are_independent(h: Harness) -> None:
    def body(t: Target, p: Participant) -> None:
        b0 = make_branch(p, partition=0)
        b1 = make_branch(p, lineage=b0.lineage, partition=1)
        h0, h1 = _prepare(p, b0), _prepare(p, b1)
        p.abort(b1, h1)
        commit_branch(p, b0, h0)
        assert _sorted(t.rows()) == rows_for(b0)
        assert p.status(b1) is BranchStatus.ABSENT

    _with_target(h, body)


def check_in_doubt_finds_leftovers(h: Harness) -> None:
    def body(t: Target, p: Participant) -> None:
        b0 = make_branch(p, sink="leftover", partition=0)
        b1 = make_branch(p, sink="leftover", lineage=b0.lineage, partition=1)
        other_sink = make_branch(p, sink="elsewhere", lineage=b0.lineage)
        handles = {b: _prepare(p, b) for b in (b0, b1, other_sink)}
        if h.in_doubt_finds_prepared:
            finder = t.participant()
            assert sorted(finder.in_doubt("leftover")) == sorted([b0, b1])
            finder.close()
        for b, hd in handles.items():
            p.abort(b, hd)
        assert p.in_doubt("leftover") == []
        assert p.in_doubt("elsewhere") == []
        assert t.rows() == []

    _with_target(h, body)


def check_redo_never_applies_twice(h: Harness) -> None:
    """A branch committed by attempt 0 and redone (same checkpoint, later attempt or the
    same attempt again; by ``prepare`` or by the recovery's ``redo`` with the voted
    handle) must not land twice: the marker says it is already applied."""

    def body(t: Target, p: Participant) -> None:
        b = make_branch(p, batch_id=3)
        voted = _prepare(p, b)
        commit_branch(p, b, voted)
        for attempt, how in ((0, "prepare"), (1, "redo"), (2, "prepare"), (0, "redo")):
            redo = make_branch(p, lineage=b.lineage, batch_id=3, attempt=attempt)
            fresh = t.participant()
            handle = (_prepare(fresh, redo) if how == "prepare"
                      else fresh.redo(redo, SCHEMA, [batch_for(redo)], voted))
            commit_branch(fresh, redo, handle)
            assert fresh.status(redo) is BranchStatus.COMMITTED
            fresh.close()
        assert _sorted(t.rows()) == rows_for(b)

    _with_target(h, body)


def check_new_lineage_is_not_skipped(h: Harness) -> None:
    """Checkpoint 0 of a new lineage is a new transaction, not 'already committed'."""

    def body(t: Target, p: Participant) -> None:
        old = make_branch(p, lineage="lineage-a")
        commit_branch(p, old, _prepare(p, old, n=2))
        new = make_branch(p, lineage="lineage-b")
        assert p.status(new) is BranchStatus.ABSENT
        commit_branch(p, new, _prepare(p, new, n=3))
        assert len(t.rows()) == 5

    _with_target(h, body)


def check_empty_branch_commits(h: Harness) -> None:
    def body(t: Target, p: Participant) -> None:
        b = make_branch(p)
        handle = dict(p.prepare(b, SCHEMA, []))
        commit_branch(p, b, handle)
        assert p.status(b) is BranchStatus.COMMITTED
        assert t.rows() == []

    _with_target(h, body)


def check_participant_pickles_before_and_after_use(h: Harness) -> None:
    def body(t: Target, p: Participant) -> None:
        b = make_branch(p)
        handle = _prepare(p, b)  # p now holds live connections / open files
        clone = pickle.loads(pickle.dumps(p))  # noqa: S301 - our own bytes
        assert clone.name == p.name
        commit_branch(clone, b, handle)
        clone.close()
        assert _sorted(t.rows()) == rows_for(b)

    _with_target(h, body)


def _prepare_in_child_and_kill(p: Participant, branch: BranchRef) -> dict[str, str]:
    """Prepare ``branch`` in a child Python that then dies by SIGKILL; return its handle."""
    with tempfile.TemporaryDirectory(prefix="twophase-conf-") as tmp:
        job = Path(tmp) / "job.pkl"
        out = Path(tmp) / "handle.json"
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, SCHEMA) as writer:
            writer.write_batch(batch_for(branch))
        job.write_bytes(pickle.dumps((p, branch, sink.getvalue().to_pybytes())))
        env = dict(os.environ)
        env["TWOPHASE_FAILPOINTS"] = f"after_prepare@{branch.participant}={'kill'}"
        # the child must unpickle the participant: it sees what this process imports from
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        proc = subprocess.run(
            [sys.executable, "-m", CHILD, str(job), str(out)],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )
        assert proc.returncode == -signal.SIGKILL, (
            f"child did not die by SIGKILL (rc={proc.returncode}): {proc.stderr[-2000:]}"
        )
        handle: dict[str, str] = json.loads(out.read_text())
        return handle


def check_commit_from_another_process_after_sigkill(h: Harness) -> None:
    def body(t: Target, p: Participant) -> None:
        b = make_branch(p)
        handle = _prepare_in_child_and_kill(p, b)
        here = t.participant()
        if h.status_sees_prepared:
            assert here.status(b) is BranchStatus.PREPARED
        if h.in_doubt_finds_prepared:
            assert here.in_doubt(b.sink) == [b]
        assert t.rows() == []
        commit_branch(here, b, handle)
        commit_branch(here, b, handle)
        assert here.status(b) is BranchStatus.COMMITTED
        assert here.in_doubt(b.sink) == []
        assert _sorted(t.rows()) == rows_for(b)
        here.close()

    _with_target(h, body)


def check_abort_from_another_process_after_sigkill(h: Harness) -> None:
    def body(t: Target, p: Participant) -> None:
        b = make_branch(p)
        _prepare_in_child_and_kill(p, b)
        here = t.participant()
        if h.status_sees_prepared:
            assert here.status(b) is BranchStatus.PREPARED
        # recovery may know only the branch (the vote was lost with the process)
        here.abort(b, None)
        here.abort(b, None)
        assert here.status(b) is BranchStatus.ABSENT
        assert here.in_doubt(b.sink) == []
        assert t.rows() == []
        here.close()

    _with_target(h, body)


def check_recovery_commit_without_handle(h: Harness) -> None:
    """Recovery from the coordinator's COMMIT may have to commit with only the branch."""

    def body(t: Target, p: Participant) -> None:
        b = make_branch(p)
        _prepare_in_child_and_kill(p, b)
        here = t.participant()
        for found in here.in_doubt(b.sink):
            commit_branch(here, found, None)
        assert here.status(b) is BranchStatus.COMMITTED
        assert _sorted(t.rows()) == rows_for(b)
        here.close()

    _with_target(h, body)


HOSTILE_CASES: tuple[tuple[str, list[dict[str, Any]]], ...] = (
    ("int64 extremes", [{"id": 2**63 - 1, "label": "max", "amount": 0.0},
                        {"id": -(2**63), "label": "min", "amount": -0.0}]),
    ("NUL in a string", [{"id": 1, "label": "a\x00b", "amount": 1.0}]),
    ("a 1 MiB string", [{"id": 2, "label": "x" * (1 << 20), "amount": 2.0}]),
    ("NaN and infinities", [{"id": 3, "label": "nan", "amount": float("nan")},
                            {"id": 4, "label": "inf", "amount": float("inf")},
                            {"id": 5, "label": "-inf", "amount": float("-inf")}]),
    ("huge and tiny floats", [{"id": 6, "label": "big", "amount": 1.7976931348623157e308},
                              {"id": 7, "label": "small", "amount": 5e-324}]),
)
"""Values that fit the checked schema but not every system: each is stored exactly or
refused cleanly (:func:`check_hostile_values_are_stored_exactly_or_refused_cleanly`)."""


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN == NaN here: stored exactly
    return bool(a == b) and type(a) is type(b)


def check_hostile_values_are_stored_exactly_or_refused_cleanly(h: Harness) -> None:
    """Each of :data:`HOSTILE_CASES` in a branch of its own: the participant either stores
    the rows exactly (read back equal, nothing clipped, rounded or replaced) or refuses at
    prepare with a :class:`~twophase.errors.ParticipantError` whose message names the
    participant; a refused branch leaves nothing visible, nothing prepared and nothing in
    doubt, and its abort succeeds. A raw library exception, a silent change of a value or
    a leftover is a failure: the sink could then write a value other than the user's, or
    leave a branch nobody settles."""
    from twophase.errors import ParticipantError

    def body(t: Target, p: Participant) -> None:
        lineage = uuid.uuid4().hex[:16]
        stored: dict[int, dict[str, Any]] = {}
        refused: list[str] = []
        for n, (case, rows) in enumerate(HOSTILE_CASES):  # a batch each (table kinds)
            b = make_branch(p, sink="hostile", lineage=lineage, batch_id=n)
            batch = pa.RecordBatch.from_pylist(rows, schema=SCHEMA)
            try:
                handle = dict(p.prepare(b, SCHEMA, [batch]))
            except ParticipantError as exc:
                assert p.name in str(exc) or p.describe() in str(exc), (
                    f"{case}: the refusal does not name the participant: {exc}")
                assert p.status(b) is BranchStatus.ABSENT, f"{case}: refused, yet {p.status(b)}"
                p.abort(b, None)
                if h.in_doubt_finds_prepared:
                    assert b not in p.in_doubt("hostile"), f"{case}: left in doubt"
                refused.append(case)
                continue
            except Exception as exc:
                raise AssertionError(
                    f"{case}: prepare raised {type(exc).__name__}, not a ParticipantError "
                    f"naming the participant and the fix: {exc}") from exc
            commit_branch(p, b, handle)
            stored.update({r["id"]: r for r in rows})
        seen = {r["id"]: r for r in t.rows()}
        assert sorted(seen) == sorted(stored), (
            f"visible ids {sorted(seen)} differ from the accepted cases' (refused: {refused})")
        for i, want in stored.items():
            got = seen[i]
            for col in ("label", "amount"):
                assert _same_value(got[col], want[col]), (
                    f"id {i}: {col} stored as {str(got[col])[:80]!r}, "
                    f"written {str(want[col])[:80]!r}")
        assert p.in_doubt("hostile") == []

    _with_target(h, body)


ALL_CHECKS: tuple[Callable[[Harness], None], ...] = (
    check_prepared_data_invisible_until_commit,
    check_status_before_and_after_each_step,
    check_commit_is_idempotent,
    check_abort_is_idempotent,
    check_branches_are_independent,
    check_in_doubt_finds_leftovers,
    check_redo_never_applies_twice,
    check_new_lineage_is_not_skipped,
    check_empty_branch_commits,
    check_participant_pickles_before_and_after_use,
    check_hostile_values_are_stored_exactly_or_refused_cleanly,
)

CROSS_PROCESS_CHECKS: tuple[Callable[[Harness], None], ...] = (
    check_commit_from_another_process_after_sigkill,
    check_abort_from_another_process_after_sigkill,
    check_recovery_commit_without_handle,
)


def applicable_checks(h: Harness) -> list[Callable[[Harness], None]]:
    """The checks that apply to ``h`` (the cross-process ones only to durable participants;
    the commit of a branch found by name only where ``in_doubt`` finds it)."""
    checks = list(ALL_CHECKS)
    if h.durable:
        checks += [c for c in CROSS_PROCESS_CHECKS
                   if h.in_doubt_finds_prepared or c is not check_recovery_commit_without_handle]
    return checks
