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
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from twophase import failpoints
from twophase.commit import Committer, commit_batches
from twophase.connection import check_coordinator
from twophase.decide import decide, settle_empty, votes_of
from twophase.errors import BatchFailed, InvalidRequest, TwophaseError
from twophase.names import LINEAGE_RULE, validate_lineage, validate_name
from twophase.options import (
    MAX_PARTICIPANTS,
    MAX_PARTITIONS,
    MAX_VOTE_TIMEOUT,
    bounded_float,
    bounded_int,
)
from twophase.participant import (
    Participant,
    descriptor_of,
)
from twophase.plan import (
    arrow_schema,
    check_gang,
    coordinator_address,
    default_partitions,
    input_partitions,
    jvm_context,
    run_through,
    spark_connect_client,
    split_rule,
)
from twophase.protocol import (
    BeginKind,
    Decision,
    StepKind,
    TxnKey,
    next_step,
)
from twophase.report import (
    DRIVER_PHASES,
    REPORT_SCHEMA,
    BatchReport,
    Laps,
    default_logging,
    failure,
    log_batch,
    progress_listener,
    report_struct,
    short_error,
    summary,
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

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from twophase.client import CoordinatorClient
    from twophase.connection import Connection
    from twophase.protocol import Transaction

__all__ = ["BatchFailed", "BatchReport", "TransactionalSink"]

log = logging.getLogger("twophase.sink")

QUERY_ID_PROPERTY = "sql.streaming.queryId"  # set by Spark on the stream execution thread

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
        if lineage is None and spark_connect_client():
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
        bounded_int("partitions", partitions, 1, MAX_PARTITIONS, optional=True)
        bounded_int("max_attempts", max_attempts, 1, 1000)
        bounded_float("backoff", backoff, 0.0, 3600.0, "seconds between attempts")
        bounded_float("vote_timeout", vote_timeout, 0.001, MAX_VOTE_TIMEOUT,
                       "seconds the coordinator waits for every vote")
        if not retry_budget_s > 0:
            raise InvalidRequest(f"retry_budget_s must be > 0 seconds, got {retry_budget_s}")
        self.participants = tuple(participants)
        # A participant whose prepared branch dies with its process (Kafka's in-task
        # transaction) needs every task alive until the decision: one barrier stage.
        # Otherwise tasks prepare and end, and the driver commits after the job.
        self.gang = any(not p.durable_prepare for p in self.participants)
        self.split_columns, single = split_rule(self.participants)
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
            default_logging()
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
        """Where an embedded coordinator listens and what the tasks are told."""
        if self.coordinator_host:
            return self.coordinator_host, self.coordinator_host
        return coordinator_address(df)

    def _check_cluster(self, df: DataFrame, partitions: int) -> None:
        """Refuse, before anything is begun or written, a batch Spark would refuse
        mid-way (only a sink with an in-task participant runs a barrier stage)."""
        if not self.gang or partitions <= self._slots_checked:
            return  # checked before (master and dynamic allocation are fixed at start)
        check_gang(df, self.name, self._in_task(), partitions, self.cluster_wait)
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
        return progress_listener(self.report, callback)

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
            first, failed = failure(self.name, batch_id, exc)
            log.error("%s", first)
            raise failed from None
        except Exception as exc:
            log.error("sink %s batch %d failed: %s", self.name, batch_id, short_error(exc))
            raise

    def _batch(self, df: DataFrame, batch_id: int) -> None:
        started = time.perf_counter()
        laps = Laps(started)
        lineage = self._lineage(df)
        slots = default_partitions(df)
        # The job's own DataFrame, planned once: its split is read from its plan, and the
        # job runs it when it keeps Spark's split (the plan travels as a local property).
        direct = self._job_frame(df)
        laps.lap("frame_s")
        n_in = input_partitions(direct if direct is not None else df, any_split=not self.gang)
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
            # the driver first: no job needed to say why; then what a crash left open
            probe_targets(self.participants, self.name, client)
            sc = jvm_context(df)
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
                run_through(df)
                self._report(BatchReport(batch_id, "replay", 0, sink=self.name, decision="COMMIT"),
                             started)
                return
            txn = res.txn
            assert txn is not None
            # an attempt stored by an earlier run keeps its partition count
            self._check_cluster(df, txn.partitions)
            in_doubt = res.kind == BeginKind.IN_DOUBT
            if n_in == 0 and settle_empty(client, self._epoch, txn, res.recover,
                                          in_doubt=in_doubt):
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
                report = summary(self.name, batch_id, final, outcomes,
                                 res.kind == BeginKind.IN_DOUBT)
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
                or self.one_branch or jvm_context(df) is None):
            return None
        return df.mapInArrow(self._task(None, self._schema(df)), report_struct(),
                             barrier=self.gang)

    def _schema(self, df: DataFrame) -> Any:
        """The batch's Arrow schema. A user's foreachBatch function may reshape the batch
        (a column added from batch N on), so the schema is the batch's own, never the
        lineage's; only the conversion is reused while the Spark schema and the session's
        time zone stay the same."""
        tz = df.sparkSession.conf.get("spark.sql.session.timeZone")
        key = (df.schema, tz)
        if self._schema_of[0] != key:
            self._schema_of = (key, arrow_schema(df, tz))
        return self._schema_of[1]

    def _task(self, fixed: BatchPlan | None, batch_schema: Any) -> Callable[[Any], Any]:
        """The task's function. With ``fixed`` it runs that plan; without, it reads
        the batch's plan from the job's local property (``PLAN_PROPERTY``, set by
        ``_run_tasks``) over the sink's template (participants, coordinator, token: never
        in a property, which Spark's event log records)."""
        import pyarrow as pa

        template = fixed or self._plan_template()
        report_schema = pa.schema(
            [(name, pa.string() if kind == "string" else pa.float64() if kind == "double"
              else pa.int64())
             for name, kind in (f.strip().split() for f in REPORT_SCHEMA.split(","))]
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
                out = run_partition(plan, partition, batch_schema, iter(()), task=attempt)
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
        sc = jvm_context(df)
        batch_schema = self._schema(df)
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
            job = split.mapInArrow(self._task(None if sc is not None else plan, batch_schema),
                                   report_struct(), barrier=self.gang)
        if sc is not None:
            sc.setLocalProperty(PLAN_PROPERTY, plan_property(plan))
        try:
            rows = job.collect()
        except Exception as exc:  # the job failed: the coordinator's record decides what next
            return [], short_error(exc)
        finally:
            if sc is not None:
                sc.setLocalProperty(PLAN_PROPERTY, None)
        return [r.asDict() for r in rows], ""

    def _report(self, report: BatchReport, started: float) -> None:
        report.seconds = time.perf_counter() - started
        if report.phases:  # what no lap took: the loop's own work, this report, the log
            report.phases["driver_s"] = max(0.0, report.seconds - sum(
                v for k, v in report.phases.items() if k in DRIVER_PHASES))
        self.history.append(report)
        self._by_batch[report.batch_id] = report
        while len(self._by_batch) > 1000:  # a long-running query: keep the recent ones
            del self._by_batch[next(iter(self._by_batch))]
        log_batch(report, [p.name for p in self.participants])
        if self.on_batch is not None:
            self.on_batch(report)
