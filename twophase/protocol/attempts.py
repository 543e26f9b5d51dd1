"""The sink-level steps: ``register`` a writer, ``begin`` a batch, note ``committed``.

:func:`begin` reads as a pipeline of small named steps: refuse a malformed request,
refuse a stale writer, refuse a lineage switch or a changed participant set that would
break a batch apart, advance the sink row, then pick one case from :data:`BEGIN_CASES`
(the first whose condition holds) and answer it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Final

from twophase.errors import ProtocolError, StaleEpoch
from twophase.protocol.machine import Abandon, handle
from twophase.protocol.records import (
    BranchState,
    SinkRecord,
    State,
    Transaction,
    branch_id,
    parse_branch_id,
)

__all__ = [
    "BEGIN_CASES",
    "Begin",
    "BeginCase",
    "BeginKind",
    "BeginResult",
    "begin",
    "committed",
    "register",
]


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
    _check_request(req)
    rec = sink or SinkRecord(name=req.sink)
    _check_writer(rec, req)
    new_lineage = rec.lineage is not None and rec.lineage != req.lineage
    if new_lineage:
        _check_lineage_switch(req, committing_elsewhere)
    _check_participants(attempts, req)
    ctx = _Context(req, _advance_sink(rec, req, new_lineage), attempts, new_lineage)
    for case in BEGIN_CASES:
        if case.applies(ctx):
            return case.answer(ctx)
    raise AssertionError("BEGIN_CASES ends with a case that always applies")  # pragma: no cover


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


# ---------------------------------------------------------------------------------------
# the guards, in the order begin applies them


def _check_request(req: Begin) -> None:
    """A request that can never be served."""
    if not req.participants:
        raise ProtocolError("a sink needs at least one participant")
    if len(set(req.participants)) != len(req.participants):
        raise ProtocolError(f"participant names must be unique, got {list(req.participants)}")
    if req.partitions < 1:
        raise ProtocolError(f"partitions must be >= 1, got {req.partitions}")
    if req.batch_id < 0:
        raise ProtocolError(f"batch id must be >= 0, got {req.batch_id}")


def _check_writer(rec: SinkRecord, req: Begin) -> None:
    """A zombie driver: a newer writer registered since."""
    if req.epoch < rec.epoch:
        raise StaleEpoch(f"epoch {req.epoch} is older than sink {req.sink!r}'s epoch {rec.epoch}")


def _check_lineage_switch(req: Begin, committing_elsewhere: tuple[Transaction, ...]) -> None:
    """A new lineage would orphan a COMMIT-decided, unfinished batch of the old one."""
    pending = [t for t in committing_elsewhere if t.lineage != req.lineage]
    if pending:
        names = ", ".join(f"{t.lineage}/{t.batch_id}/attempt-{t.attempt}" for t in pending)
        raise ProtocolError(
            f"sink {req.sink!r} starts lineage {req.lineage} (a new checkpoint location) "
            f"while committed batches of an earlier lineage are unfinished: {names}. "
            "Restart the query from its old checkpoint to finish them, or run "
            "`twophase resolve` for the sink, then start the new checkpoint."
        )


def _check_participants(attempts: tuple[Transaction, ...], req: Begin) -> None:
    """A batch must finish with the participants it began with."""
    if not attempts:
        return
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


def _advance_sink(rec: SinkRecord, req: Begin, new_lineage: bool) -> SinkRecord:
    """The sink row now names this writer and lineage; a new lineage starts uncommitted."""
    return replace(
        rec,
        epoch=req.epoch,
        lineage=req.lineage,
        last_committed=None if new_lineage else rec.last_committed,
    )


# ---------------------------------------------------------------------------------------
# the cases


@dataclass(frozen=True)
class _Context:
    req: Begin
    sink: SinkRecord  # already advanced
    attempts: tuple[Transaction, ...]
    new_lineage: bool

    @property
    def latest(self) -> Transaction:
        return self.attempts[-1]

    def aborting(self, among: tuple[Transaction, ...]) -> tuple[Transaction, ...]:
        """Attempts whose ABORT still waits for acks: their prepared branches to settle."""
        return tuple(a for a in among if a.state == State.ABORTING)


@dataclass(frozen=True)
class BeginCase:
    """One row of the begin table: when it applies, and what begin answers."""

    name: str
    applies: Callable[[_Context], bool]
    answer: Callable[[_Context], BeginResult]


def _forgotten_replay(c: _Context) -> BeginResult:
    return BeginResult(BeginKind.COMMITTED, c.sink, None)


def _first_attempt(c: _Context) -> BeginResult:
    txn = _new_txn(c.req, 1, c.req.partitions)
    return BeginResult(BeginKind.NEW, c.sink, txn, changed=(txn,), new_lineage=c.new_lineage)


def _replay(c: _Context) -> BeginResult:
    return BeginResult(BeginKind.COMMITTED, c.sink, c.latest, new_lineage=c.new_lineage)


def _in_doubt(c: _Context) -> BeginResult:
    recover = (*c.aborting(c.attempts[:-1]), c.latest)
    return BeginResult(
        BeginKind.IN_DOUBT, c.sink, c.latest, recover=recover, new_lineage=c.new_lineage
    )


def _same_writer_again(c: _Context) -> BeginResult:
    # A retried HTTP call of the same writer: the same answer (new_lineage stays False,
    # as it always has: the first answer already reported the switch).
    return BeginResult(BeginKind.NEW, c.sink, c.latest, recover=c.aborting(c.attempts[:-1]))


def _take_over(c: _Context) -> BeginResult:
    reason = f"abandoned by writer epoch {c.req.epoch}: a new driver took over"
    abandoned = handle(c.latest, Abandon(epoch=c.req.epoch, reason=reason, now=c.req.now))
    attempts = (*c.attempts[:-1], abandoned)
    return _next_attempt(replace(c, attempts=attempts), changed=(abandoned,))


def _retry(c: _Context) -> BeginResult:
    return _next_attempt(c, changed=())


def _next_attempt(c: _Context, changed: tuple[Transaction, ...]) -> BeginResult:
    # P is fixed at the first attempt so that a replayed batch splits the same way.
    txn = _new_txn(c.req, c.latest.attempt + 1, c.attempts[0].partitions)
    return BeginResult(
        BeginKind.NEW, c.sink, txn, recover=c.aborting(c.attempts),
        changed=(*changed, txn), new_lineage=c.new_lineage,
    )


def _below_last_committed(c: _Context) -> bool:
    last = c.sink.last_committed
    return not c.new_lineage and last is not None and c.req.batch_id <= last


BEGIN_CASES: Final[tuple[BeginCase, ...]] = (
    BeginCase(
        "replay of a batch whose record retention removed: return at once",
        lambda c: not c.attempts and _below_last_committed(c),
        _forgotten_replay,
    ),
    BeginCase("first attempt of the batch", lambda c: not c.attempts, _first_attempt),
    BeginCase(
        "replay of a committed batch: return at once",
        lambda c: c.latest.state == State.COMMITTED,
        _replay,
    ),
    BeginCase(
        "COMMIT decided, acks missing: finish it (and settle earlier aborting attempts)",
        lambda c: c.latest.state == State.COMMITTING,
        _in_doubt,
    ),
    BeginCase(
        "the same writer asks again about its undecided attempt: the same answer",
        lambda c: not c.latest.state.decided and c.latest.epoch == c.req.epoch,
        _same_writer_again,
    ),
    BeginCase(
        "a new writer takes over an undecided attempt: abandon it, start the next",
        lambda c: not c.latest.state.decided,
        _take_over,
    ),
    BeginCase("the latest attempt aborted: start the next", lambda c: True, _retry),
)
"""The begin table, first match wins; the last row always applies."""


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
