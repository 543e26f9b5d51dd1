"""A new attempt's prepare of one partition, inside its task (the protocol's "prepare"
step): the partition's rows fed to every participant's prepare at once, as Spark hands
them over (a short queue per participant, the vote's digest in a thread of its own,
nothing held whole), and the votes handed back with the job's result."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Final, Protocol

from twophase import failpoints
from twophase.client.wire import BranchMetrics, VoteIn, votes_body
from twophase.digest import RowsDigest
from twophase.errors import ParticipantError, TargetProblem
from twophase.participant import EMPTY_BRANCH, PrepareRefused
from twophase.protocol import branch_id

if TYPE_CHECKING:
    import pyarrow as pa

    from twophase.engine.plan import BatchPlan, BranchOutcome
    from twophase.participant import Handle, Participant

__all__ = ["DigestThread", "ReadFailed", "first_rows", "prepare_partition",
           "prepare_streaming"]


class _Counted(Protocol):
    rows: int


_QUEUE_DEPTH: Final = 2  # Arrow batches waiting per participant: bounds a task's memory
_END: Final = object()


class ReadFailed(ParticipantError):
    """Spark's rows stopped midway (the task is failing): every prepare undoes itself."""


def prepare_partition(
    plan: BatchPlan,
    partition: int,
    schema: pa.Schema,
    batches: Iterator[pa.RecordBatch],
    out: BranchOutcome,
    task: str | None,
) -> None:
    """Prepare this partition's branches of a new attempt and hand the votes over."""
    t0 = time.perf_counter()
    head, out.rows = first_rows(batches)
    prepares = [partial(_prepare_one, plan, part, partition, schema)
                for part in plan.participants]
    digest: str | None = None  # an empty branch is never redone: nothing to check
    if out.rows:
        results, digest = prepare_streaming(prepares, schema, head, batches, out)
    else:  # an empty partition writes nothing anywhere: its vote says so
        results = [prepare(None) for prepare in prepares]
    votes: list[VoteIn] = []
    unexpected: Exception | None = None
    for part, res in zip(plan.participants, results, strict=True):
        bid = branch_id(part.name, partition)
        if isinstance(res, PrepareRefused):
            votes.append(VoteIn(branch=bid, yes=False, reason=str(res), task=task))
        elif isinstance(res, Exception):
            # An unexpected failure while preparing: a NO vote with the cause (the task
            # fails unless the target refused for good: ``_hand_over_votes``)
            votes.append(VoteIn(branch=bid, yes=False, reason=f"{type(res).__name__}: {res}",
                                task=task))
            unexpected = unexpected or res
        else:
            # prepares run together: each branch's time is the partition's prepare time
            measured: BranchMetrics = {"prepare_s": time.perf_counter() - t0, "rows": out.rows}
            votes.append(VoteIn(branch=bid, yes=True, handle={**res, "split": plan.split},
                                metrics=measured, digest=digest, task=task))
    _hand_over_votes(plan, votes, unexpected, out, t0)


def _hand_over_votes(
    plan: BatchPlan, votes: list[VoteIn], unexpected: Exception | None, out: BranchOutcome,
    t0: float,
) -> None:
    """A new attempt's votes go back with the job's result, and the driver
    sends every task's at once (``twophase.engine.decide``): one result per partition is what
    Spark keeps of a task run twice (a retry, a speculative copy), so the votes the
    coordinator sees are one task attempt's per branch. YES votes first: a NO then decides
    ABORT with every prepared branch recorded, so the driver aborts them all. An
    unexpected error fails the task instead (Spark runs it again; a new attempt finds
    what this one prepared under the same names); a target's permanent refusal is said
    in full by its NO vote."""
    if unexpected is not None and not isinstance(unexpected, TargetProblem):
        raise unexpected
    ordered = sorted(votes, key=lambda v: not v.yes)
    out.votes = json.dumps(votes_body(plan.epoch, ordered)["votes"])
    out.prepare_s = time.perf_counter() - t0
    refused = [v for v in ordered if not v.yes]
    if refused:
        out.error = f"{refused[0].branch} voted NO: {refused[0].reason}"


def _prepare_one(plan: BatchPlan, part: Participant, partition: int, schema: pa.Schema,
                 source: Iterator[pa.RecordBatch] | None) -> Handle:
    """One participant's prepare of this partition, between its failpoints; without a
    ``source`` (the partition has no rows) nothing is prepared: the empty branch."""
    failpoints.hit("before_prepare", part.name, partition)
    handle = EMPTY_BRANCH if source is None else part.prepare(
        plan.ref(part, partition), schema, source)
    failpoints.hit("after_prepare", part.name, partition)
    return handle


def first_rows(batches: Iterator[pa.RecordBatch]) -> tuple[list[pa.RecordBatch], int]:
    """Read up to the first batch with rows (and their count), so an empty partition is
    known before any participant is called."""
    head: list[pa.RecordBatch] = []
    rows = 0
    for b in batches:
        head.append(b)
        rows += b.num_rows
        if b.num_rows:
            break
    return head, rows


def prepare_streaming(
    prepares: Sequence[Callable[[Iterator[pa.RecordBatch]], Handle]],
    schema: pa.Schema,
    head: list[pa.RecordBatch],
    rest: Iterator[pa.RecordBatch],
    out: _Counted,
) -> tuple[list[Handle | Exception], str]:
    """Run every participant's prepare (``prepares``, each reading the partition's rows)
    while Spark's rows arrive, the partition never held whole: one thread per participant
    reads a short queue that this thread fills from Spark's iterator (one participant: no
    thread, its prepare reads Spark directly). Rows read past ``head`` are counted in
    ``out.rows``. Returns each prepare's handle, or the exception it raised, and the
    rows' content digest (``schema``'s, stored with the vote: a redo must match it). A
    prepare that returns before reading everything (already committed) is fed no more."""
    parts = prepares

    # The vote's digest is computed beside the prepares, in its own thread (numpy lets
    # the GIL go): on the feeding thread it was the prepare's whole lead over a plain
    # writer at 100k-1M rows (0.2 us a row, issue 24).
    digest = RowsDigest(schema)
    hashing = DigestThread(digest)

    def counted() -> Iterator[pa.RecordBatch]:
        for b in head:
            hashing.feed(b)
            yield b
        for b in rest:
            out.rows += b.num_rows
            hashing.feed(b)
            yield b

    if len(parts) == 1:
        source = counted()
        try:
            result: Handle | Exception = parts[0](source)
        except Exception as exc:
            result = exc
        try:
            for _ in source:  # what a prepare did not read still counts in the report
                pass
        finally:
            hashing.finish()
        return [result], digest.value()

    queues = [queue.Queue[Any](maxsize=_QUEUE_DEPTH) for _ in parts]
    done = [threading.Event() for _ in parts]
    results: list[Handle | Exception] = [ReadFailed("prepare did not finish")] * len(parts)

    def read(q: queue.Queue[Any]) -> Iterator[pa.RecordBatch]:
        while (b := q.get()) is not _END:
            if isinstance(b, BaseException):
                raise ReadFailed(f"the partition's rows could not be read: {b}") from b
            yield b

    def work(i: int) -> None:
        try:
            results[i] = parts[i](read(queues[i]))
        except Exception as exc:
            results[i] = exc
        finally:
            done[i].set()

    def put(item: Any) -> None:
        for q, finished in zip(queues, done, strict=True):
            while not finished.is_set():
                try:
                    q.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue

    threads = [threading.Thread(target=work, args=(i,), daemon=True,
                                name=f"twophase-prepare-{i}") for i in range(len(parts))]
    for t in threads:
        t.start()
    try:
        for b in counted():
            put(b)
    except BaseException as exc:
        put(exc)  # every prepare raises and undoes its partial work
        for t in threads:
            t.join()
        raise
    finally:
        hashing.finish()
    put(_END)
    for t in threads:
        t.join()
    return results, digest.value()


class DigestThread:
    """Feeds a partition's batches to its ``RowsDigest`` in a thread of its own, through
    a short queue (the partition is never held whole); ``finish`` waits for the last."""

    def __init__(self, digest: RowsDigest) -> None:
        self._q = queue.Queue[Any](maxsize=_QUEUE_DEPTH)
        self._error: BaseException | None = None
        self._digest = digest
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="twophase-digest")
        self._thread.start()

    def _run(self) -> None:
        while (b := self._q.get()) is not _END:
            if self._error is None:
                try:
                    self._digest.update(b)
                except BaseException as exc:  # re-raised by finish, on the task's thread
                    self._error = exc

    def feed(self, batch: pa.RecordBatch) -> None:
        self._q.put(batch)

    def finish(self) -> None:
        self._q.put(_END)
        self._thread.join()
        if self._error is not None:
            raise self._error
