"""Kafka's in-task prepare (``prepare="in_task"``): the branch's transaction opened in
its Spark task and committed there (see ``docs/kafka.md``).

- ``transactional.id = twophase.<sink>.<participant>.<partition>``: stable per sink and
  partition across checkpoints, attempts and restarts, so the ``init_transactions`` of a
  new instance fences the zombie and aborts its open transaction.
- The idempotency marker is the committed offset ``checkpoint + 1`` of a per-branch marker
  group ``twophase.<sink>.<lineage>.<participant>.<partition>`` on ``(topic, 0)``, sent
  with ``send_offsets_to_transaction`` (:mod:`.marker`): it becomes visible exactly when
  the rows do.
- Prepare is **not durable**: librdkafka cannot resume another instance's transaction, so
  only the process that prepared can commit. Elsewhere the branch is *redone* (prepare
  again and commit at once under the existing COMMIT decision).
- A producer reused from an earlier batch (:mod:`.producers`) is not re-fenced; if another
  process initialised the id meanwhile, the cached one is fenced and its first broker
  call (the marker offset, sent before any row) fails: it is dropped and the prepare
  starts over once with a new, initialised producer, before a single row was produced. A
  redo never reuses: it must fence every older producer before it reads the log.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from twophase.errors import TwophaseError
from twophase.participant import BranchRef, BranchStatus, Handle, ParticipantError, PrepareRefused
from twophase.sinks.kafka.clients import PRODUCERS, abandon, healthy, parse_offsets
from twophase.sinks.kafka.errors import CommitNotDone, commit_retrying, describe_error, kafka_error
from twophase.sinks.kafka.log import read_branch
from twophase.sinks.kafka.marker import add_marker, committed_marker, marker_consumer, marker_done
from twophase.sinks.kafka.producers import cache_key, discard, new_producer, release
from twophase.sinks.kafka.records import Deliveries, Refusal, headers, produce_all

if TYPE_CHECKING:
    from twophase.sinks.kafka.participant import KafkaParticipant

__all__ = ["Prepared", "abort", "commit", "committed_in_log", "prepare"]


class Stale(TwophaseError):
    """Internal: a cached producer failed before any row was produced (fenced by another
    process's init of its transactional.id, or otherwise broken): start over with a new one."""


@dataclass
class Prepared:
    """A transaction this process opened and flushed, waiting for the decision."""

    branch: BranchRef
    producer: Any
    handle: dict[str, str]


def prepare(
    p: KafkaParticipant,
    branch: BranchRef,
    schema: pa.Schema,
    batches: Iterable[pa.RecordBatch],
    voted: Handle | None,
) -> Handle:
    """Write the rows and the marker in one open transaction, flushed, not committed;
    ``voted`` (a redo, ``{}`` when the vote had no handle): unless the branch turns out
    committed (marker or log), then nothing is written."""
    p._check_branch(branch)
    with p._lock:
        stale = p._prepared.pop(branch, None)
    if stale is not None and stale.producer is not None:
        # Prepared twice in one process: undo the first one before starting again.
        discard(p, stale.producer)
    # A new attempt begins on this process's idle producer of the id if there is one;
    # a redo always starts a new one: it fences every older producer of the branch
    # before the marker and the log are read.
    cached = PRODUCERS.take(cache_key(p, branch)) if p.reuse_clients else None
    if cached is not None and not healthy(cached):
        # It saw a broker error while idle (a broker restart): librdkafka's cached
        # coordinator can then block send_offsets_to_transaction past its timeout
        # (confluentinc/librdkafka#5456), so it is closed (no transaction is open)
        # and a new one is initialised.
        with contextlib.suppress(Exception):
            cached.close()
        cached = None
    if voted is not None:
        cached = None  # dropped: the init below fences it anyway
    producer = cached if cached is not None else new_producer(p, branch)
    group = p.marker_group(branch)
    consumer = marker_consumer(p, group)
    keep = idle = consumer_ok = False
    try:
        marker = committed_marker(p, consumer, branch)
        consumer_ok = True
        if marker >= branch.batch_id + 1 or (
            voted is not None and committed_in_log(p, branch, voted, wait=True)
        ):
            # Idempotent redo: this checkpoint's rows are already committed.
            idle = True  # no transaction was begun: the producer serves the next batch
            return p._handle(branch, 0, already=True)
        try:
            rows, offsets = write(p, producer, consumer, branch, schema, batches,
                                  reused=cached is not None)
        except Stale:
            # The cached producer was fenced (or broke) before any row was produced:
            # drop it (not closed, not aborted: both wait on a fenced producer; the new
            # producer's init aborts whatever it had begun) and start over once.
            producer = cached = None
            producer = new_producer(p, branch)
            rows, offsets = write(p, producer, consumer, branch, schema, batches)
        handle = p._handle(branch, rows, already=False, offsets=offsets)
        with p._lock:
            p._prepared[branch] = Prepared(branch, producer, handle)
        keep = True
        return handle
    finally:
        marker_done(p, group, consumer, consumer_ok)
        if producer is None:
            pass
        elif idle:
            release(p, branch, producer)
        elif not keep:
            discard(p, producer)


def committed_in_log(p: KafkaParticipant, branch: BranchRef, voted: Handle, *,
                     wait: bool) -> bool:
    """Whether the partition logs show this branch's records committed (by the
    voted transaction or an earlier redo), read after fencing.

    Why: the marker is a transactional offset commit, which Kafka applies with the
    transaction's COMMIT; tansu applies it only once every other transaction open
    on the same partitions has ended, so a committed branch can read as absent
    while a neighbour's transaction is open (the duplicate of docs/kafka.md). The
    log is the ground truth: a branch is committed when its records are. The read
    starts at the voted offsets (a redo writes after them) and at the log start of
    the partitions the vote did not write to. Records still open after the fence
    are an older producer's ``EndTxn`` in flight: with ``wait`` (a redo, after its
    fence) wait for its marker, then refuse rather than guess; without (a status
    read) they are not committed yet. With settings the log reader cannot use
    (SASL GSSAPI or OAUTHBEARER) the marker alone is trusted.
    """
    if not p.log_readable():
        return False
    start = parse_offsets(voted.get("offsets", ""))
    tag = dict(headers(branch))
    deadline = time.monotonic() + p.connect_timeout_s
    while True:
        try:
            seen = read_branch(p.config, p.topic, tag, start, timeout=p.connect_timeout_s)
        except ParticipantError as exc:
            raise ParticipantError(
                f"{p.describe()}: cannot read the log to check branch "
                f"{branch.branch_id} of batch {branch.batch_id} before redoing it: {exc}"
            ) from exc
        if seen.committed:
            return True
        if not seen.open or not wait:
            return False
        if time.monotonic() > deadline:
            raise ParticipantError(
                f"{p.describe()}: {seen.open} records of branch {branch.branch_id} "
                f"of batch {branch.batch_id} are still in an open transaction "
                f"{p.connect_timeout_s:g}s after their producer was fenced; not "
                "redoing it (it may yet commit): retry the batch"
            )
        time.sleep(0.2)


def write(
    p: KafkaParticipant,
    producer: Any,
    consumer: Any,
    branch: BranchRef,
    schema: pa.Schema,
    batches: Iterable[pa.RecordBatch],
    *,
    reused: bool = False,
) -> tuple[int, dict[int, int]]:
    """(rows, the first offset written in each Kafka partition). One transaction: the
    marker offset first (the transaction's first broker call, so a fenced cached
    producer fails before any row is read: raises :class:`Stale` when ``reused``), then
    the rows, then flush."""
    deliveries = Deliveries()

    step = "begin the transaction"
    rows = 0
    try:
        producer.begin_transaction()
        step = "send the marker offset"
        add_marker(p, producer, consumer, branch,
                   f"branch {branch.branch_id} of batch {branch.batch_id}")
    except Exception as exc:
        if getattr(producer, "stuck", False):  # the bound gave up on it (librdkafka#5456)
            abandon(producer)
            if not reused:  # (a reused one: the new producer of the retry fences it)
                raise PrepareRefused(f"{exc}; {_fence_stuck(p, branch)}") from exc
        if reused:  # no abort: a fenced producer's abort waits out connect_timeout_s
            raise Stale(f"cannot {step}: {describe_error(exc)}") from exc
        abort_own(p, producer)
        raise PrepareRefused(
            f"{p.describe()}: branch {branch.branch_id} of batch "
            f"{branch.batch_id} refused: cannot {step}: {describe_error(exc)}"
        ) from exc
    try:
        step = "produce"
        rows = produce_all(p, producer, schema, batches, deliveries, deliveries.errors,
                           headers(branch))
        step = "flush"
        left = producer.flush(p.connect_timeout_s)
        deliveries.check()
        if left:
            raise Refusal(f"{left} messages not delivered within {p.connect_timeout_s:g}s")
    except (Refusal, ValueError) as exc:
        abort_own(p, producer)
        raise PrepareRefused(
            f"{p.describe()}: branch {branch.branch_id} of batch "
            f"{branch.batch_id} refused: {exc}"
        ) from exc
    except Exception as exc:
        abort_own(p, producer)
        raise PrepareRefused(
            f"{p.describe()}: branch {branch.branch_id} of batch "
            f"{branch.batch_id} refused: cannot {step}: {describe_error(exc)}"
        ) from exc
    return rows, deliveries.first


def abort_own(p: KafkaParticipant, producer: Any) -> None:
    """Undo this process's open transaction; a fatal producer is simply dropped (the
    next init of the transactional.id, or the broker's timeout, aborts it)."""
    with contextlib.suppress(Exception):  # best effort: the refusal carries the cause
        producer.abort_transaction(p.connect_timeout_s)


def commit(p: KafkaParticipant, branch: BranchRef, handle: Handle | None) -> None:
    """``commit_transaction`` by the producer that prepared; ambiguous errors retried."""
    p._check_branch(branch)
    with p._lock:
        prepared = p._prepared.get(branch)
    if prepared is None or prepared.producer is None:
        if handle is not None and handle.get("already_committed") == "yes":
            return  # a redo found it committed: nothing was written
        if p.voted_status(branch, handle) is BranchStatus.COMMITTED:
            return
        raise ParticipantError(
            f"{p.describe()}: kafka branch {branch.branch_id} of batch "
            f"{branch.batch_id} cannot be committed from another process: it must be "
            "redone (prepare again and commit under the existing COMMIT decision)"
        )
    producer = prepared.producer
    try:
        commit_retrying(producer, p.connect_timeout_s, p.commit_retry_s)
    except CommitNotDone as exc:
        if exc.in_doubt:
            # Still in doubt: keep the producer so a later commit() resumes it.
            raise ParticipantError(
                f"{p.describe()}: commit of branch {branch.branch_id} batch "
                f"{branch.batch_id} still in doubt after {exc.attempts} attempts: "
                f"{exc.cause}; call commit again"
            ) from exc.__cause__
        with p._lock:
            p._prepared.pop(branch, None)
        raise ParticipantError(
            f"{p.describe()}: commit of branch {branch.branch_id} batch "
            f"{branch.batch_id} failed and was not aborted: {exc.cause}; "
            "the branch must be redone under the COMMIT decision"
        ) from exc.__cause__
    with p._lock:
        p._prepared.pop(branch, None)
    release(p, branch, producer)  # committed: healthy, serves the next batch


def abort(p: KafkaParticipant, branch: BranchRef, handle: Handle | None) -> None:
    """Abort in-process; otherwise fence the transactional.id (aborts a zombie's open
    transaction). Fencing aborts *any* open transaction of this (sink, participant,
    partition): call it only when no newer attempt is preparing that branch."""
    p._check_branch(branch)
    with p._lock:
        prepared = p._prepared.pop(branch, None)
    if prepared is not None and prepared.producer is not None:
        try:
            prepared.producer.abort_transaction(p.connect_timeout_s)
            release(p, branch, prepared.producer)  # aborted: serves the next batch
            return
        except Exception as exc:
            err = kafka_error(exc)
            if err is not None and err.fatal():
                # Fenced: a newer producer of this transactional.id already aborted our
                # transaction. Fencing again here would abort *its* open transaction.
                return
            else:
                raise ParticipantError(
                    f"{p.describe()}: abort of branch {branch.branch_id} failed: "
                    f"{describe_error(exc)}"
                ) from exc
    if handle is not None and handle.get("already_committed") == "yes":
        return
    fence(p, branch)


def fence(p: KafkaParticipant, branch: BranchRef) -> None:
    """Initialise a new producer of the branch's transactional.id: the broker aborts
    whatever an older one left open; the new one serves the next batch."""
    PRODUCERS.drop(cache_key(p, branch))  # about to be fenced by the init below
    try:
        producer = new_producer(p, branch)
    except PrepareRefused as exc:
        raise ParticipantError(str(exc)) from exc
    release(p, branch, producer)  # freshly initialised: serves the next batch


def _fence_stuck(p: KafkaParticipant, branch: BranchRef) -> str:
    """Fence the id of a producer left blocked with its transaction open (it holds the
    marker group's offsets, so every stable read of the marker would wait on it)."""
    try:
        fence(p, branch)
        return "its transactional.id is fenced (the open transaction aborted)"
    except ParticipantError as again:
        return f"its transactional.id is not fenced ({again}); the next prepare fences it"
