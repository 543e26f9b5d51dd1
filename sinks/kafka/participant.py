"""Kafka participant: a transactional producer per branch, committed offsets as the marker.

Two prepares (``prepare=``): "resumable" (the default, :mod:`.resumable`: the branch
written once in its task's own transaction, left open and committed by the driver with
``EndTxn``; durable until the transaction timeout, no barrier stage) and "staged"
(:mod:`.staged`: records staged in the task, copied with the marker in one transaction
by the driver). "in_task" was retired in 0.4 (:mod:`.legacy` ends a branch it voted
before the upgrade). This module is the participant contract and its options; the paths
live in their modules, with what they share: the marker (:mod:`.marker`), the records
(:mod:`.records`), the branch's producer and its reuse (:mod:`.producers`), the options'
rules (:mod:`.options`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import pyarrow as pa

from twophase.client.wire import MAX_TEXT
from twophase.errors import InvalidRequest
from twophase.participant import (
    BranchRef,
    BranchStatus,
    Descriptor,
    Handle,
    LeftOpen,
    Participant,
    ParticipantError,
    PrepareRefused,
    ReadBack,
    Rebuildable,
    SinkDecisions,
    TargetBacklog,
    Verifiable,
)
from twophase.protocol import TxnKey
from twophase.sinks.kafka import lanes, legacy, options, records, resumable, staged
from twophase.sinks.kafka.admin import (
    check_topic,
    probe_topic,
    probe_transactional_write,
    unstable_records,
)
from twophase.sinks.kafka.brokerconn import unsupported
from twophase.sinks.kafka.clients import MARKER_CONSUMERS, PRODUCERS
from twophase.sinks.kafka.config import (
    DEFAULT_MAX_MESSAGE_BYTES,
    RECONNECT_BACKOFF_MS,
    TEST_BROKER_CLUSTER_ID,
    common_config,
    validate_config,
    validate_topic,
)
from twophase.sinks.kafka.lingering import (
    COMMIT_LANE,
    OpenTransaction,
    committing_ids,
    list_open_transactions,
)
from twophase.sinks.kafka.log import LostMarker, judge_log, read_log, settle_lost_markers
from twophase.sinks.kafka.marker import committed_marker, held_consumer, read_marker_now
from twophase.sinks.kafka.producers import cache_key, new_producer
from twophase.sinks.kafka.readback import read_topic

__all__ = ["MARKER_CONSUMERS", "PRODUCERS", "KafkaParticipant"]

MARKERS_SETTLE_S: Final = 3.0
"""How long ``read_back`` reads again while a transaction shows open: the broker writes
a committed transaction's markers just after answering the commit."""


class KafkaParticipant(Participant, Rebuildable, Verifiable):
    """One Kafka topic. Values are the row as JSON unless ``value=`` names a column."""

    kind = "kafka"
    headers = staticmethod(records.headers)

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
        super().__init__(options.default_name(topic) if name is None else name)
        self.config = validate_config(config)
        self.value = options.check_value(value)
        self.keys = options.key_columns(key)
        """Key columns: one column's value is the key as is; several make a JSON object."""
        self.key = self.keys[0] if len(self.keys) == 1 else None
        options.check_timeouts(transaction_timeout_ms, connect_timeout_s, commit_retry_s)
        self.transaction_timeout_ms = transaction_timeout_ms
        self.connect_timeout_s = float(connect_timeout_s)
        self.commit_retry_s = float(commit_retry_s)
        self.reuse_clients = options.check_flag("reuse_clients", reuse_clients)
        """Keep producers and marker consumers for the next batch in this process
        (:mod:`.producers`). Off by default: in the suite's tansu-restart test a reused
        producer blocked in ``send_offsets_to_transaction`` past its timeout after the
        broker came back (docs/kafka.md)."""
        self.prepare_mode = options.check_prepare(prepare)
        """"resumable" (written once, committed by the driver: :mod:`.resumable`),
        or "staged" (copied by the driver: :mod:`.staged`)."""
        self.staging_topic = (validate_topic(staging_topic) if staging_topic is not None
                              else staged.default_staging_topic(self.topic))
        self.staging_partitions = 0  # learnt by check() on the driver (staged)
        self.probe_write = options.check_flag("probe_write", probe_write)
        """:meth:`probe` checks a transactional write too (ACLs), not only the topic."""
        # Learnt by check() on the driver and pickled to the executors with the object.
        self.broker_max_message_bytes: int | None = None
        self.sweep_admin: Any = None  # the driver's admin client for the losers' sweep

    # -- pickling: producers live in one process only ---------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["sweep_admin"] = None
        return state

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
        cfg: dict[str, object] = {"reconnect.backoff.ms": RECONNECT_BACKOFF_MS, **self.config}
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
        with the broker's maximum and the key/value columns with the schema; resumable:
        the broker answers ``DescribeTransactions`` (:func:`.resumable.check_broker`)."""
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
        if self.prepare_mode == "staged":
            self.staging_partitions = staged.check(self)
        elif self.prepare_mode == "resumable":
            resumable.check_broker(self)

    def probe(self) -> None:
        """The brokers answer this process with these settings, and the topic, when it
        exists already, is readable by this principal with at least one partition (run on
        the driver and on every executor; :meth:`check` creates a missing topic). With
        ``probe_write`` (the default) also a transactional write: ``init_transactions``
        on ``twophase.probe.<name>`` and the topics' Write/Read/Describe ACLs as the broker
        reports them (no record is written)."""
        staging = self.prepare_mode == "staged"
        for topic in (self.topic, self.staging_topic) if staging else (self.topic,):
            probe_topic(self.describe(), self._common_config(), topic,
                        timeout=self.connect_timeout_s)
        if self.probe_write:
            needs = {self.topic: ("WRITE", "READ", "DESCRIBE")}
            if staging:
                needs[self.staging_topic] = ("WRITE", "READ", "DESCRIBE")
            tid = f"twophase.probe.{self.name}"
            probe_transactional_write(
                self.describe(), self.producer_config(tid), needs,
                "--allow-principal User:<you> --operation Write --operation Describe "
                "--transactional-id twophase. --resource-pattern-type prefixed",
                timeout=self.connect_timeout_s)

    def _check_columns(self, schema: pa.Schema) -> None:
        records.check_columns(self, schema)

    def check_vote_window(self, vote_timeout: float) -> None:
        """A transaction must outlive the vote window, or the broker aborts it while the
        other branches are still preparing. Staged: none is open while voting."""
        if self.prepare_mode == "staged":
            return
        timeout_ms = self.transaction_timeout_ms
        if timeout_ms / 1000 <= vote_timeout + 60:
            raise InvalidRequest(
                f"{self.describe()}: transaction_timeout_ms={timeout_ms} must exceed the "
                f"sink's vote window (vote_timeout {vote_timeout:.0f}s + 60s); raise it "
                "(within the broker's transaction.max.timeout.ms) or lower vote_timeout"
            )

    # -- prepare, commit, abort: one path per prepare mode --------------------------------
    def prepare(
        self, branch: BranchRef, schema: pa.Schema, batches: Iterable[pa.RecordBatch]
    ) -> Handle:
        """Resumable: write the rows and the marker in one open transaction, flushed, not
        committed (:mod:`.resumable`: committed by the driver from the vote); staged:
        write them to the staging topic (:mod:`.staged`)."""
        if self.prepare_mode == "resumable":
            return resumable.prepare(self, branch, schema, batches)
        return staged.prepare(self, branch, schema, batches)

    def redo(
        self,
        branch: BranchRef,
        schema: pa.Schema,
        batches: Iterable[pa.RecordBatch],
        voted: Handle | None,
    ) -> Handle:
        """Prepare again under a COMMIT decision (the marker is checked first): a branch
        voted by the retired in-task prepare is redone in the current mode, unless its
        marker or its log shows it committed (:func:`.legacy.voted_status`)."""
        if (legacy.is_in_task(voted) and voted is not None
                and legacy.voted_status(self, branch, voted) is BranchStatus.COMMITTED):
            return {**self._handle(branch, 0, already=True), "prepare": self.prepare_mode}
        return self.prepare(branch, schema, batches)

    def log_readable(self) -> bool:
        """The partition-log reader can connect with these settings: plaintext, TLS, SASL
        PLAIN or SCRAM (not GSSAPI or OAUTHBEARER, :mod:`.brokerconn`)."""
        return unsupported(self.config) is None

    def commit(self, branch: BranchRef, handle: Handle | None) -> None:
        """``commit_transaction`` by the producer that prepared; ambiguous errors retried.
        Staged: the copy in one transaction with the marker (:mod:`.staged`); resumable:
        ``EndTxn(commit)`` from the handle (:func:`.resumable.commit`)."""
        if resumable.is_resumable(handle):
            assert handle is not None
            return resumable.commit(self, branch, handle)
        if legacy.is_in_task(handle):
            assert handle is not None
            return legacy.commit(self, branch, handle)
        return staged.commit(self, branch, handle)

    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        """Staged: nothing to undo; a branch voted by the retired in-task prepare: fence
        its transactional.id (:func:`.legacy.abort`); resumable: ``EndTxn(abort)`` from
        the handle (without one, whatever is open on the branch's pool ids,
        :func:`.resumable.abort_unvoted`)."""
        if resumable.is_resumable(handle):
            assert handle is not None
            return resumable.abort(self, branch, handle)
        if self.prepare_mode == "resumable" and handle is None:
            return resumable.abort_unvoted(self, branch)
        if legacy.is_in_task(handle):
            assert handle is not None
            return legacy.abort(self, branch, handle)
        return staged.abort(self, branch, handle)

    # -- status ---------------------------------------------------------------------------
    def status(self, branch: BranchRef) -> BranchStatus:
        """COMMITTED from the marker, else ABSENT (no prepared branch is held in this
        object: the vote's handle names it, :meth:`voted_status`). The marker is read
        first without waiting on open transactions (on Kafka a stable read blocks while one is
        open, even this
        object's own), then, not found, stably for up to 5 s: a transaction whose
        commit is being completed shows within moments, an open one stays absent."""
        self._check_branch(branch)
        if read_marker_now(self, branch) >= branch.batch_id + 1:
            return BranchStatus.COMMITTED
        with held_consumer(self, branch) as consumer:
            committed = committed_marker(
                self, consumer, branch, pending_wait_s=min(5.0, self.connect_timeout_s))
        return BranchStatus.COMMITTED if committed >= branch.batch_id + 1 \
            else BranchStatus.ABSENT

    def voted_status(self, branch: BranchRef, voted: Handle | None) -> BranchStatus:
        """:meth:`status`, and when the marker reads absent for a branch that voted with
        rows, the partition logs from the voted offsets: tansu can leave a committed
        transaction's offset marker unapplied, even for good (see docs/kafka.md).
        A staged branch: :func:`.staged.voted_status` (PREPARED while its staged records
        are there to be copied)."""
        if resumable.is_resumable(voted):
            assert voted is not None
            return resumable.voted_status(self, branch, voted)
        if staged.is_staged(self, voted):
            assert voted is not None
            return staged.voted_status(self, branch, voted)
        if legacy.is_in_task(voted):
            assert voted is not None
            return legacy.voted_status(self, branch, voted)
        return self.status(branch)

    def in_doubt(self, sink: str) -> list[BranchRef]:
        """None: no prepared branch is held in a process (a resumable or staged branch is
        named by its vote's handle); what a dead process left open on the brokers is
        :meth:`open_transactions`, aborted by :meth:`abort_lingering`."""
        return []

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
                        keep: Iterable[str] = (), before: float | None = None
                        ) -> list[OpenTransaction]:
        """Abort this participant's open transactions of ``sink`` not in ``keep``
        (transactional ids), at least ``older_than_s`` old and begun before ``before`` (epoch
        seconds) when given: a resumable pool id's by
        ``EndTxn(abort)`` for the producer id and epoch the broker shows, any other by
        fencing its transactional.id (the broker writes the ABORT markers).
        Returns those aborted."""
        if before is not None:
            older_than_s = max(older_than_s, time.time() - before)
        held = set(keep) | lanes.copying()
        found = [t for t in self.open_transactions(sink)
                 if t.transactional_id not in held and t.age_s >= older_than_s]
        prefix = f"twophase.{sink}.{self.name}."
        for txn in found:
            head, number = txn.transactional_id.rsplit(".", 1)
            if txn.transactional_id[len(prefix):].startswith("w"):  # a resumable pool id
                resumable.abort(self, BranchRef(sink, "lingering", 0, 0, self.name, 0), {
                    "transactional_id": txn.transactional_id,
                    "producer_id": str(txn.producer_id),
                    "producer_epoch": str(txn.producer_epoch)})
                continue
            if head.endswith("." + COMMIT_LANE.rstrip(".")):  # a staged copy's lane
                lanes.fence_lane(self, txn.transactional_id)
                continue
            ref = BranchRef(sink, "lingering", 0, 0, self.name, int(number))
            PRODUCERS.drop(cache_key(self, ref))  # about to be fenced by the init below
            try:
                new_producer(self, ref).close()  # init_transactions aborts it
            except PrepareRefused as exc:
                raise ParticipantError(str(exc)) from exc
        return found

    def end_other_attempts(self, key: TxnKey, kept: Mapping[int, Handle]) -> int:
        """Resumable: abort what other attempts of the batch's branches left open on the
        sink's pool ids (:func:`.resumable.abort_other_attempts`), so ``read_committed``
        readers do not wait for the transaction timeout. Staged: nothing."""
        if self.prepare_mode != "resumable":
            return 0
        return resumable.abort_other_attempts(self, key.sink, kept.values())

    def clear_left_open(self, sink: str, decisions: SinkDecisions) -> list[LeftOpen]:
        """The sink's start-up clean-up (the driver calls it before the first batch):
        :meth:`abort_lingering`, sparing the COMMIT-decided batches' transactions."""
        cleared = self.abort_lingering(sink, keep=committing_ids(
            decisions, sink, self.name, self.transactional_id))
        return [LeftOpen(t.transactional_id, t.age_s,
                         tuple(tp for tp in t.partitions if not tp.startswith("__")))
                for t in cleared]  # not __consumer_offsets: no reader waits there

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
        # Kafka answers a commit once its decision is logged and writes the partitions'
        # markers after: a read right after a commit can see it open for a moment
        settle = time.monotonic() + MARKERS_SETTLE_S
        while log.open_transactions and time.monotonic() < settle:
            time.sleep(0.2)
            log = read_log(self.config, self.topic)
        if not log.open_transactions:
            consumer = read_topic(self.config, self.topic, column, value_column=self.value)
        return judge_log(log, column, consumer, value_column=self.value)

    def close(self) -> None:
        """Drop producers; open transactions are aborted by librdkafka on close."""
        admin, self.sweep_admin = self.sweep_admin, None
        if admin is not None:
            with contextlib.suppress(Exception):
                admin.close()

    def describe(self) -> str:
        return f"kafka participant {self.name!r} (topic {self.topic!r})"

    def prune_markers(self, sink: str, lineage: str, below: int) -> int:
        """Staged: delete the staging topic's leading records of ``sink``'s committed
        batches below ``below`` (:mod:`.stagedprune`: only records read and found done).
        The marker groups stay (deleting groups needs DeleteGroups).
        Resumable: abort the sink's transactions a losing attempt left open (a
        speculative or retried copy whose vote never counted), started before this call
        (:meth:`abort_lingering`): every batch before this one has ended its own."""
        if self.prepare_mode == "resumable":
            self.abort_lingering(sink, before=time.time() - resumable.CLOCK_MARGIN_S)
            return 0
        from twophase.sinks.kafka.stagedprune import prune_staged

        return prune_staged(self, sink, lineage, below)

    def descriptor(self) -> Descriptor:
        """Topic and settings; secrets left out and named (:func:`.options.descriptor_options`)."""
        return {"kind": self.kind, "name": self.name, "target": f"topic {self.topic}",
                "options": options.descriptor_options(self)}

    @classmethod
    def from_descriptor(
        cls, descriptor: Descriptor, secrets: Mapping[str, str]
    ) -> KafkaParticipant:
        topic, config, kwargs = options.constructor_args(descriptor, secrets)
        return cls(topic, config, **kwargs)
