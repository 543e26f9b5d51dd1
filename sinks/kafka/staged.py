"""Kafka's staged prepare: a branch that survives its task, committed from the driver.

librdkafka commits a transaction only from the producer that opened it, and some brokers
refuse the resumable prepare's ``EndTxn`` from another connection (tansu 0.6). The
staged prepare does not open one in the task:

- **prepare** (the task): the branch's records go to a *staging topic* (default
  ``<topic>.twophase-staged``, created by :meth:`check` on the driver) through an
  idempotent producer (``acks=all``), all into one staging partition
  (``partition % staging partitions``), each with the branch's headers plus the attempt
  and a token unique to this prepare call. Once every record is acknowledged the vote's
  handle names where they are: staging partition, first and last offset, count, token.
  A failed or duplicate attempt leaves records under another token: never copied.
- **commit** (the driver's :class:`~twophase.engine.commit.Committer`, a restarted driver,
  ``twophase resolve``, or a Spark task redoing the branch): one Kafka transaction per
  branch reads the staged range, keeps the records carrying the handle's token,
  produces them to the target topic with their key, value and original headers (the
  target's partitioner places them), and commits the branch's marker (its
  marker group's offset, ``send_offsets_to_transaction``) in the same transaction:
  Kafka's read-process-write rule. The staged count is checked against the handle
  before ``commit_transaction``; a mismatch aborts the transaction (nothing visible) and
  is an error. Every copy of a branch runs on the branch's own transactional id,
  ``...commit.p<partition>`` (:mod:`.lanes`), and reads the marker only after its
  ``init_transactions``: two processes finishing one batch at once fence each other's
  copies of a branch, so at most one commits it; the fenced one reads the marker
  again (waiting for the other's transaction to end) and takes the branch over only
  if it is still not committed. A copy cut by a crash is aborted by the next copy's
  init and copied again.
- **recovery**: a branch reads PREPARED while its staged range is in the staging topic
  (:func:`voted_status`), so a restart finishes a COMMIT-decided batch from the driver
  (``twophase.engine.recover``) without the batch's rows. Only a branch whose records retention
  took is written again from the replay, by Spark tasks, on the same per-branch ids.
- **abort**: nothing is visible and nothing is held (no transaction, no lock): the staged
  records are never copied; the driver's background prune deletes those of committed
  batches below the marker window (:mod:`.stagedprune`), retention the rest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Final

from twophase import failpoints
from twophase.errors import InvalidRequest
from twophase.participant import BranchRef, BranchStatus, Handle, ParticipantError, PrepareRefused
from twophase.sinks.kafka.config import common_config, validate_topic
from twophase.sinks.kafka.errors import (
    FENCED,
    CommitNotDone,
    commit_retrying,
    describe_error,
    kafka_error,
)
from twophase.sinks.kafka.lanes import Lane, copy_id, drop, ready, retire, using
from twophase.sinks.kafka.marker import (
    add_marker,
    committed_marker,
    held_consumer,
    read_marker,
)
from twophase.sinks.kafka.records import produce_all

if TYPE_CHECKING:
    import pyarrow as pa

    from twophase.sinks.kafka.participant import KafkaParticipant

__all__ = ["DEFAULT_PREPARE", "PREPARE_MODES", "STAGING_SUFFIX", "abort",
           "check", "close_all", "commit", "default_staging_topic", "is_staged", "prepare",
           "voted_status"]

PREPARE_MODES: Final = ("resumable", "staged")
DEFAULT_PREPARE: Final = "resumable"
"""The default: each record written once, in its task's transaction, committed by the
driver with ``EndTxn``; no barrier stage, so dynamic allocation and speculation are
allowed (docs/decisions.md, "resumable prepare as the default"). "staged" stays
selectable, for brokers that refuse the resume; "in_task" was retired in 0.4."""
STAGING_SUFFIX: Final = ".twophase-staged"
STAGING_PARTITIONS: Final = 8
"""A created staging topic's least partition count: branches that share a staging
partition interleave there, and each copy reads past the others' records."""
_ATTEMPT: Final = "twophase.attempt"
log = logging.getLogger("twophase.sink")
_STAGE_ID: Final = "twophase.stage"  # header of the prepare call's token
TAKEOVERS: Final = 2
"""Times one commit call takes a branch over after a fence whose copy did not commit it
(a process that died or failed): bounded, so two finishers never fence each other on
and on; past it the error is raised and the batch is finished again."""
_FENCED_PAUSE_S: Final = (0.2, 0.6)
"""A fenced copy's pause before it reads the marker: the fencing copy adds its marker
offset first thing, so the read then waits for that copy's end instead of missing it."""


def is_staged(p: KafkaParticipant, handle: Handle | None) -> bool:
    """Whether a branch was staged: its vote's handle says how it was prepared (a
    participant rebuilt in the other mode commits or aborts it all the same); without a
    transactional.id (no handle, or a branch found committed), the staged path."""
    if handle is not None and "transactional_id" in handle:
        return handle.get("prepare") == "staged"
    return True


def default_staging_topic(topic: str) -> str:
    """``<topic>.twophase-staged``: validated like any topic name (249 characters)."""
    name = topic + STAGING_SUFFIX
    try:
        return validate_topic(name)
    except InvalidRequest as exc:
        raise InvalidRequest(f"default staging topic for {topic!r}: {exc}; pass "
                             "staging_topic=") from exc


# -- driver-side check ---------------------------------------------------------------------
def check(p: KafkaParticipant) -> int:
    """Make sure the staging topic exists (created with the target's partition count, at
    least :data:`STAGING_PARTITIONS`, when missing); returns its partition count. A topic
    that cannot be created is an error naming the fix."""
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    # An AdminClient is a producer to librdkafka, whose metadata request for one topic
    # lets the broker auto-create it (auto.create.topics.enable, on by default) with
    # num.partitions (1 by default): the staging topic would get one partition, not
    # STAGING_PARTITIONS, and every copy would read past every other branch's records.
    conf: Any = {**common_config(p.config), "allow.auto.create.topics": False}
    admin = AdminClient(conf)
    found = _partitions(admin, p.staging_topic, p.connect_timeout_s)
    if found:
        return found
    n = max(_partitions(admin, p.topic, p.connect_timeout_s), STAGING_PARTITIONS)
    try:
        [future] = admin.create_topics([NewTopic(p.staging_topic, n)],
                                       request_timeout=p.connect_timeout_s).values()
        future.result(timeout=p.connect_timeout_s)
    except Exception as exc:
        err = kafka_error(exc)
        if err is None or err.name() != "TOPIC_ALREADY_EXISTS":
            raise ParticipantError(
                f"{p.describe()}: staging topic {p.staging_topic!r} does not exist at "
                f"{p.bootstrap} and could not be created: {describe_error(exc)}; create it "
                "(any partition count; its retention must outlast a batch's commit), grant "
                "this principal Create on the cluster, or pass staging_topic= naming an "
                "existing topic"
            ) from exc
    deadline = time.monotonic() + p.connect_timeout_s
    while not (found := _partitions(admin, p.staging_topic, p.connect_timeout_s)):
        if time.monotonic() > deadline:
            raise ParticipantError(f"{p.describe()}: staging topic {p.staging_topic!r} was "
                                   "created but does not show in the metadata; retry")
        time.sleep(0.1)
    return found


def _partitions(client: Any, topic: str, timeout: float) -> int:
    """The topic's partition count; 0 when it does not exist."""
    md = client.list_topics(topic=topic, timeout=timeout)
    t = md.topics.get(topic)
    return 0 if t is None or t.error is not None else len(t.partitions)


# -- prepare (the task) --------------------------------------------------------------------
class _Stagers:
    """This process's idempotent staging producers, one per settings (thread-safe, no
    transaction: shared by every branch; a forked child builds its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, Any] = {}
        self._pid = os.getpid()

    def get(self, config: dict[str, object]) -> Any:
        from confluent_kafka import Producer

        key = json.dumps(config, sort_keys=True, default=str)
        with self._lock:
            if self._pid != os.getpid():
                self._by_key, self._pid = {}, os.getpid()
            found = self._by_key.get(key)
            if found is None:
                found = self._by_key[key] = Producer(config)
            return found

    def close_all(self) -> None:
        with self._lock:
            found, self._by_key = list(self._by_key.values()), {}
        for producer in found:
            with contextlib.suppress(Exception):
                producer.flush(5)
                producer.close()


STAGERS = _Stagers()


def prepare(
    p: KafkaParticipant, branch: BranchRef, schema: pa.Schema,
    batches: Iterable[pa.RecordBatch],
) -> dict[str, str]:
    """Stage the branch's records (see the module docstring); the handle says where.
    A branch whose marker is committed writes nothing."""
    p._check_branch(branch)
    if read_marker(p, branch) >= branch.batch_id + 1:
        return {**p._handle(branch, 0, already=True), "prepare": "staged"}
    cfg = dict(p.config)
    cfg.update({"enable.idempotence": True, "acks": "all"})
    producer = STAGERS.get(cfg)
    staging_partitions = p.staging_partitions or _partitions(
        producer, p.staging_topic, p.connect_timeout_s)
    if not staging_partitions:
        raise PrepareRefused(f"{p.describe()}: staging topic {p.staging_topic!r} does not "
                             f"exist at {p.bootstrap}; check() on the driver creates it")
    partition = branch.partition % staging_partitions
    token = uuid.uuid4().hex
    headers = [*p.headers(branch), (_ATTEMPT, str(branch.attempt).encode()),
               (_STAGE_ID, token.encode())]
    errors: list[Any] = []
    offsets: list[int] = []

    def on_delivery(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append(err)
        else:
            offsets.append(msg.offset())

    try:
        rows = produce_all(p, producer, schema, batches, on_delivery, errors, headers,
                              topic=p.staging_topic, partition=partition)
        left = producer.flush(p.connect_timeout_s)
    except Exception as exc:
        raise PrepareRefused(f"{p.describe()}: branch {branch.branch_id} of batch "
                             f"{branch.batch_id} refused: cannot stage: {exc}") from exc
    if errors or left or len(offsets) != rows:
        cause = (f"{errors[0].name()}: {errors[0].str()}" if errors
                 else f"{rows - len(offsets)} records not acknowledged within "
                      f"{p.connect_timeout_s:g}s")
        raise PrepareRefused(f"{p.describe()}: branch {branch.branch_id} of batch "
                             f"{branch.batch_id} refused: staging failed: {cause}")
    handle = p._handle(branch, rows, already=False)
    handle.update({"prepare": "staged", "staging_topic": p.staging_topic,
                   "staging_partition": str(partition), "token": token,
                   "first_offset": str(min(offsets, default=-1)),
                   "last_offset": str(max(offsets, default=-1))})
    return handle


# -- commit (the driver) -------------------------------------------------------------------
def commit(p: KafkaParticipant, branch: BranchRef, handle: Handle | None) -> None:
    """Copy the staged records and commit the marker in one transaction (see the module
    docstring). A committed marker is success; without a staged handle the branch can
    only be found committed."""
    p._check_branch(branch)
    if handle is not None and handle.get("already_committed") == "yes":
        return
    if handle is None or handle.get("prepare") != "staged":
        if p.status(branch) is BranchStatus.COMMITTED:
            return
        raise ParticipantError(
            f"{p.describe()}: branch {branch.branch_id} of batch {branch.batch_id} cannot be "
            "committed without its vote's handle: the handle says where its records are "
            "staged; finish the batch from the coordinator's record (twophase resolve)")
    tid = copy_id(p, branch)
    with using(tid):
        for attempt in range(1, TAKEOVERS + 2):
            lane = Lane(tid)
            began = False
            try:
                ready(p, lane)  # fences every other copy of this branch
                began = True
                _copy_unless_committed(p, lane, branch, handle)
            except Exception as exc:
                drop(lane)
                if not (began and _fenced(exc)):
                    return _failed(p, branch, lane, exc)
                # Another copy of this branch began since (its init fenced this one): once
                # committed, it shows in the marker. Only when it did not commit (its
                # process died, or it failed) does this one take the branch over.
                if _committed_after_fence(p, branch):
                    return None
                if attempt > TAKEOVERS:
                    raise ParticipantError(
                        f"{p.describe()}: copy of branch {branch.branch_id} of batch "
                        f"{branch.batch_id} on transactional.id {tid!r} was fenced "
                        f"{attempt} times by other copies of the branch (another process "
                        "finishing the same batch), none of which committed it: "
                        f"{describe_error(exc)}; nothing of this copy is visible, and it is "
                        "redone from the staged records when the batch is finished "
                        "again") from exc
                log.info("%s: copy of branch %s of batch %d was fenced by another copy of "
                         "the branch (transactional.id %r), which did not commit it: "
                         "taking it over", p.describe(), branch.branch_id, branch.batch_id,
                         tid)
                continue
            except BaseException:
                drop(lane)
                raise
            retire(lane)
            return None
    return None


def _fenced(exc: BaseException) -> bool:
    """Whether a copy failed because a newer producer of its transactional id fenced it
    (the error itself or one it was raised from)."""
    seen: BaseException | None = exc
    for _ in range(8):  # a chain is short; bounded against a cycle
        if seen is None:
            return False
        err = kafka_error(seen)
        if err is not None and (err.name() in FENCED or err.fatal()):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _committed_after_fence(p: KafkaParticipant, branch: BranchRef) -> bool:
    """The branch's marker read stably once the fencing copy had time to add it to its
    transaction (a short pause): the read then waits until that transaction ends, up to
    ``connect_timeout_s`` (a copy whose process died holds it until the broker's
    transaction timeout: then it reads not committed, and is taken over)."""
    time.sleep(random.uniform(*_FENCED_PAUSE_S))  # noqa: S311 - a jitter, not crypto
    with held_consumer(p, branch) as consumer:
        return committed_marker(p, consumer, branch,
                                pending_wait_s=p.connect_timeout_s) >= branch.batch_id + 1


def _failed(p: KafkaParticipant, branch: BranchRef, lane: Lane, exc: Exception) -> None:
    """A copy that failed for another cause than a fence: its id is initialised again at
    once (the copy it may have left open holds the marker group's offsets; an ambiguous
    commit is completed by the init), then the marker tells whether the copy committed
    after all (success); if not, the error is raised, naming what happens next."""
    try:
        ready(p, lane, reader=False)
        retire(lane)
        fenced = "fenced (its open copy, if any, aborted)"
    except Exception as again:
        drop(lane)
        fenced = f"not fenced ({again}); its next use fences it"
    else:
        with contextlib.suppress(Exception):
            if read_marker(p, branch) >= branch.batch_id + 1:
                log.info("%s: copy of branch %s of batch %d reported %s, and its marker "
                         "reads committed: done", p.describe(), branch.branch_id,
                         branch.batch_id, exc)
                return
    log.warning("%s: copy of branch %s of batch %d failed on lane %s: %s; the lane "
                "is %s, and the copy is redone when the batch is finished again",
                p.describe(), branch.branch_id, branch.batch_id, lane.transactional_id, exc,
                fenced)
    _named(p, branch, lane, exc, fenced)
    raise exc


def voted_status(p: KafkaParticipant, branch: BranchRef, handle: Handle) -> BranchStatus:
    """A staged branch's state under its vote: COMMITTED when its marker is; else
    PREPARED while the staged range is still in the staging topic (its copy needs
    nothing but the handle, so a finish commits it from the driver without the batch's
    rows, ``twophase.engine.recover``); ABSENT once the topic's retention took the range's
    first record, when only a redo from the replayed rows (digest-checked) can write it.
    The marker is read as :meth:`KafkaParticipant.status` reads it, stably too: the broker
    answers a copy's commit before it writes the marker into the group, so a read without
    waiting, just after the commit, can miss it."""
    if p.status(branch) is BranchStatus.COMMITTED:
        return BranchStatus.COMMITTED
    first = int(handle["first_offset"])
    if first < 0:
        return BranchStatus.PREPARED  # nothing staged: the copy commits the marker alone
    from confluent_kafka import TopicPartition

    staging, partition = handle["staging_topic"], int(handle["staging_partition"])
    with held_consumer(p, branch) as consumer:
        try:
            low, _ = consumer.get_watermark_offsets(
                TopicPartition(staging, partition), timeout=p.connect_timeout_s,
                cached=False)
        except Exception as exc:
            raise ParticipantError(
                f"{p.describe()}: cannot read the offsets of staging topic {staging!r} "
                f"partition {partition} for branch {branch.branch_id} of batch "
                f"{branch.batch_id}: {describe_error(exc)}") from exc
    if low <= first:
        return BranchStatus.PREPARED
    log.warning("%s: branch %s of batch %d: its staged records (%r partition %d from offset "
                "%d) are gone, the staging topic now begins at %d (its retention must "
                "outlast a batch's commit): the branch is written again from the replayed "
                "batch", p.describe(), branch.branch_id, branch.batch_id, staging, partition,
                first, low)
    return BranchStatus.ABSENT


def _named(p: KafkaParticipant, branch: BranchRef, lane: Lane, exc: BaseException,
           fenced: str) -> None:
    """A client library's error from a copy (a fenced lane: another process finishing
    the same batch; a broker gone) raised as this participant's, naming the branch, the
    lane and what happens next; ours and interrupts pass as they are."""
    if isinstance(exc, Exception) and not isinstance(exc, ParticipantError):
        raise ParticipantError(
            f"{p.describe()}: copy of branch {branch.branch_id} of batch {branch.batch_id} "
            f"failed on transactional.id {lane.transactional_id!r}: {describe_error(exc)}; "
            f"the lane is {fenced}; nothing of this copy is visible, and it is redone "
            "from the staged records when the batch is finished again (a second process "
            "finishing the same batch, e.g. `twophase resolve` beside the running job, "
            "fences this one's copies)") from exc


def _copy_unless_committed(p: KafkaParticipant, lane: Lane, branch: BranchRef,
                           handle: Handle) -> None:
    """Read the branch's marker on an initialised lane; copy only if it is not committed."""
    with held_consumer(p, branch) as consumer:
        if committed_marker(p, consumer, branch) < branch.batch_id + 1:
            _copy(p, lane, consumer, branch, handle)


def _copy(p: KafkaParticipant, lane: Lane, consumer: Any, branch: BranchRef,
          handle: Handle) -> None:

    producer = lane.producer
    expected = int(handle["rows"])
    where = f"branch {branch.branch_id} of batch {branch.batch_id}"
    producer.begin_transaction()
    try:
        # bounded (librdkafka#5456): else the driver waits until a broker state change
        add_marker(p, producer, consumer, branch, where)
        copied = 0
        produce, poll, topic = producer.produce, producer.poll, p.topic
        for key, value, headers in _staged(p, lane.reader, branch, handle):
            while True:
                try:
                    produce(topic, value, key, headers=headers)
                    break
                except BufferError:
                    poll(0.05)
            copied += 1
        if copied != expected:
            raise ParticipantError(
                f"{p.describe()}: {where}: {copied} staged records carry its token in "
                f"{handle['staging_topic']!r} partition {handle['staging_partition']} "
                f"offsets {handle['first_offset']}..{handle['last_offset']}, the vote "
                f"says {expected}; nothing was committed (the staging topic was altered?)")
        # No delivery callbacks: a record that fails makes the transaction abortable,
        # and commit_transaction (below) then fails with the cause.
        left = producer.flush(p.connect_timeout_s)
        if left:
            raise ParticipantError(f"{p.describe()}: {where}: copy failed: {left} records "
                                   f"not delivered within {p.connect_timeout_s:g}s")
        failpoints.hit("mid_commit", p.name, branch.partition)
    except BaseException:
        if not getattr(producer, "stuck", False):  # a stuck one refuses any other call
            with contextlib.suppress(Exception):
                producer.abort_transaction(p.connect_timeout_s)
        raise
    _end(p, producer, where)


def _end(p: KafkaParticipant, producer: Any, where: str) -> None:
    """``commit_transaction``, ambiguous errors retried (:func:`.errors.commit_retrying`);
    a failure is raised (the lane is dropped; the next init aborts the copy)."""
    try:
        commit_retrying(producer, p.connect_timeout_s, p.commit_retry_s)
    except CommitNotDone as exc:
        raise ParticipantError(
            f"{p.describe()}: {where}: commit of the copy failed after {exc.attempts} "
            f"attempts: {exc.cause}; the batch is finished again (the copy "
            "is redone from the staged records)") from exc.__cause__


def _staged(p: KafkaParticipant, reader: Any, branch: BranchRef, handle: Handle
            ) -> Iterator[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]]:
    """(key, value, original headers) of the records in the handle's staged range that
    carry its token and the branch's identity, in offset order."""
    from confluent_kafka import TopicPartition

    first, last = int(handle["first_offset"]), int(handle["last_offset"])
    if first < 0:
        return
    staging, partition = handle["staging_topic"], int(handle["staging_partition"])
    target = p.headers(branch)
    # a staged record of this prepare call carries exactly these headers (staged.prepare)
    mine = [*target, (_ATTEMPT, str(branch.attempt).encode()),
            (_STAGE_ID, handle["token"].encode())]
    reader.assign([TopicPartition(staging, partition, first)])
    try:
        offset = first
        stalled = time.monotonic() + p.connect_timeout_s
        while offset <= last:
            msgs = reader.consume(min(1000, last - offset + 1), 0.05)
            if not msgs and time.monotonic() > stalled:
                raise ParticipantError(
                    f"{p.describe()}: cannot read staged records of branch "
                    f"{branch.branch_id} from {staging!r} partition {partition} at offset "
                    f"{offset} within {p.connect_timeout_s:g}s")
            for msg in msgs:
                if msg.error():
                    raise ParticipantError(
                        f"{p.describe()}: staged records of branch {branch.branch_id} in "
                        f"{staging!r} partition {partition} from offset {offset}: "
                        f"{msg.error().name()}: {msg.error().str()} (gone with the staging "
                        "topic's retention? it must outlast a batch's commit)")
                offset = msg.offset() + 1
                if offset > last + 1:
                    break
                if msg.headers() == mine:  # else another branch, or another attempt's
                    yield msg.key(), msg.value(), target
            if msgs:
                stalled = time.monotonic() + p.connect_timeout_s
    finally:
        reader.unassign()


def abort(p: KafkaParticipant, branch: BranchRef, handle: Handle | None) -> None:
    """Nothing to undo: staged records are invisible in the target and hold nothing (no
    open transaction, no lock); they are never copied and leave with the staging topic's
    retention."""
    p._check_branch(branch)


def close_all() -> None:
    """Close this process's staging producers: for a test or tool stopping the broker it
    started (idle clients would go on reconnecting to it). Copy lanes are closed after
    each copy."""
    STAGERS.close_all()
