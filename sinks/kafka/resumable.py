"""Kafka's resumable prepare (``prepare="resumable"``, the default): the branch's records
written once, in its task's own transaction, left open and committed by the driver.

- **prepare** (the task): a new transactional producer on an id of the bounded pool
  (:func:`pool_id`, :func:`choose_id`) runs ``init_transactions``, begins a transaction,
  produces the branch's records to the target topic, flushes and checks every delivery
  report; then the id's coordinator is asked (``DescribeTransactions``) for the
  transaction's producer id and epoch (librdkafka does not expose them), and only then
  the marker offset is added (``send_offsets_to_transaction``): a producer fenced before
  it fails there, so the vote never carries another producer's epoch. The task returns
  **without committing or aborting**; its producer is parked in this process
  (:data:`PARKED`) and never closed (``close()`` aborts an open transaction since
  confluent-kafka 2.x; dropping it or the process dying does not: docs/kafka.md).
  A prepare that finds, once written, its branch committed by another attempt (a late
  speculative copy) aborts its own transaction and votes "already committed".
- **commit / abort** (the driver, a restarted driver, ``twophase resolve``): ``EndTxn``
  for (id, producer id, epoch) on Kafka's wire (:mod:`.txnwire`), from the handle alone.
- **status**: COMMITTED by the marker; PREPARED while the coordinator shows the id
  ``Ongoing`` (or completing a commit) with the handle's producer id and epoch; else
  ABSENT (the broker's transaction timeout, or the id initialised again): the branch is
  redone from Spark's replay.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

from twophase.client.wire import MAX_TEXT
from twophase.participant import BranchRef, BranchStatus, Handle, ParticipantError, PrepareRefused
from twophase.sinks.kafka.config import common_config
from twophase.sinks.kafka.errors import describe_error
from twophase.sinks.kafka.lingering import admin_client, list_open_transactions
from twophase.sinks.kafka.marker import add_marker, held_consumer, read_marker_now
from twophase.sinks.kafka.records import Deliveries, Refusal, headers, produce_all
from twophase.sinks.kafka.txnwire import (
    RETRIABLE,
    TxnState,
    TxnWireError,
    describe_transaction,
    end_transaction,
)

if TYPE_CHECKING:
    import pyarrow as pa

    from twophase.sinks.kafka.participant import KafkaParticipant

__all__ = ["CLOCK_MARGIN_S", "PARKED", "SLOTS", "abort", "abort_other_attempts",
           "abort_unvoted", "check_broker", "choose_id",
           "commit", "is_resumable", "pool_id", "prepare", "voted_status"]

MODE: Final = "resumable"
SLOTS: Final = 4
"""Transactional ids per (sink, participant, partition). A batch's attempts of one
partition (Spark's retry, a speculative copy, a stage retry) each need an id no other
attempt holds open, or its ``init_transactions`` would abort that attempt's transaction
(possibly the winner's); every earlier batch's transactions are ended before a batch
begins (the coordinator's recovery commits or aborts them first), so the ids serve every
batch again: ``partitions x SLOTS`` ids in all, whatever the number of batches."""
CLOCK_MARGIN_S: Final = 30.0
"""How much older than a sweep's start (by the broker's clock) a transaction must be for
the sweep to take it for a leftover, not a transaction of the batch after."""
_OPEN: Final = frozenset({"Ongoing", "PrepareCommit", "PrepareAbort"})

PARKED: dict[str, Any] = {}
"""This process's latest producers whose transaction it left open, by transactional id:
kept referenced, never closed (``close()`` aborts the transaction), the oldest dropped
past :data:`PARKED_MAX` (a Python worker serves many partitions; each producer holds
librdkafka threads). Dropping one does not end its transaction (librdkafka's destroy
sends no ``EndTxn``: measured on confluent-kafka 2.16.1, and pinned by
``test_another_process_commits_from_the_handle[drop]``)."""
PARKED_MAX: Final = 16
_PARKED_LOCK = threading.Lock()


def is_resumable(handle: Handle | None) -> bool:
    return handle is not None and handle.get("prepare") == MODE


def pool_id(p: KafkaParticipant, branch: BranchRef, slot: int) -> str:
    """``twophase.<sink>.<participant>.w<partition>.<slot>``."""
    return f"twophase.{branch.sink}.{p.name}.w{branch.partition}.{slot}"


def check_broker(p: KafkaParticipant) -> None:
    """The broker answers ``DescribeTransactions`` (Kafka 3.0+), without which no
    process can learn a task's producer id and epoch, so none can end its transaction.
    Asked once at the sink's first batch, on an id no batch uses, before anything is
    written. A broker that closes the connection on it (tansu 0.6 does: docs/kafka.md)
    gets an error naming the staged prepare; other answers surface where they occur."""
    tid = f"twophase.probe.{p.name}"
    try:
        describe_transaction(p.config, tid, p.connect_timeout_s)
    except TxnWireError as exc:
        if exc.name != "NETWORK":
            return
        raise ParticipantError(
            f"{p.describe()}: Kafka at {p.bootstrap} answered the topic check but not "
            f"DescribeTransactions ({exc}); the resumable prepare (the default) needs it "
            "(Apache Kafka 3.0 or later) to commit a task's transaction from the driver. "
            'Use KafkaParticipant(..., prepare="staged") with this broker') from exc


def _spark_attempt() -> int:
    """This Spark task's attempt number (0 outside Spark)."""
    try:
        from pyspark import TaskContext
    except ImportError:
        return 0
    ctx = TaskContext.get()
    if ctx is None:
        return 0
    # PySpark's TaskContext has no stage attempt number: a stage retry's first attempt
    # starts at slot 0 again and skips an earlier stage attempt's open one (choose_id)
    return int(ctx.attemptNumber())


def choose_id(p: KafkaParticipant, branch: BranchRef) -> str:
    """The pool id this prepare takes: from the slot its attempt numbers point at, the
    first whose transaction is not open. An open one is another attempt of this batch
    (maybe the one whose vote wins) or a loser's leftover: skipping it never aborts it.
    When every slot is open the first is taken (its ``init_transactions`` aborts it)."""
    start = (_spark_attempt() + branch.attempt) % SLOTS
    for k in range(SLOTS):
        tid = pool_id(p, branch, (start + k) % SLOTS)
        found = describe_transaction(p.config, tid, p.connect_timeout_s)
        if found is None or found.state not in _OPEN:
            return tid
    return pool_id(p, branch, start)


def _park(tid: str, producer: Any) -> None:
    with _PARKED_LOCK:
        PARKED[tid] = producer  # the one it replaces ended its transaction long ago
        while len(PARKED) > PARKED_MAX:
            del PARKED[next(iter(PARKED))]


def prepare(p: KafkaParticipant, branch: BranchRef, schema: pa.Schema,
            batches: Iterable[pa.RecordBatch]) -> Handle:
    """Write the branch in an open transaction (see the module docstring); a branch
    whose marker is committed writes nothing."""
    from confluent_kafka import Producer

    p._check_branch(branch)
    # the marker read without waiting: another attempt's open transaction may hold the
    # group's offsets (a stable read would wait for it); only committed offsets count
    if read_marker_now(p, branch) >= branch.batch_id + 1:
        return {**p._handle(branch, 0, already=True), "prepare": MODE}
    with held_consumer(p, branch) as consumer:
        try:
            tid = choose_id(p, branch)
        except TxnWireError as exc:
            raise PrepareRefused(f"{p.describe()}: branch {branch.branch_id} of batch "
                                 f"{branch.batch_id} refused: {exc}") from exc
        with _PARKED_LOCK:
            PARKED.pop(tid, None)
        producer = Producer(p.producer_config(tid))
        try:
            # the broker's connection up first: librdkafka asks for the transaction
            # coordinator at once and, finding no broker up yet, only again after a
            # fixed 500 ms. The first answer may come from the bootstrap connection,
            # which librdkafka then replaces by one to the broker's node id; the second
            # request waits for that one (measured, bench/kafka_prepare_phases.py: one
            # request left 13 of 120 init_transactions at 505 ms, two none, +0.5 ms)
            for _ in range(2):
                producer.list_topics(p.topic, timeout=p.connect_timeout_s)
            producer.init_transactions(p.connect_timeout_s)
        except Exception as exc:
            raise PrepareRefused(
                f"{p.describe()}: cannot initialise transactional.id {tid!r} at "
                f"{p.bootstrap} within {p.connect_timeout_s:g}s: {describe_error(exc)}"
            ) from exc
        rows, state, first = _write(p, producer, consumer, branch, tid, schema, batches)
        if read_marker_now(p, branch) >= branch.batch_id + 1:
            # another attempt of this branch (the one whose vote won) was committed
            # while this one wrote: this vote cannot count, and the driver's sweep of
            # the losing attempts may have run before this transaction began, so it
            # ends its own transaction rather than hold read_committed readers
            _end_own(p, producer, branch, tid)
            return {**p._handle(branch, 0, already=True), "prepare": MODE}
    _park(tid, producer)
    handle = p._handle(branch, rows, already=False, offsets=first)
    handle.update({"prepare": MODE, "transactional_id": tid,
                   "producer_id": str(state.producer_id),
                   "producer_epoch": str(state.producer_epoch)})
    written = _written(p, state)
    if written:
        handle["partitions"] = written
    return handle


def _written(p: KafkaParticipant, state: TxnState) -> str:
    """The target topic's partition numbers the transaction wrote (``"0,3,7"``), for the
    operator; "" past :data:`~twophase.client.wire.MAX_TEXT` characters, which a vote's handle
    values must fit (a task writing a topic of a thousand partitions or more)."""
    prefix = f"{p.topic}-"
    numbers = sorted(int(t[len(prefix):]) for t in state.partitions
                     if t.startswith(prefix) and t[len(prefix):].isdigit())
    text = ",".join(map(str, numbers))
    return text if len(text) <= MAX_TEXT else ""


def _end_own(p: KafkaParticipant, producer: Any, branch: BranchRef, tid: str) -> None:
    """Abort this producer's own transaction (a late copy of a committed branch); when
    the broker cannot be told, the transaction is left to the next sweep or its timeout,
    which the error says."""
    try:
        producer.abort_transaction(p.connect_timeout_s)
    except Exception as exc:
        raise PrepareRefused(
            f"{p.describe()}: branch {branch.branch_id} of batch {branch.batch_id} was "
            f"committed by another attempt while this one wrote, and this attempt's "
            f"transaction (transactional id {tid!r}) could not be aborted: "
            f"{describe_error(exc)}; the driver's next sweep or the transaction timeout "
            "ends it") from exc


def _write(p: KafkaParticipant, producer: Any, consumer: Any, branch: BranchRef, tid: str,
           schema: pa.Schema, batches: Iterable[pa.RecordBatch]
           ) -> tuple[int, TxnState, dict[int, int]]:
    """Begin, produce, flush, describe, add the marker: (rows, the transaction's state,
    the first offset written per partition). A failure aborts this producer's own
    transaction (it is this process's) and refuses the vote."""
    deliveries = Deliveries()

    step = "begin the transaction"
    try:
        producer.begin_transaction()
        step = "produce"
        rows = produce_all(p, producer, schema, batches, deliveries, deliveries.errors,
                           headers(branch))
        step = "flush"
        left = producer.flush(p.connect_timeout_s)
        deliveries.check()
        if left:
            raise Refusal(f"{left} messages not delivered within {p.connect_timeout_s:g}s")
        step = "describe the transaction"
        state = describe_transaction(p.config, tid, p.connect_timeout_s)
        # a branch without rows has begun nothing on the broker yet: the marker does
        expected = ("Ongoing",) if rows else ("Empty", "CompleteCommit", "CompleteAbort")
        if state is None or state.state not in expected:
            raise Refusal(f"transactional id {tid!r} shows "
                          f"{'nothing' if state is None else state.state} after the flush, "
                          "not an open transaction (fenced by another process?)")
        step = "send the marker offset"
        add_marker(p, producer, consumer, branch,
                   f"branch {branch.branch_id} of batch {branch.batch_id}")
    except Exception as exc:
        with contextlib.suppress(Exception):
            producer.abort_transaction(p.connect_timeout_s)
        cause = str(exc) if isinstance(exc, (Refusal, ValueError)) else \
            f"cannot {step}: {describe_error(exc)}"
        raise PrepareRefused(f"{p.describe()}: branch {branch.branch_id} of batch "
                             f"{branch.batch_id} refused: {cause}") from exc
    return rows, state, deliveries.first


def _ids(handle: Handle) -> tuple[str, int, int]:
    try:
        return (handle["transactional_id"], int(handle["producer_id"]),
                int(handle["producer_epoch"]))
    except (KeyError, ValueError) as exc:
        raise ParticipantError(f"a resumable Kafka handle lacks {exc}: {dict(handle)}") from exc


def _marker_committed(p: KafkaParticipant, branch: BranchRef) -> bool:
    """The marker's committed offset, read without waiting on open transactions (a
    stable read waits while any transaction holds the group's offsets, another
    attempt's too), asked twice: a commit whose markers are being written shows soon."""
    for wait in (0.0, 0.5):
        time.sleep(wait)
        if read_marker_now(p, branch) >= branch.batch_id + 1:
            return True
    return False


def commit(p: KafkaParticipant, branch: BranchRef, handle: Handle) -> None:
    """``EndTxn(commit)`` for the handle's (id, producer id, epoch). Retried while the
    coordinator is busy or moving (``CONCURRENT_TRANSACTIONS``, a failover, a timeout)
    until ``commit_retry_s``; any other answer (``PRODUCER_FENCED``,
    ``INVALID_PRODUCER_EPOCH``, ``INVALID_TXN_STATE``, an unknown producer id) means the
    transaction was ended already: committed when the marker says so, else it is lost
    and the error says the branch must be redone."""
    p._check_branch(branch)
    if handle.get("already_committed") == "yes":
        return
    tid, pid, epoch = _ids(handle)
    deadline = time.monotonic() + p.commit_retry_s
    delay = 0.05
    while True:
        try:
            answer = end_transaction(p.config, tid, pid, epoch, commit=True,
                                     timeout=p.connect_timeout_s)
        except TxnWireError as exc:
            answer = exc.name if exc.name != "NETWORK" else "REQUEST_TIMED_OUT"
            cause: str = str(exc)
        else:
            cause = answer
        if answer == "NONE":
            return
        if answer in RETRIABLE:
            if time.monotonic() < deadline:
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            raise ParticipantError(
                f"{p.describe()}: commit of branch {branch.branch_id} of batch "
                f"{branch.batch_id} (transactional id {tid!r}) still in doubt after "
                f"{p.commit_retry_s:g}s: {cause}; call commit again")
        if _marker_committed(p, branch):
            return
        raise ParticipantError(
            f"{p.describe()}: transaction of branch {branch.branch_id} of batch "
            f"{branch.batch_id} (transactional id {tid!r}, producer {pid} epoch {epoch}) "
            f"was ended by the broker before its commit ({cause}: the transaction timeout "
            "passed or the id was initialised again); the branch must be redone under "
            "the COMMIT decision")


def abort(p: KafkaParticipant, branch: BranchRef, handle: Handle) -> None:
    """``EndTxn(abort)``; a transaction already ended (any answer but a busy or moving
    coordinator) leaves nothing to undo."""
    p._check_branch(branch)
    if handle.get("already_committed") == "yes":
        return
    tid, pid, epoch = _ids(handle)
    deadline = time.monotonic() + p.commit_retry_s
    while True:
        try:
            answer = end_transaction(p.config, tid, pid, epoch, commit=False,
                                     timeout=p.connect_timeout_s)
        except TxnWireError as exc:
            answer = exc.name if exc.name != "NETWORK" else "REQUEST_TIMED_OUT"
        if answer not in RETRIABLE:
            return
        if time.monotonic() > deadline:
            raise ParticipantError(
                f"{p.describe()}: abort of branch {branch.branch_id} of batch "
                f"{branch.batch_id} (transactional id {tid!r}) not answered within "
                f"{p.commit_retry_s:g}s: {answer}")
        time.sleep(0.1)


def abort_unvoted(p: KafkaParticipant, branch: BranchRef) -> None:
    """Abort whatever is open on the branch's pool ids (a vote lost with its process:
    the handle is unknown, the broker names the producer id and epoch). Call it only
    when no newer attempt is preparing that branch."""
    p._check_branch(branch)
    for slot in range(SLOTS):
        tid = pool_id(p, branch, slot)
        state = describe_transaction(p.config, tid, p.connect_timeout_s)
        if state is not None and state.state == "Ongoing":
            abort(p, branch, {"transactional_id": tid, "producer_id": str(state.producer_id),
                              "producer_epoch": str(state.producer_epoch)})


def abort_other_attempts(p: KafkaParticipant, sink: str, kept: Iterable[Handle]) -> int:
    """``EndTxn(abort)`` for every transaction open on ``sink``'s pool ids of this
    participant, but the ``kept`` handles' (the recorded votes): what another attempt
    of a branch left open (a speculative or retried copy whose vote lost, or that Spark
    killed after it began), with the producer id and epoch the broker shows. Called by
    the driver once its batch is applied, before the next begins: no other transaction
    of the sink's pool is legitimately open then. Returns how many were aborted."""
    keep = {_ids(h) for h in kept if is_resumable(h) and h.get("already_committed") != "yes"}
    prefix = f"twophase.{sink}.{p.name}."
    config = common_config(p.config)
    # the admin client is kept on the (driver's) participant for the next batch: one
    # ListTransactions per broker is then all a batch with nothing to abort costs
    if p.sweep_admin is None:
        p.sweep_admin = admin_client(p.describe(), config, p.connect_timeout_s)
    try:
        listed = list_open_transactions(p.describe(), config, prefix, p.connect_timeout_s,
                                        admin=p.sweep_admin)
    except Exception:
        admin, p.sweep_admin = p.sweep_admin, None
        with contextlib.suppress(Exception):
            admin.close()
        raise
    found = [t for t in listed if t.transactional_id[len(prefix):].startswith("w")
             and (t.transactional_id, t.producer_id, t.producer_epoch) not in keep]
    for t in found:
        abort(p, BranchRef(sink, "other", 0, 0, p.name, 0), {
            "transactional_id": t.transactional_id, "producer_id": str(t.producer_id),
            "producer_epoch": str(t.producer_epoch)})
    return len(found)


def voted_status(p: KafkaParticipant, branch: BranchRef, handle: Handle) -> BranchStatus:
    """COMMITTED by the marker; PREPARED while the coordinator holds the handle's
    transaction open (or completing its commit); else ABSENT, read after the marker
    again (a commit completing between the two reads)."""
    p._check_branch(branch)
    if read_marker_now(p, branch) >= branch.batch_id + 1:
        return BranchStatus.COMMITTED
    if handle.get("already_committed") == "yes":
        return BranchStatus.ABSENT  # a redo that found it committed: the marker says so
    tid, pid, epoch = _ids(handle)
    state = describe_transaction(p.config, tid, p.connect_timeout_s)
    if state is not None and (state.producer_id, state.producer_epoch) == (pid, epoch) \
            and state.state in ("Ongoing", "PrepareCommit"):
        return BranchStatus.PREPARED
    return BranchStatus.COMMITTED if _marker_committed(p, branch) else BranchStatus.ABSENT
