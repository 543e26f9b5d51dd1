"""Kafka participant: a transactional producer per branch, committed offsets as the marker.

Two prepares (``prepare=``): "staged" (the default, :mod:`.staged`: records staged in
the task, copied with the marker in one transaction by the driver; durable, no barrier
stage) and "in_task", described here. How an in-task branch maps onto Kafka (see
``docs/kafka.md``):

- ``transactional.id = twophase.<sink>.<participant>.<partition>``: stable per sink and
  partition across checkpoints, attempts and restarts, so the ``init_transactions`` of a
  new instance fences the zombie and aborts its open transaction.
- The idempotency marker is the committed offset ``checkpoint + 1`` of a per-branch marker
  group ``twophase.<sink>.<lineage>.<participant>.<partition>`` on ``(topic, 0)``, sent
  with ``send_offsets_to_transaction``: it becomes visible exactly when the rows do.
- Prepare is **not durable**: librdkafka cannot resume another instance's transaction, so
  only the process that prepared can commit. Elsewhere the branch is *redone* (prepare
  again and commit at once under the existing COMMIT decision).
- Producers are **reused** by the next batch in the same process (Spark reuses its Python
  workers): once a producer's transaction is committed or aborted it waits in a small
  per-process cache keyed by its transactional.id, and the next prepare of that id
  begins a transaction on it instead of creating a producer and running
  ``init_transactions``. A cached producer is not re-fenced; if another process
  initialised the id meanwhile, the cached one is fenced and its first broker call (the
  marker offset, sent before any row) fails: it is dropped and the prepare starts over
  once with a new, initialised producer, before a single row was produced. A redo never
  reuses: it must fence every older producer before it reads the log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from twophase.errors import InvalidRequest, TwophaseError
from twophase.jsoncodec import json_rows
from twophase.participant import (
    BranchRef,
    BranchStatus,
    Descriptor,
    Handle,
    Participant,
    ParticipantError,
    PrepareRefused,
    ReadBack,
    Rebuildable,
    TargetBacklog,
    Verifiable,
    required_secret,
)
from twophase.sinks.kafka import staged
from twophase.sinks.kafka.admin import (
    check_columns,
    check_topic,
    probe_topic,
    probe_transactional_write,
    unstable_records,
)
from twophase.sinks.kafka.brokerconn import unsupported
from twophase.sinks.kafka.clients import (
    MARKER_CONSUMERS,
    PRODUCERS,
    healthy,
    parse_offsets,
    to_bytes,
    txn_producer,
)
from twophase.sinks.kafka.config import (
    DEFAULT_MAX_MESSAGE_BYTES,
    RECORD_OVERHEAD_BYTES,
    TEST_BROKER_CLUSTER_ID,
    common_config,
    validate_config,
    validate_topic,
)
from twophase.sinks.kafka.errors import (
    COORDINATOR_MOVES,
    classify_commit_error,
    describe_error,
    kafka_error,
)
from twophase.sinks.kafka.lingering import (
    COMMIT_LANE,
    Listing,
    OpenTransaction,
    committing_ids,
    list_open_transactions,
)
from twophase.sinks.kafka.log import (
    LostMarker,
    judge_log,
    read_branch,
    read_log,
    settle_lost_markers,
)
from twophase.sinks.kafka.readback import read_topic
from twophase.wire import MAX_TEXT

__all__ = ["MARKER_CONSUMERS", "PRODUCERS", "KafkaParticipant"]


class _Stale(TwophaseError):
    """Internal: a cached producer failed before any row was produced (fenced by another
    process's init of its transactional.id, or otherwise broken): start over with a new one."""


@dataclass
class _Prepared:
    """A transaction this process opened and flushed, waiting for the decision."""

    branch: BranchRef
    producer: Any
    handle: dict[str, str]


class KafkaParticipant(Participant, Rebuildable, Verifiable):
    """One Kafka topic. Values are the row as JSON unless ``value=`` names a column."""

    kind = "kafka"
    durable_prepare = False

    def __init__(
        self,
        topic: str,
        config: Mapping[str, str],
        *,
        key: str | Sequence[str] | None = None,
        value: str | None = None,
        name: str | None = None,
        transaction_timeout_ms: int = 600_000,
        connect_timeout_s: float = 30.0,
        commit_retry_s: float = 120.0,
        reuse_clients: bool = False,
        prepare: str = staged.DEFAULT_PREPARE,
        staging_topic: str | None = None,
        probe_write: bool = True,
    ) -> None:
        self.topic = validate_topic(topic)
        if name is None:
            name = f"kafka-{topic}"
            if len(name) > 64:
                raise InvalidRequest(
                    f"default participant name {name[:40]!r}... is longer than 64 "
                    "characters: pass name="
                )
        super().__init__(name)
        self.config = validate_config(config)
        if value is not None and (not isinstance(value, str) or not value):
            raise InvalidRequest(f"value must be a column name, got {value!r}")
        keys: tuple[str, ...] = (
            (key,) if isinstance(key, str)
            else tuple(key) if isinstance(key, (list, tuple)) else ()
        )
        if key is not None and (
            not keys or not all(isinstance(c, str) and c for c in keys)
            or len(set(keys)) != len(keys)
        ):
            raise InvalidRequest(
                f"key must be a column name or a list of distinct column names, got {key!r}"
            )
        self.keys = keys
        """Key columns: one column's value is the key as is; several make a JSON object."""
        self.key = keys[0] if len(keys) == 1 else None
        self.value = value
        if (
            not isinstance(transaction_timeout_ms, int)
            or isinstance(transaction_timeout_ms, bool)
            or transaction_timeout_ms < 1000
        ):
            raise InvalidRequest(
                f"transaction_timeout_ms must be an int >= 1000, got {transaction_timeout_ms!r}"
            )
        self.transaction_timeout_ms = transaction_timeout_ms
        if connect_timeout_s <= 0 or commit_retry_s <= 0:
            raise InvalidRequest("connect_timeout_s and commit_retry_s must be positive")
        self.connect_timeout_s = float(connect_timeout_s)
        self.commit_retry_s = float(commit_retry_s)
        if not isinstance(reuse_clients, bool):
            raise InvalidRequest(f"reuse_clients must be True or False, got {reuse_clients!r}")
        self.reuse_clients = reuse_clients
        if prepare not in staged.PREPARE_MODES:
            raise InvalidRequest(f"prepare must be one of {staged.PREPARE_MODES}, got {prepare!r}")
        self.prepare_mode = prepare
        """"staged" (durable, no barrier: :mod:`.staged`) or "in_task" (the gang)."""
        self.durable_prepare = prepare == "staged"
        self.staging_topic = (validate_topic(staging_topic) if staging_topic is not None
                              else staged.default_staging_topic(self.topic))
        self.staging_partitions = 0  # learnt by check() on the driver (staged)
        if not isinstance(probe_write, bool):
            raise InvalidRequest(f"probe_write must be True or False, got {probe_write!r}")
        self.probe_write = probe_write
        """:meth:`probe` checks a transactional write too (ACLs), not only the topic."""
        """Keep producers and marker consumers for the next batch in this process (see
        the module docstring). Off by default: in the suite's tansu-restart test a reused
        producer blocked in ``send_offsets_to_transaction`` past its timeout after the
        broker came back (docs/kafka.md)."""
        # Learnt by check() on the driver and pickled to the executors with the object.
        self.broker_max_message_bytes: int | None = None
        self._prepared: dict[BranchRef, _Prepared] = {}
        self._lock = threading.Lock()

    # -- pickling: producers live in one process only ---------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_prepared"] = {}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- names -------------------------------------------------------------------------
    @property
    def bootstrap(self) -> str:
        return str(self.config["bootstrap.servers"])

    def transactional_id(self, branch: BranchRef) -> str:
        return f"twophase.{branch.sink}.{branch.participant}.{branch.partition}"

    def marker_group(self, branch: BranchRef) -> str:
        return f"twophase.{branch.sink}.{branch.lineage}.{branch.participant}.{branch.partition}"

    def _check_branch(self, branch: BranchRef) -> None:
        if branch.participant != self.name:
            raise ParticipantError(
                f"{self.describe()}: branch {branch.branch_id} belongs to participant "
                f"{branch.participant!r}"
            )

    # -- clients -------------------------------------------------------------------------
    def _common_config(self) -> dict[str, object]:
        return common_config(self.config)

    def producer_config(self, transactional_id: str) -> dict[str, object]:
        cfg = dict(self.config)
        cfg.update(
            {
                "transactional.id": transactional_id,
                "enable.idempotence": True,
                "acks": "all",
                "transaction.timeout.ms": self.transaction_timeout_ms,
            }
        )
        return cfg

    def max_message_bytes(self) -> int:
        """The smaller of the producer's ``message.max.bytes`` and the broker's limit."""
        limit = int(str(self.config.get("message.max.bytes", DEFAULT_MAX_MESSAGE_BYTES)))
        if self.broker_max_message_bytes is not None:
            limit = min(limit, self.broker_max_message_bytes)
        return limit

    def _marker_config(self, group: str) -> dict[str, object]:
        cfg = self._common_config()
        cfg.update(
            {
                "group.id": group,
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
            }
        )
        return cfg

    def _marker_consumer(self, group: str) -> Any:
        """The marker group's consumer: this process's idle one if a batch before left
        it (no subscription, only ``committed()`` and its group metadata are used), else
        a new one. Give it back with ``_marker_done``."""
        from confluent_kafka import Consumer

        cached = MARKER_CONSUMERS.take(self._marker_key(group)) if self.reuse_clients else None
        return cached if cached is not None else Consumer(self._marker_config(group))

    def _marker_key(self, group: str) -> tuple[str, str]:
        return json.dumps(self._marker_config(group), sort_keys=True, default=str), group

    def _marker_done(self, group: str, consumer: Any, healthy: bool = True) -> None:
        if healthy and self.reuse_clients:
            MARKER_CONSUMERS.put(self._marker_key(group), consumer)
        else:
            consumer.close()

    def _committed_marker(
        self, consumer: Any, branch: BranchRef, pending_wait_s: float | None = None
    ) -> int:
        """The marker group's committed offset on (topic, 0); -1 when none. A group
        coordinator that is loading or moved (a fresh or restarted broker, a failover:
        NOT_COORDINATOR, COORDINATOR_LOAD_IN_PROGRESS) is asked again until
        ``connect_timeout_s``; librdkafka's ``committed()`` does not retry those.

        A ``read_committed`` consumer asks for stable offsets (KIP-447): Kafka answers
        only once no transaction holding offsets of the group is open, so while one is,
        librdkafka retries until its timeout. ``pending_wait_s``: wait that long, then
        answer -1 (the open transaction's offset is not committed)."""
        from confluent_kafka import TopicPartition

        wait = self.connect_timeout_s if pending_wait_s is None else pending_wait_s
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                [tp] = consumer.committed([TopicPartition(self.topic, 0)], timeout=wait)
                break
            except Exception as exc:
                err = kafka_error(exc)
                if (err is not None and err.name() in COORDINATOR_MOVES
                        and time.monotonic() < deadline):
                    time.sleep(0.1)
                    continue
                if pending_wait_s is not None and err is not None \
                        and err.name() == "_TIMED_OUT":
                    return -1
                hint = ("; a transaction left open on the broker by a process that died "
                        "mid-commit holds this group's offsets until it ends: `twophase "
                        f"resolve {branch.sink}` aborts it (the broker does after "
                        "transaction.timeout.ms)"
                        if err is not None and err.name() == "_TIMED_OUT" else "")
                raise ParticipantError(
                    f"{self.describe()}: cannot read marker group "
                    f"{self.marker_group(branch)!r} at {self.bootstrap}: "
                    f"{describe_error(exc)}{hint}"
                ) from exc
        if tp.error is not None:
            raise ParticipantError(
                f"{self.describe()}: cannot read marker group {self.marker_group(branch)!r}: "
                f"{tp.error}"
            )
        return int(tp.offset) if tp.offset is not None and tp.offset >= 0 else -1

    def _handle(
        self, branch: BranchRef, rows: int, already: bool, offsets: Mapping[int, int] = {}
    ) -> dict[str, str]:
        handle = {
            "transactional_id": self.transactional_id(branch),
            "marker_group": self.marker_group(branch),
            "marker_offset": str(branch.batch_id + 1),
            "topic": self.topic,
            "rows": str(rows),
            "already_committed": "yes" if already else "no",
        }
        text = ",".join(f"{p}:{o}" for p, o in sorted(offsets.items()))
        if text and len(text) <= MAX_TEXT:  # else a redo reads those partitions whole
            handle["offsets"] = text  # where a redo's log check starts
        return handle

    # -- check ---------------------------------------------------------------------------
    def check(self, schema: pa.Schema) -> None:
        """Reach the brokers, make sure the topic exists, compare the transaction timeout
        with the broker's maximum and the key/value columns with the schema."""
        self._check_columns(schema)
        limit = check_topic(
            self.describe(),
            self._common_config(),
            self.topic,
            transaction_timeout_ms=self.transaction_timeout_ms,
            timeout=self.connect_timeout_s,
        )
        if limit is not None:
            self.broker_max_message_bytes = limit
        if self.durable_prepare:
            self.staging_partitions = staged.check(self)

    def probe(self) -> None:
        """The brokers answer this process with these settings, and the topic, when it
        exists already, is readable by this principal with at least one partition (run on
        the driver and on every executor; :meth:`check` creates a missing topic). With
        ``probe_write`` (the default) also a transactional write: ``init_transactions``
        on ``twophase.probe.<name>`` and the topics' Write/Read/Describe ACLs as the broker
        reports them (no record is written)."""
        for topic in (self.topic, self.staging_topic) if self.durable_prepare else (self.topic,):
            probe_topic(self.describe(), self._common_config(), topic,
                        timeout=self.connect_timeout_s)
        if self.probe_write:
            needs = {self.topic: ("WRITE", "READ", "DESCRIBE")}
            if self.durable_prepare:
                needs[self.staging_topic] = ("WRITE", "READ", "DESCRIBE")
            tid = f"twophase.probe.{self.name}"
            probe_transactional_write(
                self.describe(), self.producer_config(tid), needs,
                "--allow-principal User:<you> --operation Write --operation Describe "
                "--transactional-id twophase. --resource-pattern-type prefixed",
                timeout=self.connect_timeout_s)

    def _check_columns(self, schema: pa.Schema) -> None:
        check_columns(self.describe(), schema, self.key, self.value)
        missing = [c for c in self.keys if c not in schema.names]
        if missing:
            raise ParticipantError(
                f"{self.describe()}: key column(s) {missing} are not in the schema "
                f"{schema.names}"
            )
        if len(self.keys) > 1:
            try:
                list(json_rows(pa.RecordBatch.from_pylist(
                    [], schema=pa.schema([schema.field(c) for c in self.keys]))))
            except (ValueError, pa.ArrowException) as exc:
                raise ParticipantError(f"{self.describe()}: key columns: {exc}") from exc

    @staticmethod
    def headers(branch: BranchRef) -> list[tuple[str, bytes]]:
        """Headers of every message of a branch: where it came from, so a consumer can
        trace a message to its batch or drop a batch it has already seen (a branch's
        messages become visible together, once per (sink, lineage, batch, partition))."""
        return [
            ("twophase.sink", branch.sink.encode()),
            ("twophase.lineage", branch.lineage.encode()),
            ("twophase.batch", str(branch.batch_id).encode()),
            ("twophase.partition", str(branch.partition).encode()),
        ]

    def check_vote_window(self, vote_timeout: float) -> None:
        """A transaction must outlive the vote window, or the broker aborts it while the
        other branches are still preparing. Staged: none is open while voting."""
        if self.durable_prepare:
            return
        timeout_ms = self.transaction_timeout_ms
        if timeout_ms / 1000 <= vote_timeout + 60:
            raise InvalidRequest(
                f"{self.describe()}: transaction_timeout_ms={timeout_ms} must exceed the "
                f"sink's vote window (vote_timeout {vote_timeout:.0f}s + 60s); raise it "
                "(within the broker's transaction.max.timeout.ms) or lower vote_timeout"
            )

    # -- prepare -------------------------------------------------------------------------
    def _cache_key(self, branch: BranchRef) -> tuple[str, str]:
        tid = self.transactional_id(branch)
        return json.dumps(self.producer_config(tid), sort_keys=True, default=str), tid

    def _release(self, branch: BranchRef, producer: Any) -> None:
        """A producer with no open transaction goes back to the cache for the next batch
        (``reuse_clients``) if it never saw a broker error, or is closed (it has no
        transaction to wait for)."""
        if self.reuse_clients and healthy(producer):
            PRODUCERS.put(self._cache_key(branch), producer)
        else:
            producer.close()

    def _new_producer(self, branch: BranchRef) -> Any:
        """A producer for the branch's transactional.id, initialised: zombies are fenced."""
        from confluent_kafka import Producer

        tid = self.transactional_id(branch)
        cfg = self.producer_config(tid)
        producer = txn_producer(Producer, cfg) if self.reuse_clients else Producer(cfg)
        try:
            producer.init_transactions(self.connect_timeout_s)
        except Exception as exc:
            err = kafka_error(exc)
            hint = ""
            if err is not None and err.name() == "INVALID_TRANSACTION_TIMEOUT":
                hint = (
                    f" (transaction_timeout_ms={self.transaction_timeout_ms} exceeds the "
                    "broker's transaction.max.timeout.ms)"
                )
            raise PrepareRefused(
                f"{self.describe()}: cannot initialise transactional.id {tid!r} at "
                f"{self.bootstrap} within {self.connect_timeout_s:g}s: {describe_error(exc)}{hint}"
            ) from exc
        return producer

    def prepare(
        self, branch: BranchRef, schema: pa.Schema, batches: Iterable[pa.RecordBatch]
    ) -> Handle:
        """Write the rows and the marker in one open transaction, flushed, not committed;
        staged: write them to the staging topic (:mod:`.staged`)."""
        if self.durable_prepare:
            return staged.prepare(self, branch, schema, batches)
        return self._prepare(branch, schema, batches, None)

    def redo(
        self,
        branch: BranchRef,
        schema: pa.Schema,
        batches: Iterable[pa.RecordBatch],
        voted: Handle | None,
    ) -> Handle:
        """Prepare again under a COMMIT decision, unless the branch was committed after
        all: the marker says so, or (the marker may lag, see :meth:`_committed_in_log`)
        the partition logs hold the branch's records committed. Staged: prepare again."""
        if self.durable_prepare:
            return staged.prepare(self, branch, schema, batches)
        return self._prepare(branch, schema, batches, voted if voted is not None else {})

    def _prepare(
        self,
        branch: BranchRef,
        schema: pa.Schema,
        batches: Iterable[pa.RecordBatch],
        voted: Handle | None,
    ) -> Handle:
        self._check_branch(branch)
        with self._lock:
            stale = self._prepared.pop(branch, None)
        if stale is not None and stale.producer is not None:
            # Prepared twice in one process: undo the first one before starting again.
            self._discard(stale.producer)
        # A new attempt begins on this process's idle producer of the id if there is one;
        # a redo always starts a new one: it fences every older producer of the branch
        # before the marker and the log are read.
        cached = PRODUCERS.take(self._cache_key(branch)) if self.reuse_clients else None
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
        producer = cached if cached is not None else self._new_producer(branch)
        group = self.marker_group(branch)
        consumer = self._marker_consumer(group)
        keep = idle = consumer_ok = False
        try:
            marker = self._committed_marker(consumer, branch)
            consumer_ok = True
            if marker >= branch.batch_id + 1 or (
                voted is not None and self._committed_in_log(branch, voted, wait=True)
            ):
                # Idempotent redo: this checkpoint's rows are already committed.
                idle = True  # no transaction was begun: the producer serves the next batch
                return self._handle(branch, 0, already=True)
            try:
                rows, offsets = self._write(producer, consumer, branch, schema, batches,
                                            reused=cached is not None)
            except _Stale:
                # The cached producer was fenced (or broke) before any row was produced:
                # drop it (not closed, not aborted: both wait on a fenced producer; the new
                # producer's init aborts whatever it had begun) and start over once.
                producer = cached = None
                producer = self._new_producer(branch)
                rows, offsets = self._write(producer, consumer, branch, schema, batches)
            handle = self._handle(branch, rows, already=False, offsets=offsets)
            with self._lock:
                self._prepared[branch] = _Prepared(branch, producer, handle)
            keep = True
            return handle
        finally:
            self._marker_done(group, consumer, consumer_ok)
            if producer is None:
                pass
            elif idle:
                self._release(branch, producer)
            elif not keep:
                self._discard(producer)

    def log_readable(self) -> bool:
        """The partition-log reader can connect with these settings: plaintext, TLS, SASL
        PLAIN or SCRAM (not GSSAPI or OAUTHBEARER, :mod:`.brokerconn`)."""
        return unsupported(self.config) is None

    def _committed_in_log(self, branch: BranchRef, voted: Handle, *, wait: bool) -> bool:
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
        if not self.log_readable():
            return False
        start = parse_offsets(voted.get("offsets", ""))
        tag = dict(self.headers(branch))
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                seen = read_branch(self.config, self.topic, tag, start,
                                   timeout=self.connect_timeout_s)
            except ParticipantError as exc:
                raise ParticipantError(
                    f"{self.describe()}: cannot read the log to check branch "
                    f"{branch.branch_id} of batch {branch.batch_id} before redoing it: {exc}"
                ) from exc
            if seen.committed:
                return True
            if not seen.open or not wait:
                return False
            if time.monotonic() > deadline:
                raise ParticipantError(
                    f"{self.describe()}: {seen.open} records of branch {branch.branch_id} "
                    f"of batch {branch.batch_id} are still in an open transaction "
                    f"{self.connect_timeout_s:g}s after their producer was fenced; not "
                    "redoing it (it may yet commit): retry the batch"
                )
            time.sleep(0.2)

    def _write(
        self,
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
        producer fails before any row is read: raises ``_Stale`` when ``reused``), then
        the rows, then flush."""
        from confluent_kafka import TopicPartition

        errors: list[Any] = []
        first: dict[int, int] = {}

        def on_delivery(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(err)
            else:
                p, o = msg.partition(), msg.offset()
                if o is not None and o >= 0 and (p not in first or o < first[p]):
                    first[p] = o

        step = "begin the transaction"
        rows = 0
        try:
            producer.begin_transaction()
            step = "send the marker offset"
            producer.send_offsets_to_transaction(
                [TopicPartition(self.topic, 0, branch.batch_id + 1)],
                consumer.consumer_group_metadata(),
                self.connect_timeout_s,
            )
        except Exception as exc:
            if reused:  # no abort: a fenced producer's abort waits out connect_timeout_s
                raise _Stale(f"cannot {step}: {describe_error(exc)}") from exc
            self._abort_own(producer)
            raise PrepareRefused(
                f"{self.describe()}: branch {branch.branch_id} of batch "
                f"{branch.batch_id} refused: cannot {step}: {describe_error(exc)}"
            ) from exc
        try:
            step = "produce"
            rows = self._produce_all(producer, schema, batches, on_delivery, errors,
                                     self.headers(branch))
            step = "flush"
            left = producer.flush(self.connect_timeout_s)
            if errors:
                raise _Refusal(f"delivery failed: {errors[0].name()}: {errors[0].str()}")
            if left:
                raise _Refusal(
                    f"{left} messages not delivered within {self.connect_timeout_s:g}s"
                )
        except (_Refusal, ValueError) as exc:
            self._abort_own(producer)
            raise PrepareRefused(
                f"{self.describe()}: branch {branch.branch_id} of batch "
                f"{branch.batch_id} refused: {exc}"
            ) from exc
        except Exception as exc:
            self._abort_own(producer)
            raise PrepareRefused(
                f"{self.describe()}: branch {branch.branch_id} of batch "
                f"{branch.batch_id} refused: cannot {step}: {describe_error(exc)}"
            ) from exc
        return rows, first

    def _produce_all(
        self,
        producer: Any,
        schema: pa.Schema,
        batches: Iterable[pa.RecordBatch],
        on_delivery: Callable[[Any, Any], None],
        errors: list[Any],
        headers: list[tuple[str, bytes]],
        *,
        topic: str | None = None,
        partition: int = -1,
    ) -> int:
        limit = self.max_message_bytes()
        room = limit - RECORD_OVERHEAD_BYTES - sum(len(k) + len(v) for k, v in headers)
        produce, poll, topic = producer.produce, producer.poll, topic or self.topic
        rows = 0
        for batch in batches:
            if batch.schema.names != schema.names:
                raise _Refusal(
                    f"batch columns {batch.schema.names} differ from the schema {schema.names}"
                )
            for k, v in self._messages(batch):
                size = (len(v) if v else 0) + (len(k) if k else 0)
                if size > room:
                    raise _Refusal(
                        f"row {rows} is {size} bytes (key+value), over the message size limit "
                        f"of {limit} bytes less {RECORD_OVERHEAD_BYTES} bytes of record "
                        "overhead and the twophase headers (message.max.bytes of the "
                        "producer / max.message.bytes of the topic)"
                    )
                try:
                    produce(topic, v, k, partition, on_delivery=on_delivery, headers=headers)
                except BufferError:
                    while True:  # the local queue is full: serve delivery reports, retry
                        poll(0.05)
                        try:
                            produce(topic, v, k, partition, on_delivery=on_delivery,
                                    headers=headers)
                            break
                        except BufferError:
                            continue
                rows += 1
            if errors:
                raise _Refusal(f"delivery failed: {errors[0].name()}: {errors[0].str()}")
        return rows

    def _messages(self, batch: pa.RecordBatch) -> Iterator[tuple[bytes | None, bytes | None]]:
        n = batch.num_rows
        if self.value is not None:
            values: Iterable[bytes | None] = (
                to_bytes(v) for v in batch.column(self.value).to_pylist()
            )
        else:
            values = json_rows(batch)
        if self.key is not None:
            keys: Iterable[bytes | None] = [
                to_bytes(k) for k in batch.column(self.key).to_pylist()
            ]
        elif self.keys:
            keys = list(json_rows(batch.select(list(self.keys))))
        else:
            keys = itertools.repeat(None, n)
        return zip(keys, values, strict=True)

    def _abort_own(self, producer: Any) -> None:
        """Undo this process's open transaction; a fatal producer is simply dropped (the
        next init of the transactional.id, or the broker's timeout, aborts it)."""
        with contextlib.suppress(Exception):  # best effort: the refusal carries the cause
            producer.abort_transaction(self.connect_timeout_s)

    def _discard(self, producer: Any) -> None:
        """Close a producer without hanging. ``Producer.close()`` aborts an open
        transaction first and waits for that abort without a bound, forever on a broker
        that drops a fenced producer's requests (tansu). So abort within
        ``connect_timeout_s`` first; only a producer left with no transaction is closed,
        any other is just dropped (librdkafka's destructor does not wait; the broker, or
        the next ``init_transactions`` of the transactional.id, aborts what it held)."""
        from confluent_kafka import KafkaError

        try:
            producer.abort_transaction(self.connect_timeout_s)
        except Exception as exc:
            err = kafka_error(exc)
            if err is None or err.code() != KafkaError._STATE:  # _STATE: no transaction
                return
        producer.close()

    # -- commit / abort ------------------------------------------------------------------
    def commit(self, branch: BranchRef, handle: Handle | None) -> None:
        """``commit_transaction`` by the producer that prepared; ambiguous errors retried.
        Staged: the copy in one transaction with the marker (:mod:`.staged`)."""
        if staged.is_staged(self, handle):
            return staged.commit(self, branch, handle)
        self._check_branch(branch)
        with self._lock:
            prepared = self._prepared.get(branch)
        if prepared is None or prepared.producer is None:
            if handle is not None and handle.get("already_committed") == "yes":
                return  # a redo found it committed: nothing was written
            if self.voted_status(branch, handle) is BranchStatus.COMMITTED:
                return
            raise ParticipantError(
                f"{self.describe()}: kafka branch {branch.branch_id} of batch "
                f"{branch.batch_id} cannot be committed from another process: it must be "
                "redone (prepare again and commit under the existing COMMIT decision)"
            )
        producer = prepared.producer
        deadline = time.monotonic() + self.commit_retry_s
        attempts = 0
        while True:
            attempts += 1
            try:
                producer.commit_transaction(self.connect_timeout_s)
                break
            except Exception as exc:
                err = kafka_error(exc)
                if err is None:
                    raise
                action = classify_commit_error(err)
                if action == "retry" and time.monotonic() < deadline:
                    time.sleep(min(0.1 * attempts, 2.0))
                    continue
                if action == "retry":
                    # Still in doubt: keep the producer so a later commit() resumes it.
                    raise ParticipantError(
                        f"{self.describe()}: commit of branch {branch.branch_id} batch "
                        f"{branch.batch_id} still in doubt after {attempts} attempts: "
                        f"{describe_error(exc)}; call commit again"
                    ) from exc
                with self._lock:
                    self._prepared.pop(branch, None)
                raise ParticipantError(
                    f"{self.describe()}: commit of branch {branch.branch_id} batch "
                    f"{branch.batch_id} failed and was not aborted: {describe_error(exc)}; "
                    "the branch must be redone under the COMMIT decision"
                ) from exc
        with self._lock:
            self._prepared.pop(branch, None)
        self._release(branch, producer)  # committed: healthy, serves the next batch

    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        """Abort in-process; otherwise fence the transactional.id (aborts a zombie's open
        transaction). Fencing aborts *any* open transaction of this (sink, participant,
        partition): call it only when no newer attempt is preparing that branch."""
        if staged.is_staged(self, handle):
            return staged.abort(self, branch, handle)
        self._check_branch(branch)
        with self._lock:
            prepared = self._prepared.pop(branch, None)
        if prepared is not None and prepared.producer is not None:
            try:
                prepared.producer.abort_transaction(self.connect_timeout_s)
                self._release(branch, prepared.producer)  # aborted: serves the next batch
                return
            except Exception as exc:
                err = kafka_error(exc)
                if err is not None and err.fatal():
                    # Fenced: a newer producer of this transactional.id already aborted our
                    # transaction. Fencing again here would abort *its* open transaction.
                    return
                else:
                    raise ParticipantError(
                        f"{self.describe()}: abort of branch {branch.branch_id} failed: "
                        f"{describe_error(exc)}"
                    ) from exc
        if handle is not None and handle.get("already_committed") == "yes":
            return
        PRODUCERS.drop(self._cache_key(branch))  # about to be fenced by the init below
        try:
            producer = self._new_producer(branch)
        except PrepareRefused as exc:
            raise ParticipantError(str(exc)) from exc
        self._release(branch, producer)  # freshly initialised: serves the next batch

    # -- status ---------------------------------------------------------------------------
    def status(self, branch: BranchRef) -> BranchStatus:
        """COMMITTED from the marker; PREPARED when this object holds the branch's open
        transaction; else ABSENT. The marker is read first without waiting on open
        transactions (on Kafka a stable read blocks while one is open, even this
        object's own), then, not found, stably for up to 5 s: a transaction whose
        commit is being completed shows within moments, an open one stays absent."""
        from confluent_kafka import Consumer

        self._check_branch(branch)
        group = self.marker_group(branch)
        loose = Consumer({**self._marker_config(group), "isolation.level": "read_uncommitted"})
        try:
            if self._committed_marker(loose, branch) >= branch.batch_id + 1:
                return BranchStatus.COMMITTED
        finally:
            loose.close()
        with self._lock:
            prepared = self._prepared.get(branch)
        if prepared is not None and prepared.producer is not None:
            return BranchStatus.PREPARED
        consumer = self._marker_consumer(group)
        ok = False
        try:
            committed = self._committed_marker(
                consumer, branch, pending_wait_s=min(5.0, self.connect_timeout_s))
            ok = True
        finally:
            self._marker_done(group, consumer, ok)
        return BranchStatus.COMMITTED if committed >= branch.batch_id + 1 \
            else BranchStatus.ABSENT

    def voted_status(self, branch: BranchRef, voted: Handle | None) -> BranchStatus:
        """:meth:`status`, and when the marker reads absent for a branch that voted with
        rows, the partition logs from the voted offsets: tansu can leave a committed
        transaction's offset marker unapplied, even for good (see docs/kafka.md)."""
        found = self.status(branch)
        if (found is BranchStatus.ABSENT and voted is not None and voted.get("offsets")
                and self._committed_in_log(branch, voted, wait=False)):
            return BranchStatus.COMMITTED
        return found

    def in_doubt(self, sink: str) -> list[BranchRef]:
        """In-process prepared branches only: Kafka does not list another instance's open
        transactions; those are aborted when the next instance of the transactional.id
        runs ``init_transactions``, and by the broker's transaction timeout at the latest."""
        with self._lock:
            return sorted(
                b for b, p in self._prepared.items() if b.sink == sink and p.producer is not None
            )

    def open_transactions(self, sink: str) -> list[OpenTransaction]:
        """This participant's transactions of ``sink`` still open on the brokers (any
        process's), oldest first, with their age: what stalls ``read_committed`` readers
        after a crash (:mod:`~twophase.sinks.kafka.lingering`)."""
        return list_open_transactions(self.describe(), self._common_config(),
                                      f"twophase.{sink}.{self.name}.", self.connect_timeout_s)

    def open_on_target(self, sink: str) -> TargetBacklog:
        """The sink's open transactions on the brokers (a crash's stall every
        ``read_committed`` reader of their partitions) and, per partition of the topic,
        the records past its last stable offset."""
        txns = self.open_transactions(sink)
        return TargetBacklog(len(txns), max((t.age_s for t in txns), default=0.0),
                             unstable_records(self._common_config(), self.topic,
                                              timeout=self.connect_timeout_s))

    def abort_lingering(self, sink: str, older_than_s: float = 0.0,
                        keep: Iterable[str] = ()) -> list[OpenTransaction]:
        """Abort this participant's open transactions of ``sink`` that no branch of this
        object holds, not in ``keep`` (transactional ids) and at least ``older_than_s``
        old, by fencing their transactional.id (the broker writes the ABORT markers).
        Returns those aborted."""
        with self._lock:
            held = {self.transactional_id(b) for b, p in self._prepared.items()
                    if p.producer is not None} | set(keep) | staged.POOL.busy()
        found = [t for t in self.open_transactions(sink)
                 if t.transactional_id not in held and t.age_s >= older_than_s]
        for txn in found:
            head, number = txn.transactional_id.rsplit(".", 1)
            if head.endswith("." + COMMIT_LANE.rstrip(".")):  # a staged copy's lane
                staged.fence_lane(self, txn.transactional_id)
                continue
            ref = BranchRef(sink, "lingering", 0, 0, self.name, int(number))
            PRODUCERS.drop(self._cache_key(ref))  # about to be fenced by the init below
            try:
                self._new_producer(ref).close()  # init_transactions aborts it
            except PrepareRefused as exc:
                raise ParticipantError(str(exc)) from exc
        return found

    def abort_lingering_at_start(self, sink: str, decisions: Listing) -> list[OpenTransaction]:
        """The sink's start-up cleanup (the driver calls it before the first batch):
        :meth:`abort_lingering`, sparing the COMMIT-decided batches' transactions."""
        return self.abort_lingering(sink, keep=committing_ids(
            decisions, sink, self.name, self.transactional_id))

    def read_back(
        self, column: str, *, outcomes: Mapping[tuple[int, int], bool] | None = None
    ) -> ReadBack:
        """The topic's committed rows rebuilt from its partition logs (COMMIT/ABORT
        markers, :mod:`~twophase.sinks.kafka.log`), cross-checked with a
        ``read_committed`` consumer when nothing is left open (see :func:`judge_log`),
        except on the test brokers' tansu, whose ``read_committed`` view is not Kafka's.

        ``outcomes``: the suite's tansu's own record of its transactions ((producer id,
        epoch) -> commit decided), read from its storage by a test that crashed it
        (``LocalTansu.transaction_outcomes``); only there, an open transaction whose
        marker the crash lost is settled by it (:func:`settle_lost_markers`) and named
        in the note. Refused on any other broker."""
        log = read_log(self.config, self.topic,
                       settle_s=None if outcomes is None else 5.0)
        consumer: list[Any] | None = None
        if outcomes is not None and log.cluster_id != TEST_BROKER_CLUSTER_ID:
            raise ParticipantError(
                f"{self.describe()}: transaction outcomes from the broker's storage are "
                f"only used on the test suite's tansu (cluster id {TEST_BROKER_CLUSTER_ID!r}),"
                f" not on cluster {log.cluster_id!r}"
            )
        lost: list[LostMarker] = []
        if outcomes is not None:
            log, lost = settle_lost_markers(log, outcomes)
        if log.cluster_id == TEST_BROKER_CLUSTER_ID:
            back = judge_log(log, column, None, value_column=self.value)
            note = back.note + (
                "; no read_committed cross-check on tansu (its read_committed view is "
                "not Kafka's: docs/kafka.md)")
            if lost:
                txns = len({(x.producer_id, x.producer_epoch) for x in lost})
                note += (f"; {txns} transaction(s) whose markers tansu lost when it was "
                         f"killed ({len(lost)} partition(s)), settled by its stored "
                         "transaction state: "
                         + "; ".join(x.describe() for x in lost))
            return dataclasses.replace(back, note=note)
        if not log.open_transactions:
            consumer = read_topic(self.config, self.topic, column, value_column=self.value)
        return judge_log(log, column, consumer, value_column=self.value)

    def close(self) -> None:
        """Drop producers; open transactions are aborted by librdkafka on close."""
        with self._lock:
            prepared, self._prepared = list(self._prepared.values()), {}
        for p in prepared:
            if p.producer is not None:
                self._discard(p.producer)

    def describe(self) -> str:
        return f"kafka participant {self.name!r} (topic {self.topic!r})"

    @staticmethod
    def _secret_key(key: str) -> bool:
        k = key.lower()
        return any(w in k for w in ("password", "secret", "sasl.oauthbearer.config", "key.pem"))

    def descriptor(self) -> Descriptor:
        """Topic and settings; secret settings (passwords, keys) are left out and named in
        ``secrets``: rebuilt from ``TWOPHASE_SECRET_<NAME>_<KEY>``."""
        options: dict[str, Any] = {
            "topic": self.topic, "key": self.key, "value": self.value,
            "keys": json.dumps(list(self.keys)) if len(self.keys) > 1 else None,
            "transaction_timeout_ms": self.transaction_timeout_ms,
            "connect_timeout_s": self.connect_timeout_s, "commit_retry_s": self.commit_retry_s,
            "reuse_clients": self.reuse_clients, "prepare": self.prepare_mode,
            "staging_topic": self.staging_topic,
        }
        secrets = []
        for k, v in self.config.items():
            if self._secret_key(k):
                secrets.append(k)
            else:
                options[f"config.{k}"] = v if isinstance(v, (str, int, float, bool)) else str(v)
        options["secrets"] = ",".join(secrets)
        return {"kind": self.kind, "name": self.name, "target": f"topic {self.topic}",
                "options": options}

    @classmethod
    def from_descriptor(
        cls, descriptor: Descriptor, secrets: Mapping[str, str]
    ) -> KafkaParticipant:
        o = descriptor["options"]
        name = descriptor["name"]
        config: dict[str, Any] = {
            k[len("config."):]: v for k, v in o.items() if k.startswith("config.")
        }
        for k in str(o.get("secrets") or "").split(","):
            if k:
                config[k] = required_secret(name, secrets, k)
        return cls(
            str(o["topic"]), config,
            key=json.loads(str(o["keys"])) if o.get("keys") else o.get("key"),
            value=o.get("value"), name=name,
            transaction_timeout_ms=int(o.get("transaction_timeout_ms", 600_000)),
            connect_timeout_s=float(o.get("connect_timeout_s", 30.0)),
            commit_retry_s=float(o.get("commit_retry_s", 120.0)),
            reuse_clients=str(o.get("reuse_clients", False)).lower() == "true",
            prepare=str(o.get("prepare", "in_task")),
            staging_topic=o.get("staging_topic"),
        )


class _Refusal(TwophaseError):
    """Internal: a reason to vote NO that the data or the broker explains."""
