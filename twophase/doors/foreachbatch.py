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
   that voted YES (``twophase.engine.commit``), tables once per batch;
5. return only when the coordinator shows the attempt COMMITTED. An aborted attempt is
   retried in place with backoff, a bounded number of times, then the query fails with
   the participant, partition and cause.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from twophase import failpoints
from twophase.client.connection import check_coordinator
from twophase.engine.commit import Committer, commit_batches
from twophase.engine.decide import decide, settle_empty, votes_of
from twophase.engine.plan import PREPARE, fixed_split, redone_handles, relay_acks
from twophase.engine.prepare import PrepareJob
from twophase.engine.report import (
    DRIVER_PHASES,
    BatchReport,
    Laps,
    batch_phases,
    default_logging,
    failure,
    log_batch,
    progress_listener,
    short_error,
    summary,
)
from twophase.errors import BatchFailed, InvalidRequest, TwophaseError
from twophase.names import LINEAGE_RULE, validate_lineage, validate_name
from twophase.options import MARKER_KEEP_BATCHES, check_sink_options
from twophase.participant import Participant, descriptor_of
from twophase.protocol import BeginKind, Decision, StepKind, next_step
from twophase.spark.compat import check_spark
from twophase.spark.preflight import check_gang
from twophase.spark.session import (
    coordinator_address,
    default_partitions,
    jvm_context,
    query_lineage,
    run_through,
    spark_connect_client,
)
from twophase.spark.split import input_partitions

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from twophase.client.api import CoordinatorClient
    from twophase.client.connection import Connection

__all__ = ["BatchFailed", "BatchReport", "TransactionalSink"]

log = logging.getLogger("twophase.sink")


class TransactionalSink:
    """Exactly-once ``foreachBatch`` sink over several participants.

    ``coordinator`` is a store URL (``sqlite:///path.db``, ``postgresql://...``: an
    embedded coordinator starts in this driver) or a daemon URL (``http(s)://host:port``;
    a data token from ``token=`` or ``token_file=``, re-read after a 401: rotatable).

    Before its first batch the sink checks the executors (``preflight=False`` skips it;
    :mod:`twophase.spark.preflight`); ``retry_budget_s`` is how long the driver and the tasks
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
    ``marker_keep_batches``: batches whose participant markers are kept (why: see
    :func:`twophase.options.check_marker_window`)."""

    def __init__(
        self,
        name: str,
        participants: Sequence[Participant],
        coordinator: str,
        *,
        token: str | None = None,
        token_file: str | None = None,
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
        marker_keep_batches: int = MARKER_KEEP_BATCHES,
    ) -> None:
        self.name = validate_name("sink name", name)
        if lineage is None and spark_connect_client():
            raise InvalidRequest(
                f"sink {name!r}: under Spark Connect foreachBatch runs in a server-side "
                "Python process that cannot see the streaming query's id; pass "
                f"lineage='<{LINEAGE_RULE}>' naming this query's checkpoint "
                "(a new checkpoint location needs a new lineage; docs/cluster.md)"
            )
        check_sink_options(name, [p.name for p in participants], partitions=partitions,
                           max_attempts=max_attempts, backoff=backoff,
                           vote_timeout=vote_timeout, retry_budget_s=retry_budget_s,
                           marker_keep_batches=marker_keep_batches)
        self.participants = tuple(participants)
        # A participant whose prepared branch dies with its process (Kafka's in-task
        # transaction) needs every task alive until the decision: one barrier stage.
        # Otherwise tasks prepare and end, and the driver commits after the job.
        self.gang = any(not p.durable_prepare for p in self.participants)
        # participants' keys or complete mode may fix the split (one_branch: P is 1)
        self.split_columns, self.one_branch, partitions = fixed_split(
            self.name, self.participants, partitions)
        self.coordinator = check_coordinator(coordinator)
        self.token, self.token_file = token, token_file
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
        self._spark_checked = False
        if json_logs:  # one JSON object per line on stderr, as the daemon logs
            from twophase.logs import setup_logging

            setup_logging("info")
        else:
            default_logging()
        self._committer = Committer(self.participants, keep=marker_keep_batches)
        self._job = PrepareJob(self.participants, self.split_columns, self.one_branch,
                               self.gang)
        self.history: list[BatchReport] = []
        self._by_batch: dict[int, BatchReport] = {}
        self._conn: Connection | None = None
        self._client: CoordinatorClient | None = None
        self._epoch: int | None = None

    # ------------------------------------------------------------------ lifecycle
    def _connect(self, df: DataFrame | None = None) -> CoordinatorClient:
        if self._client is None:
            from twophase.client.connection import connect

            bind, advertise = self._coordinator_address(df)
            self._conn = connect(self.coordinator, self.token, host=bind, advertise=advertise,
                                 tls=self.coordinator_tls, token_file=self.token_file)
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
        """The web console (``/ui``), signed in with an embedded coordinator's operator
        token, else the sink's (in the URL's fragment, which browsers never send);
        ``None`` before the first batch connects."""
        if self._conn is None:
            return None
        from urllib.parse import quote

        token = self._conn.operator_token or (self._client.token if self._client else None)
        return f"{self._conn.url}/ui" + (f"#token={quote(token, safe='')}" if token else "")

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
        self._job.forget()

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
        if not self._spark_checked:  # before anything is begun or written
            import pyspark

            check_spark(self.name, df.sparkSession.version, pyspark.__version__)
            self._spark_checked = True
        lineage = self.lineage or query_lineage(df, self.name)
        # The job's own DataFrame, planned once: its split is read from its plan, and the
        # job runs it when it keeps Spark's split (the plan travels as a local property).
        direct = self._job.frame(df)
        laps.lap("frame_s")
        n_in = input_partitions(direct if direct is not None else df, any_split=not self.gang)
        laps.lap("split_s")
        if n_in is not None and ((self.gang and n_in > default_partitions(df))
                                 or self.partitions not in (None, n_in)):
            n_in = None  # a barrier stage needs a slot per task; partitions=N asks for N
        # n_in == 0: Spark planned no partition at all, the batch has no rows (the
        # application's parallelism, two py4j round trips, only read when needed)
        partitions = self.partitions or (1 if n_in == 0 else n_in or default_partitions(df))
        self._check_cluster(df, partitions)
        client = self._connect(df)
        if self._epoch is None:
            # One writer epoch per driver run: a restarted driver fences the old one.
            # the participants' descriptors let `twophase resolve SINK` rebuild them
            descriptors = [d for d in map(descriptor_of, self.participants) if d]
            self._epoch = client.register(self.name, descriptors)  # type: ignore[arg-type]
            log.info("sink %s: writer epoch %d, lineage %s", self.name, self._epoch, lineage)
            assert self._conn is not None
            self._job.fixed_part(epoch=self._epoch, coordinator_url=self._conn.url,
                                 token=client.token, ca_pem=self._conn.ca_pem,
                                 vote_timeout=self.vote_timeout,
                                 retry_budget=self.retry_budget_s,
                                 token_file=self._conn.token_file)
        if not self._preflighted:
            from twophase.spark.preflight import preflight_sink

            assert self._conn is not None
            # the targets from here, what a crash left open, then the executors
            preflight_sink(jvm_context(df), df.sparkSession, self.name, self.participants,
                           self._conn.url, executors=self.preflight,
                           wait_s=self.retry_budget_s, client=client)
            self._preflighted = True
        self._job.check(df)
        laps.lap("setup_s")
        failpoints.hit("before_begin")
        aborted = finishing = 0
        while True:
            res = client.begin(
                self.name, lineage, batch_id, self._epoch,
                [p.name for p in self.participants], partitions, self.vote_timeout,
            )
            laps.lap("begin_s")
            self._job.renew_token(client.token)  # the begin may have met a rotation
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
                plan = self._job.plan(res.kind, txn, res.recover, n_in)
                split = plan.split
                laps.lap("plan_s")
                outcomes, job_error = self._job.run(df, plan, direct, client)
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
                self._committer.prune(self.name, lineage, batch_id)  # in the background
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

    def _report(self, report: BatchReport, started: float) -> None:
        report.seconds = time.perf_counter() - started
        if report.phases:  # what no lap took: the loop's own work, this report, the log
            report.phases["driver_s"] = max(0.0, report.seconds - sum(
                v for k, v in report.phases.items() if k in DRIVER_PHASES))
        batch_phases(report)
        self.history.append(report)
        self._by_batch[report.batch_id] = report
        while len(self._by_batch) > 1000:  # a long-running query: keep the recent ones
            del self._by_batch[next(iter(self._by_batch))]
        log_batch(report, [p.name for p in self.participants])
        if self.on_batch is not None:
            self.on_batch(report)
