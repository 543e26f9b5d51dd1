"""``TransactionalSink``: the callable you hand to ``df.writeStream.foreachBatch``.

Per micro-batch (see ARCHITECTURE.md for the picture):

1. ``begin`` with the coordinator, keyed by (sink, lineage, batch id);
2. split the batch into P partitions the same way on every replay (P is stored with the
   first attempt): as Spark read it when the batch's plan is a single source scan with
   only narrow steps (the split is then fixed by the batch's offsets: no shuffle), else by
   a stable hash of every column. A batch known to be empty before any job runs is
   voted and acknowledged by the driver alone (no Spark job);
3. prepare: one ordinary task per partition (``mapInArrow``) prepares every
   participant's branch, votes naming its Spark task attempt, and ends; data goes from
   the executors to the systems, never through the driver. A sink with an in-task
   participant (Kafka, whose transaction dies with its producer) runs one barrier stage
   instead, each task waiting for the decision and applying it (ARCHITECTURE.md);
4. decide and commit: after the job the coordinator's record holds the decision (an
   undecided attempt is abandoned: ABORT), and the driver applies it to every branch
   that voted YES (``twophase.commit``), tables once per batch;
5. return only when the coordinator shows the attempt COMMITTED. An aborted attempt is
   retried in place with backoff, a bounded number of times, then the query fails with
   the participant, partition and cause.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from twophase import failpoints
from twophase.commit import Committer, commit_batches
from twophase.connection import check_coordinator
from twophase.decide import decide, votes_of
from twophase.errors import BatchFailed, InvalidRequest, TwophaseError, headline
from twophase.names import LINEAGE_RULE, validate_lineage, validate_name
from twophase.participant import (
    EMPTY_BRANCH,
    Participant,
    descriptor_of,
    is_empty_branch,
)
from twophase.protocol import (
    BeginKind,
    Decision,
    StepKind,
    TxnKey,
    next_step,
)
from twophase.task import (
    INPUT_SPLIT,
    PLAN_PROPERTY,
    PREPARE,
    BatchPlan,
    plan_from_property,
    plan_property,
    redone_handles,
    relay_acks,
    run_partition,
    split_of,
)
from twophase.wire import VoteIn

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from twophase.client import CoordinatorClient
    from twophase.connection import Connection
    from twophase.protocol import Transaction

__all__ = ["BatchFailed", "BatchReport", "TransactionalSink"]

log = logging.getLogger("twophase.sink")

QUERY_ID_PROPERTY = "sql.streaming.queryId"  # set by Spark on the stream execution thread

_REPORT_SCHEMA = (
    "partition long, rows long, decision string, recovered long, redone long, "
    "prepare_s double, wait_s double, commit_s double, vote_s double, task_s double, "
    "error string, acks string, "
    "redone_handles string, votes string"
)


@dataclass
class BatchReport:
    """What happened to one micro-batch (shown by the demo, kept in ``sink.history``)."""

    batch_id: int
    outcome: str  # "committed", "replay", "recovered"
    attempts: int
    rows: int = 0
    partitions: int = 0
    recovered: int = 0
    redone: int = 0
    seconds: float = 0.0
    # seconds per phase, measured: the driver's (frame_s: the job's DataFrame; split_s:
    # its planning and its split read; setup_s: coordinator, preflight, checks;
    # begin_s; settle_s: an empty relation's votes and acks; plan_s; job_s: the Spark
    # job; decide_s: the tasks' votes sent; driver_commit_s: the decision applied from
    # the driver; in-task path: relay_s: the tasks' acks; batch_commit_s;
    # driver_s: the rest) and the tasks' (prepare_s, vote_s, wait_s, commit_s, task_s:
    # the slowest task's), so job_s - task_s is Spark's own share of the job
    phases: dict[str, float] = field(default_factory=dict)
    split: str = ""  # "input" (as Spark read it), "hash", or "none" (empty: no job ran)
    sink: str = ""
    txn: str = ""  # sink/lineage/batch/attempt of the deciding attempt ("" for a replay)
    decision: str = ""  # COMMIT for a committed batch; "" for a replay

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (a streaming listener's event, a log record's fields)."""
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}


class TransactionalSink:
    """Exactly-once ``foreachBatch`` sink over several participants.

    ``coordinator`` is a store URL (``sqlite:///path.db``, ``postgresql://...``: an
    embedded coordinator starts in this driver) or a daemon URL (``http(s)://host:port``,
    token from ``token=`` or ``TWOPHASE_TOKEN``).

    Before its first batch the sink checks the executors (``preflight=False`` skips it;
    :mod:`twophase.preflight`); ``retry_budget_s`` is how long the driver and the tasks
    ride through an unreachable coordinator (a URL nobody answers at fails within
    seconds at the first call). Logs go to the ``twophase.sink`` logger: INFO per
    committed batch, WARNING for replayed, recovered, aborted and redone ones;
    ``on_batch`` gets each :class:`BatchReport`.

    On a cluster the embedded coordinator listens on the driver's
    ``spark.driver.bindAddress`` and the tasks reach it at ``spark.driver.host``
    (``coordinator_host=`` overrides both; ``coordinator_tls=(certfile, keyfile)`` serves
    it over HTTPS). A sink with an in-task participant (Kafka) runs each batch as a
    barrier stage: before anything is written it needs as many task slots as partitions
    (waiting up to ``cluster_wait`` seconds for executors to register) and no dynamic
    allocation; other sinks run on any cluster shape (docs/cluster.md).
    """

    def __init__(
        self,
        name: str,
        participants: Sequence[Participant],
        coordinator: str,
        *,
        token: str | None = None,
        partitions: int | None = None,
        max_attempts: int = 3,
        backoff: float = 1.0,
        vote_timeout: float = 300.0,
        lineage: str | None = None,
        on_batch: Callable[[BatchReport], None] | None = None,
        coordinator_host: str | None = None,
        coordinator_tls: tuple[str, str] | None = None,
        cluster_wait: float = 60.0,
        json_logs: bool = False,
        retry_budget_s: float = 120.0,
        preflight: bool = True,
    ) -> None:
        self.name = validate_name("sink name", name)
        if lineage is None and _spark_connect_client():
            raise InvalidRequest(
                f"sink {name!r}: under Spark Connect foreachBatch runs in a server-side "
                "Python process that cannot see the streaming query's id; pass "
                f"lineage='<{LINEAGE_RULE}>' naming this query's checkpoint "
                "(a new checkpoint location needs a new lineage; docs/cluster.md)"
            )
        if not participants:
            raise InvalidRequest("a TransactionalSink needs at least one participant")
        names = [p.name for p in participants]
        if len(set(names)) != len(names):
            raise InvalidRequest(
                f"participant names must be unique within sink {name!r}, got {names}; "
                "pass name=... to tell two participants of the same kind apart"
            )
        if len(participants) > MAX_PARTICIPANTS:
            raise InvalidRequest(
                f"a TransactionalSink takes at most {MAX_PARTICIPANTS} participants, got "
                f"{len(participants)}: split the output over several sinks"
            )
        _bounded_int("partitions", partitions, 1, MAX_PARTITIONS, optional=True)
        _bounded_int("max_attempts", max_attempts, 1, 1000)
        _bounded_float("backoff", backoff, 0.0, 3600.0, "seconds between attempts")
        _bounded_float("vote_timeout", vote_timeout, 0.001, MAX_VOTE_TIMEOUT,
                       "seconds the coordinator waits for every vote")
        if not retry_budget_s > 0:
            raise InvalidRequest(f"retry_budget_s must be > 0 seconds, got {retry_budget_s}")
        self.participants = tuple(participants)
        # A participant whose prepared branch dies with its process (Kafka's in-task
        # transaction) needs every task alive until the decision: one barrier stage.
        # Otherwise tasks prepare and end, and the driver commits after the job.
        self.gang = any(not p.durable_prepare for p in self.participants)
        self.split_columns, single = _split_rule(self.participants)
        self.one_branch = single  # participants' keys or complete mode fix the split
        if single:
            if partitions not in (None, 1):
                whole = [p.describe() for p in participants if p.single_branch()]
                why = (", ".join(whole) + " writes each batch as one branch" if whole else
                       "the participants' key columns (partition_columns) share no column, "
                       "so only one branch keeps every key in one place")
                raise InvalidRequest(
                    f"sink {name!r}: partitions={partitions} but {why}; leave partitions "
                    "unset (or 1)"
                )
            partitions = 1
        self.coordinator = check_coordinator(coordinator)
        self.token = token
        self.partitions = partitions
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.vote_timeout = vote_timeout
        if lineage is not None:
            validate_lineage(lineage)
        self.lineage = lineage
        for p in participants:
            # A prepared branch must outlive the vote window (a Kafka transaction times out).
            p.check_vote_window(vote_timeout)
        self.on_batch = on_batch
        self.coordinator_host = coordinator_host
        self.coordinator_tls = coordinator_tls
        self.cluster_wait = cluster_wait
        self._slots_checked = 0
        self.retry_budget_s = float(retry_budget_s)
        self.preflight = preflight
        self._preflighted = False
        if json_logs:  # one JSON object per line on stderr, as the daemon logs
            from twophase.logs import setup_logging

            setup_logging("info")
        else:
            _default_logging()
        self._committer = Committer(self.participants)  # the driver's commits (no gang)
        self.history: list[BatchReport] = []
        self._by_batch: dict[int, BatchReport] = {}
        self._conn: Connection | None = None
        self._client: CoordinatorClient | None = None
        self._epoch: int | None = None
        self._checked_schema: Any = None
        self._schema_of: tuple[Any, Any] = (None, None)  # ((Spark schema, zone), Arrow)

    # ------------------------------------------------------------------ lifecycle
    def _connect(self, df: DataFrame | None = None) -> CoordinatorClient:
        if self._client is None:
            from twophase.connection import connect

            bind, advertise = self._coordinator_address(df)
            self._conn = connect(self.coordinator, self.token, host=bind, advertise=advertise,
                                 tls=self.coordinator_tls)
            self._client = self._conn.client(retry_budget=self.retry_budget_s)
        return self._client

    def _coordinator_address(self, df: DataFrame | None) -> tuple[str, str]:
        """Where an embedded coordinator listens and what the tasks are told: loopback
        under a ``local`` master (or with no session to ask), else the driver's own bind
        address and host."""
        if self.coordinator_host:
            return self.coordinator_host, self.coordinator_host
        if df is None:
            return "127.0.0.1", "127.0.0.1"
        conf = df.sparkSession.conf
        master = conf.get("spark.master", "local") or "local"
        if master.startswith("local"):
            return "127.0.0.1", "127.0.0.1"
        host = conf.get("spark.driver.host", None)
        if not host:
            import socket

            host = socket.gethostbyname(socket.gethostname())
        bind = conf.get("spark.driver.bindAddress", None) or host
        return bind, host

    def _check_cluster(self, df: DataFrame, partitions: int) -> None:
        """Refuse, before anything is begun or written, a batch Spark would refuse
        mid-way: barrier stages need all their tasks running at once (only a sink with
        an in-task participant runs one)."""
        if not self.gang or partitions <= self._slots_checked:
            return  # checked before (master and dynamic allocation are fixed at start)
        conf = df.sparkSession.conf
        master = conf.get("spark.master", "local") or "local"
        dyn = (conf.get("spark.dynamicAllocation.enabled", "false") or "false").lower()
        if dyn == "true" and not master.startswith("local"):
            raise InvalidRequest(
                f"sink {self.name!r}: spark.dynamicAllocation.enabled=true, but "
                f"{self._in_task()} keeps its prepared branches in-task until the "
                "decision, so the sink runs each batch as a barrier stage, which Spark "
                "does not run under dynamic allocation; start the application with "
                "--conf spark.dynamicAllocation.enabled=false and a fixed executor count "
                "(--num-executors / spark.cores.max) covering the sink's partitions"
            )
        if partitions <= self._slots_checked:
            return
        slots = _task_slots(df)
        if slots is None:  # Spark Connect: no SparkContext to ask; Spark's own check rules
            return
        deadline = time.monotonic() + self.cluster_wait
        while slots < partitions and time.monotonic() < deadline:
            time.sleep(0.5)  # executors may still be registering
            slots = _task_slots(df) or 0
        if slots < partitions:
            raise InvalidRequest(
                f"sink {self.name!r}: a batch needs {partitions} task slots at once (one "
                f"barrier task per partition, as {self._in_task()} keeps its prepared "
                f"branches in-task) but the cluster offers {slots} (waited "
                f"{self.cluster_wait:.0f}s for executors); pass partitions<={slots} to "
                "the sink, or give the application more executor cores "
                "(spark.cores.max / --num-executors x spark.executor.cores)"
            )
        self._slots_checked = partitions

    def _in_task(self) -> str:
        """The participants whose prepared branch lives only in its task (why a gang)."""
        return ", ".join(p.describe() for p in self.participants if not p.durable_prepare)

    @property
    def console_url(self) -> str | None:
        """The coordinator's web console (``/ui``), signed in (the token is in the URL's
        fragment, which browsers never send); ``None`` before the first batch connects."""
        if self._conn is None:
            return None
        from urllib.parse import quote

        if not self._conn.token:
            return f"{self._conn.url}/ui"
        return f"{self._conn.url}/ui#token={quote(self._conn.token, safe='')}"

    def report(self, batch_id: int) -> BatchReport | None:
        """The twophase outcome of micro-batch ``batch_id`` in this driver run (what a
        ``StreamingQueryListener`` looks up from ``event.progress.batchId``)."""
        return self._by_batch.get(batch_id)

    def progress_listener(
        self, callback: Callable[[Any, BatchReport | None], None]
    ) -> Any:
        """A ``pyspark.sql.streaming.StreamingQueryListener`` that calls
        ``callback(progress, report)`` for every query progress, with this sink's report
        of that batch (``None`` for a batch this sink did not write). Add it with
        ``spark.streams.addListener(sink.progress_listener(cb))``."""
        from pyspark.sql.streaming.listener import StreamingQueryListener

        sink = self

        class _Listener(StreamingQueryListener):
            def onQueryStarted(self, event: Any) -> None:
                pass

            def onQueryProgress(self, event: Any) -> None:
                progress = event.progress
                callback(progress, sink.report(int(progress.batchId)))

            def onQueryIdle(self, event: Any) -> None:
                pass

            def onQueryTerminated(self, event: Any) -> None:
                pass

        return _Listener()

    def close(self) -> None:
        """Release the coordinator connection (stops an embedded coordinator) and the
        driver's participant connections."""
        self._committer.close()
        if self._client is not None:
            self._client.close()
        if self._conn is not None:
            self._conn.close()
        self._client = self._conn = None
        self._epoch = None

    def _lineage(self, df: DataFrame) -> str:
        if self.lineage is not None:
            return self.lineage
        qid = df.sparkSession.sparkContext.getLocalProperty(QUERY_ID_PROPERTY)
        if not qid:
            raise BatchFailed(
                f"sink {self.name!r}: no streaming query id on this thread; call the sink "
                "from foreachBatch, or pass lineage=... for a batch (non-streaming) write"
            )
        return str(qid)

    # ------------------------------------------------------------------ the batch
    def __call__(self, df: DataFrame, batch_id: int) -> None:
        """Write one micro-batch exactly once (foreachBatch calls this). A failure is
        logged as one ERROR line, ``sink S batch N failed: <participant>: <cause>. Fix:
        <fix>``, and raised with that sentence as its first line, before Spark wraps it."""
        try:
            self._batch(df, batch_id)
        except TwophaseError as exc:
            first, failed = _failure(self.name, batch_id, exc)
            log.error("%s", first)
            raise failed from None
        except Exception as exc:
            log.error("sink %s batch %d failed: %s", self.name, batch_id, _short_error(exc))
            raise

    def _batch(self, df: DataFrame, batch_id: int) -> None:
        started = time.perf_counter()
        laps = _Laps(started)
        lineage = self._lineage(df)
        slots = _default_partitions(df)
        # The job's own DataFrame, planned once: its split is read from its plan, and the
        # job runs it when it keeps Spark's split (the plan travels as a local property).
        direct = self._job_frame(df)
        laps.lap("frame_s")
        n_in = _input_partitions(direct if direct is not None else df, any_split=not self.gang)
        laps.lap("split_s")
        if n_in is not None and ((self.gang and n_in > slots)
                                 or self.partitions not in (None, n_in)):
            n_in = None  # a barrier stage needs a slot per task; partitions=N asks for N
        # n_in == 0: Spark planned no partition at all, the batch has no rows
        partitions = self.partitions or (1 if n_in == 0 else n_in or slots)
        self._check_cluster(df, partitions)
        client = self._connect(df)
        if self._epoch is None:
            # One writer epoch per driver run: a restarted driver fences the old one.
            # the participants' descriptors let `twophase resolve SINK` rebuild them
            descriptors = [d for d in map(descriptor_of, self.participants) if d]
            self._epoch = client.register(self.name, descriptors)  # type: ignore[arg-type]
            log.info("sink %s: writer epoch %d, lineage %s", self.name, self._epoch, lineage)
        if not self._preflighted:
            # Once per sink start: the executors' interpreter (the driver's own in local
            # mode), then the probe job that checks it can run our tasks.
            from twophase.preflight import check_executors, choose_worker_python, probe_targets

            assert self._conn is not None
            probe_targets(self.participants)  # the driver first: no job needed to say why
            sc = _jvm_context(df)
            if sc is None:  # Spark Connect: no SparkContext to run the probe job with
                log.info("sink %s: Spark Connect, the executors' preflight is skipped",
                         self.name)
            else:
                choose_worker_python(sc)
                if self.preflight:
                    check_executors(sc, self.name, self.participants, self._conn.url,
                                    wait_s=self.retry_budget_s, session=df.sparkSession)
            self._preflighted = True
        self._check(df)
        laps.lap("setup_s")
        failpoints.hit("before_begin")
        aborted = finishing = 0
        while True:
            res = client.begin(
                self.name, lineage, batch_id, self._epoch,
                [p.name for p in self.participants], partitions, self.vote_timeout,
            )
            laps.lap("begin_s")
            if res.new_lineage:
                log.warning(
                    "sink %s: new lineage %s (checkpoint location changed): batch ids "
                    "restart here and are not taken for already-committed ones",
                    self.name, lineage,
                )
            if res.kind == BeginKind.COMMITTED:
                _run_through(df)
                self._report(BatchReport(batch_id, "replay", 0, sink=self.name, decision="COMMIT"),
                             started)
                return
            txn = res.txn
            assert txn is not None
            # an attempt stored by an earlier run keeps its partition count
            self._check_cluster(df, txn.partitions)
            if n_in == 0 and self._settle_empty(client, res.kind, txn, res.recover):
                final, outcomes, job_error = client.get(txn.key), list[dict[str, Any]](), ""
                split = "none"
                laps.lap("settle_s")
            else:
                plan = self._plan(res.kind, txn, res.recover, n_in)
                split = plan.split
                laps.lap("plan_s")
                outcomes, job_error = self._run_tasks(df, plan, direct)
                laps.lap("job_s")
                if plan.mode == PREPARE:
                    # No task waited for the decision: the driver sends every task's
                    # votes (an undecided attempt, its job failed, is abandoned), then
                    # applies the decision from here.
                    final = decide(client, txn, self._epoch, votes_of(outcomes), job_error)
                    laps.lap("decide_s")
                    final, commit_error = self._committer.apply(client, self._epoch, final)
                    laps.lap("driver_commit_s")
                else:
                    # The tasks' acks in one call (its answer is the record after them);
                    # the coordinator's record, not the job's fate, says what comes next.
                    final = (relay_acks(client, txn.key, self._epoch, outcomes)
                             or client.get(txn.key))
                    laps.lap("relay_s")
                    final, commit_error = commit_batches(client, self._epoch,
                                                         self.participants, final,
                                                         redone_handles(outcomes))
                    laps.lap("batch_commit_s")
                job_error = job_error or commit_error
            rule = partial(next_step, max_attempts=self.max_attempts, backoff=self.backoff,
                           job_error=job_error)
            step = rule(final, aborted=aborted, finishing=finishing)
            if step.kind == StepKind.ABANDON:
                final = client.abandon(final.key, self._epoch, step.reason)
                step = rule(final, aborted=aborted, finishing=finishing, abandoned=True)
            aborted, finishing = step.aborted, step.finishing
            if step.warning:
                log.warning("%s", step.warning)
            if step.kind == StepKind.RETURN:
                failpoints.hit("before_return")
                report = self._summary(batch_id, final, outcomes, res.kind)
                report.split = split
                report.phases.update(laps.taken)
                self._report(report, started)
                return
            if step.kind == StepKind.GIVE_UP:
                if final.decision == Decision.ABORT and not self.gang:
                    self._committer.sweep(final)  # nothing left prepared behind the error
                raise BatchFailed(step.reason)
            if step.delay > 0:  # FINISH or RETRY: begin again
                time.sleep(step.delay)

    def _check(self, df: DataFrame) -> None:
        """Each participant checks its target against the schema once, before writing."""
        schema = self._schema(df)
        if self._checked_schema is schema:
            return
        if self._checked_schema is not None and self._checked_schema.equals(schema):
            return
        for p in self.participants:
            p.check(schema)
        self._checked_schema = schema

    def _settle_empty(
        self, client: CoordinatorClient, kind: BeginKind, txn: Transaction,
        recover: tuple[Transaction, ...],
    ) -> bool:
        """A batch with no partitions at all (Spark planned an empty relation): vote and
        acknowledge every branch from here, one round trip each, no Spark job. Returns
        False (run the tasks) when earlier attempts or prepared branches need settling."""
        assert self._epoch is not None
        if any(t.attempt != txn.attempt for t in recover):
            return False
        if kind == BeginKind.IN_DOUBT:
            if not all(is_empty_branch(st.handle) for st in txn.branches.values()):
                return False
            decided = txn
        else:
            votes = [VoteIn(branch=b, yes=True, handle=dict(EMPTY_BRANCH))
                     for b, st in txn.branches.items() if st.vote is None]
            decided = client.vote(txn.key, self._epoch, votes) if votes else txn
        if decided.decision is None:
            return False
        acks = [(b, decided.decision) for b, st in decided.branches.items() if st.ack is None]
        if acks:
            client.ack(txn.key, self._epoch, acks)
        return True

    def _plan_template(self) -> BatchPlan:
        """What every batch's plan shares: ``_plan`` fills in the batch."""
        assert self._conn is not None and self._epoch is not None
        return BatchPlan(
            key=TxnKey(self.name, "", 0, 0),
            epoch=self._epoch,
            partitions=0,
            mode="run",
            coordinator_url=self._conn.url,
            token=self._conn.token,
            participants=self.participants,
            decision_timeout=self.vote_timeout + 60.0,
            ca_pem=self._conn.ca_pem,
            retry_budget=self.retry_budget_s,
            driver_acks=True,
        )

    def _plan(
        self, kind: BeginKind, txn: Transaction, recover: tuple[Transaction, ...],
        n_in: int | None,
    ) -> BatchPlan:
        assert self._conn is not None and self._epoch is not None
        handles = {b: dict(s.handle) for b, s in txn.branches.items() if s.handle}
        digests = {b: s.digest for b, s in txn.branches.items() if s.digest}
        # Spark's own split only where it has txn.partitions tasks; a finish redoes lost
        # branches, so it must split as the votes did (they say how).
        split = INPUT_SPLIT if n_in == txn.partitions else "hash"
        if kind == BeginKind.IN_DOUBT and any(split_of(h) != split for h in handles.values()):
            split = "hash"  # cannot split as voted: a branch needing a redo refuses it
        return dataclasses.replace(
            self._plan_template(),
            key=txn.key,
            partitions=txn.partitions,
            mode="finish" if kind == BeginKind.IN_DOUBT else "run" if self.gang else PREPARE,
            handles=handles,
            digests=digests,
            ack_earlier=tuple(t.attempt for t in recover if t.attempt != txn.attempt),
            split=split,
        )

    def _job_frame(self, df: DataFrame) -> DataFrame | None:
        """``df`` mapped by the sink's task, the plan left to a local property (see
        ``_run_tasks``), when this batch may run on Spark's own split; None before the
        first batch connected, under Spark Connect (no local properties) and when the
        sink always shuffles."""
        if (self._conn is None or self._epoch is None or self.split_columns
                or self.one_branch or _jvm_context(df) is None):
            return None
        return df.mapInArrow(self._task(None, self._schema(df)), _report_struct(),
                             barrier=self.gang)

    def _schema(self, df: DataFrame) -> Any:
        """The batch's Arrow schema. A user's foreachBatch function may reshape the batch
        (a column added from batch N on), so the schema is the batch's own, never the
        lineage's; only the conversion is reused while the Spark schema and the session's
        time zone stay the same."""
        tz = df.sparkSession.conf.get("spark.sql.session.timeZone")
        key = (df.schema, tz)
        if self._schema_of[0] != key:
            self._schema_of = (key, _arrow_schema(df, tz))
        return self._schema_of[1]

    def _task(self, fixed: BatchPlan | None, arrow_schema: Any) -> Callable[[Any], Any]:
        """The task's function. With ``fixed`` it runs that plan; without, it reads
        the batch's plan from the job's local property (``PLAN_PROPERTY``, set by
        ``_run_tasks``) over the sink's template (participants, coordinator, token: never
        in a property, which Spark's event log records)."""
        import pyarrow as pa

        template = fixed or self._plan_template()
        report_schema = pa.schema(
            [(name, pa.string() if kind == "string" else pa.float64() if kind == "double"
              else pa.int64())
             for name, kind in (f.strip().split() for f in _REPORT_SCHEMA.split(","))]
        )

        def task(batches: Any) -> Any:
            from pyspark import TaskContext

            entered = time.perf_counter()
            ctx = TaskContext.get()  # a BarrierTaskContext in a barrier stage
            assert ctx is not None, "a Spark task always has its context"
            partition = ctx.partitionId()
            # unique in the application: a retried or speculative copy has its own
            attempt = f"{ctx.stageId()}/{ctx.taskAttemptId()}"
            plan = template if fixed is not None else plan_from_property(
                template, ctx.getLocalProperty(PLAN_PROPERTY))
            it = iter(batches)
            first = next(it, None)
            before = time.perf_counter() - entered  # Spark's first rows: the task's too
            if first is None:
                out = run_partition(plan, partition, arrow_schema, iter(()), task=attempt)
            else:  # the rows stream on to the participants, never held here
                out = run_partition(plan, partition, first.schema,
                                    itertools.chain([first], it), task=attempt)
            out.task_s += before
            out.prepare_s += before
            yield pa.RecordBatch.from_pylist([out.as_dict()], schema=report_schema)

        return task

    def _run_tasks(self, df: DataFrame, plan: BatchPlan, direct: DataFrame | None = None
                   ) -> tuple[list[dict[str, Any]], str]:
        """One task per partition (a barrier stage for an in-task participant); returns
        the tasks' reports and the job error.
        ``direct`` (``_job_frame``) is run as planned when the plan keeps Spark's split."""
        sc = _jvm_context(df)
        arrow_schema = self._schema(df)
        cols = list(self.split_columns or df.columns)
        if plan.split == INPUT_SPLIT and direct is not None:
            job = direct
        else:
            if plan.split == INPUT_SPLIT and not self.split_columns and not self.one_branch:
                split = df  # Spark's split is the same on replay: no shuffle
            elif cols:
                split = df.repartition(plan.partitions, *cols)
            else:
                split = df.repartition(plan.partitions)
            job = split.mapInArrow(self._task(None if sc is not None else plan, arrow_schema),
                                   _report_struct(), barrier=self.gang)
        if sc is not None:
            sc.setLocalProperty(PLAN_PROPERTY, plan_property(plan))
        try:
            rows = job.collect()
        except Exception as exc:  # the job failed: the coordinator's record decides what next
            return [], _short_error(exc)
        finally:
            if sc is not None:
                sc.setLocalProperty(PLAN_PROPERTY, None)
        return [r.asDict() for r in rows], ""

    def _summary(
        self, batch_id: int, txn: Transaction, outcomes: list[dict[str, Any]], kind: BeginKind
    ) -> BatchReport:
        phases = {
            k: max((float(o[k]) for o in outcomes), default=0.0)
            for k in _TASK_PHASES
        }
        return BatchReport(
            batch_id=batch_id,
            outcome="recovered" if kind == BeginKind.IN_DOUBT else "committed",
            attempts=txn.attempt,
            rows=sum(int(o["rows"]) for o in outcomes),
            partitions=txn.partitions,
            recovered=sum(int(o["recovered"]) for o in outcomes),
            redone=sum(int(o["redone"]) for o in outcomes),
            phases=phases,
            sink=self.name,
            txn="/".join(str(x) for x in txn.key),
            decision=txn.decision.value if txn.decision is not None else "",
        )

    def _report(self, report: BatchReport, started: float) -> None:
        report.seconds = time.perf_counter() - started
        if report.phases:  # what no lap took: the loop's own work, this report, the log
            report.phases["driver_s"] = max(0.0, report.seconds - sum(
                v for k, v in report.phases.items() if k in _DRIVER_PHASES))
        self.history.append(report)
        self._by_batch[report.batch_id] = report
        while len(self._by_batch) > 1000:  # a long-running query: keep the recent ones
            del self._by_batch[next(iter(self._by_batch))]
        self._log(report)
        if self.on_batch is not None:
            self.on_batch(report)

    def _log(self, r: BatchReport) -> None:
        """One INFO line per committed batch; a WARNING when recovery had work to do."""
        where = f"sink {self.name} batch {r.batch_id}"
        if r.outcome == "replay":
            log.warning("%s replayed: already committed by an earlier run, nothing written",
                        where, extra={"twophase_batch": r.as_dict()})
            return
        ms = {k: r.phases.get(k, 0.0) * 1000 for k in ("prepare_s", "wait_s", "commit_s")}
        log.info(
            "%s %s: %d rows, %d participants (%s) x %d partitions, attempt %d; "
            "prepare %.0f ms, wait %.0f ms, commit %.0f ms, total %.0f ms",
            where, r.outcome, r.rows, len(self.participants),
            ", ".join(p.name for p in self.participants), r.partitions, r.attempts,
            ms["prepare_s"], ms["wait_s"], ms["commit_s"], r.seconds * 1000,
            extra={"twophase_batch": r.as_dict()},  # the report as data, for JSON logs
        )
        if r.outcome == "recovered" or r.recovered or r.redone:
            log.warning(
                "%s recovered from an earlier run: %s; %d branch(es) of aborted attempts "
                "rolled back, %d lost branch(es) written again", where,
                "finished its committed attempt" if r.outcome == "recovered"
                else f"committed at attempt {r.attempts}", r.recovered, r.redone,
            )


_TASK_PHASES: Final = ("prepare_s", "vote_s", "wait_s", "commit_s", "task_s")
_DRIVER_PHASES: Final = ("frame_s", "split_s", "setup_s", "begin_s", "settle_s", "plan_s",
                          "job_s", "decide_s", "driver_commit_s", "relay_s", "batch_commit_s")


class _Laps:
    """The driver's time per phase of one batch, measured (``BatchReport.phases``): each
    lap adds the time since the previous one to its phase, so a batch that begins again
    sums its attempts."""

    def __init__(self, started: float) -> None:
        self._last = started
        self.taken: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.taken[phase] = self.taken.get(phase, 0.0) + now - self._last
        self._last = now


def _report_struct() -> Any:
    """``_REPORT_SCHEMA`` as a StructType built here: a DDL string is parsed by the JVM
    on every batch (a py4j round trip, ~1-7 ms)."""
    from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

    kinds = {"string": StringType(), "double": DoubleType(), "long": LongType()}
    return StructType([StructField(name, kinds[kind])
                       for name, kind in (f.strip().split() for f in _REPORT_SCHEMA.split(","))])


class _DefaultHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr for the ``twophase`` loggers while the application configured no logging of
    its own (then its handlers get the records and this one stays quiet)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


_SHOWN = ("twophase.sink", "twophase.preflight")  # INFO by default: a line per batch


def _default_logging() -> None:
    """A job that never configured ``logging`` still shows a line per batch and every
    warning: a stderr handler on the ``twophase`` logger, and INFO for the sink's own
    loggers unless the application set their level (an embedded coordinator's INFO lines
    stay off)."""
    top = logging.getLogger("twophase")
    if top.handlers:  # ours already, or the application's (e.g. json_logs)
        return
    handler = _DefaultHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    top.addHandler(handler)
    for name in _SHOWN:
        lg = logging.getLogger(name)
        if lg.level == logging.NOTSET:
            lg.setLevel(logging.INFO)


def _split_rule(participants: Sequence[Participant]) -> tuple[tuple[str, ...], bool]:
    """How every batch is split: (hash columns, one partition only).

    No column asked for: hash by every column (stable, so a replay splits alike).
    Participants asking for key columns get the columns all of them share (the first
    one's order): equal keys of each then meet in one branch. Nothing shared, or a
    participant that needs the whole batch, means a single partition."""
    single = any(p.single_branch() for p in participants)
    asks = [tuple(c) for p in participants if (c := p.partition_columns()) is not None]
    if single or not asks:
        return (), single
    shared = [c for c in asks[0] if all(c in a for a in asks[1:])]
    return tuple(shared), not shared


def _run_through(df: DataFrame) -> None:
    """Evaluate a replayed batch without writing it anywhere.

    A stateful query (``groupBy().count()``, dedup, stream joins) commits its state
    stores for a batch only when the batch's plan runs, and Spark (4.1+) fails the query
    when ``foreachBatch`` returns without every state partition committed
    (STATE_STORE_COMMIT_VALIDATION_FAILED). So a batch the coordinator already shows
    committed still runs through Spark's ``noop`` sink; its rows go nowhere. This costs one
    pass over the batch, only on a replay after a crash."""
    df.write.format("noop").mode("overwrite").save()


def _spark_connect_client() -> bool:
    """True when this process talks to Spark through Spark Connect."""
    try:
        from pyspark.sql.utils import is_remote
    except ImportError:
        return False
    return bool(is_remote())


def _jvm_context(df: DataFrame) -> Any:
    """The JVM SparkContext, or None under Spark Connect."""
    session = df.sparkSession
    if type(session).__module__.startswith("pyspark.sql.connect"):
        return None
    return session.sparkContext


def _task_slots(df: DataFrame) -> int | None:
    """How many tasks the application's executors can run at once (Spark's own figure
    for barrier stages), or None when it cannot be asked (Spark Connect)."""
    sc = _jvm_context(df)
    if sc is None:
        return None
    jsc = sc._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def _default_partitions(df: DataFrame) -> int:
    sc = _jvm_context(df)
    if sc is None:
        conf = df.sparkSession.conf.get("spark.default.parallelism", None)
        return max(1, int(conf)) if conf else 2
    return max(1, int(sc.defaultParallelism))


def _arrow_schema(df: DataFrame, tz: str | None = None) -> Any:
    """The Arrow schema ``mapInArrow`` will hand the tasks (timestamps in the session zone,
    read from the session unless given)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    if tz is None:
        tz = df.sparkSession.conf.get("spark.sql.session.timeZone")
    return to_arrow_schema(df.schema, timezone=tz)


# RDDs whose split is fixed by what the batch reads (its files, its offset ranges, its
# local rows), so a replay of the batch splits it the same way.
_SOURCES = frozenset({
    "FileScanRDD", "DataSourceRDD", "KafkaSourceRDD", "ParallelCollectionRDD", "EmptyRDD",
})


def _input_partitions(df: DataFrame, any_split: bool = False) -> int | None:
    """How many partitions the batch has as Spark made it, when a replay of the batch
    makes the same split: its RDD lineage is one source RDD and then only one-to-one
    (narrow, same partition) steps, no shuffle, no union, no coalesce (which a barrier
    stage would refuse anyway); 0 when the source is known to hold no rows at all. With
    ``any_split`` (a sink whose prepares are durable: only a redo, which the vote's digest
    checks, needs a replay split alike) also a split that comes from a shuffle, a union
    or a coalesce, as planned (a stateful aggregation's ``spark.sql.shuffle.partitions``):
    no second shuffle. None otherwise, or when it cannot be told (Spark Connect).
    foreachBatch hands the batch over as an RDD scan, so the RDD, not the plan, is read.
    Plans the batch; runs no job."""
    try:
        rdd = df._jdf.queryExecution().toRdd()
        stable = _replayed_alike(rdd)
        if stable is None and any_split:
            return int(rdd.getNumPartitions())
        return stable
    except Exception:  # no JVM plan to read (Spark Connect): fall back to the hash split
        return None


def _replayed_alike(rdd: Any) -> int | None:
    """``_input_partitions`` for a split a replay makes alike (see there)."""
    stack, sources, empty = [rdd], 0, True
    while stack:  # each JVM call is a py4j round trip (~0.3-1 ms): as few as possible
        node = stack.pop()
        deps = node.dependencies()
        n_deps = deps.size()
        if n_deps == 0:
            kind = node.getClass().getSimpleName()
            if kind not in _SOURCES:
                return None
            sources += 1
            if kind == "ParallelCollectionRDD":  # local rows: are there any?
                empty = empty and all(p.values().isEmpty() for p in node.partitions())
            elif kind != "EmptyRDD":
                empty = False
        for i in range(n_deps):
            dep = deps.apply(i)
            if dep.getClass().getSimpleName() != "OneToOneDependency":
                return None
            stack.append(dep.rdd())
    if sources != 1:
        return None
    return 0 if empty else int(rdd.getNumPartitions())


def _short_error(exc: BaseException) -> str:
    """The first meaningful line of a (possibly huge) Spark/Py4J error: a participant's
    cause-and-fix sentence (:func:`~twophase.errors.headline`) wherever it is, else the
    Python error a task raised, else the JVM's own exception line (Py4J's first line,
    "An error occurred while calling o280.collectToPython.", says nothing), else the
    first line."""
    text = str(exc)
    found = headline(text)
    if found:
        return found[:2000]
    for marker in ("ModuleNotFoundError:", "ImportError:", "InvalidRequest:",
                   "BatchFailed:", "PrepareRefused:", "ParticipantError:", "Error:"):
        idx = text.find(marker)
        if idx >= 0:
            line = text[idx:].splitlines()[0]
            return line[:500]
    jvm = _JVM_CAUSE.search(text)
    if jvm is not None:
        return f"{jvm.group(1)}: {jvm.group(2).strip()}"[:500]
    return (text.splitlines() or [type(exc).__name__])[0][:500]


# A JVM exception line as Py4J prints it: ": org.apache.spark.SparkException: why".
_JVM_CAUSE: Final = re.compile(
    r"^(?::\s*)?(?:[a-z_$][\w$]*\.)+([A-Z][\w$]*(?:Exception|Error)):\s*(.+)$", re.MULTILINE)


def _failure(sink: str, batch_id: int, exc: TwophaseError) -> tuple[str, TwophaseError]:
    """The sentence a failed batch is reported with, and the error to raise: the same
    class, its first line that sentence, the original message (attempts, other hosts)
    below it. The participant's cause and fix come first, wherever the task put them."""
    text = str(exc)
    cause = headline(text)
    if cause is None:
        cause = text.splitlines()[0] if text.strip() else type(exc).__name__
        for prefix in (f"sink {sink!r} batch {batch_id}: ", f"sink {sink!r}: "):
            cause = cause.removeprefix(prefix)
    first = f"sink {sink} batch {batch_id} failed: {cause}"
    lines = text.splitlines() or [""]
    rest = text if lines[0] != cause and headline(text) else "\n".join(lines[1:])
    message = first + ("\n" + rest if rest.strip() else "")
    try:
        failed = type(exc)(message)
    except TypeError:  # a class of its own with another constructor
        failed = BatchFailed(message)
    return first, failed


# The coordinator's bounds (coordinator/models.py refuses more): checked here so that a
# bad argument fails when the sink is built, not at the first batch.
MAX_PARTICIPANTS = 64
MAX_PARTITIONS = 100_000
MAX_VOTE_TIMEOUT = 7 * 86400.0


def _bounded_int(what: str, value: object, lo: int, hi: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise InvalidRequest(f"{what} must be an int from {lo} to {hi}, got {value!r}")


def _bounded_float(what: str, value: object, lo: float, hi: float, meaning: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not lo <= float(value) <= hi:  # type: ignore[arg-type]  # NaN fails too
        raise InvalidRequest(
            f"{what} must be a number of {meaning} from {lo:g} to {hi:g}, got {value!r}"
        )
