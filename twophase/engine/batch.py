"""One sink's engine on the driver, and one micro-batch's run through the protocol's
steps in order: plan (``plan``, the split read from Spark), prepare (``prepare``: the
batch's Spark job), decide (``decide``), commit (``commit``), report (``report``). A
restart's in-doubt attempt takes the same steps: its job runs tasks only to redo lost
branches (``recover`` asks whether any is lost), and the same commit step commits it.

Both doors start a sink here (``start``: its coordinator connection, its writer epoch,
the preflight); the ``foreachBatch`` door runs each batch with ``run``, the data source
door decides and commits the votes Spark hands its committer (``twophase.engine.door``).

Per batch: ``begin`` with the coordinator, keyed by (sink, lineage, batch id); split
the batch into P partitions the same way on every replay (P is stored with the first
attempt: as Spark read it when a replay splits alike, else by a stable hash of every
column); a batch Spark planned without partitions is voted empty by the driver alone
(``recover.vote_empty``, no Spark job), and decided and committed as any other. The
tasks prepare (one ordinary task per partition; each prepare outlives its task), the
coordinator's record holds the decision (an undecided attempt
is abandoned: ABORT) and the driver applies it. ``run`` returns only when the coordinator
shows the attempt COMMITTED; an aborted attempt is retried in place with backoff, a
bounded number of times, then the batch fails with the participant, partition and
cause."""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING

from twophase import failpoints
from twophase.engine.commit import Committer
from twophase.engine.decide import decide, votes_of
from twophase.engine.plan import PREPARE, descriptors, redone_handles
from twophase.engine.prepare import PrepareJob
from twophase.engine.report import (
    DRIVER_PHASES,
    BatchReport,
    Laps,
    batch_phases,
    log_batch,
    summary,
)
from twophase.engine.settings import SinkSettings
from twophase.errors import BatchFailed
from twophase.protocol import BeginKind, Decision, StepKind, next_step
from twophase.spark.session import SparkApp, SparkBatch, read_batch, run_through
from twophase.spark.split import default_partitions, input_partitions

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from twophase.client.api import CoordinatorClient
    from twophase.client.connection import Connection

__all__ = ["BatchEngine"]

log = logging.getLogger("twophase.sink")


class BatchEngine:
    """One sink's driver side: its coordinator connection and writer epoch, its prepare
    job and committer, and the reports of the batches it ran."""

    def __init__(self, sink: SinkSettings) -> None:
        self.sink = sink
        self.committer = Committer(sink.participants, keep=sink.marker_keep_batches)
        self.job = PrepareJob(sink.participants, sink.split_columns, sink.one_branch)
        self.history: list[BatchReport] = []
        self.by_batch: dict[int, BatchReport] = {}
        self.conn: Connection | None = None
        self.client: CoordinatorClient | None = None
        self.epoch: int | None = None
        self.spark: SparkBatch | None = None  # the last batch's read of Spark
        self._preflighted = False

    # ------------------------------------------------------------------ the sink's start
    def connect(self, address: tuple[str, str] = ("127.0.0.1", "127.0.0.1")
                ) -> CoordinatorClient:
        """The sink's coordinator client; an embedded coordinator listens at ``address``
        (bind, told to the tasks: :func:`twophase.spark.session.read_app`)."""
        if self.client is None:
            from twophase.client.connection import connect

            s = self.sink
            self.conn = connect(s.coordinator, s.token, host=address[0], advertise=address[1],
                                tls=s.coordinator_tls, token_file=s.token_file)
            self.client = self.conn.client(retry_budget=s.retry_budget_s)
        return self.client

    def start(self, app: SparkApp, lineage: str | None = None
              ) -> tuple[CoordinatorClient, int]:
        """Connect, take the writer epoch (once per driver run: a restarted driver fences
        the old one) and check the targets, what a crash left open and the executors."""
        client, s = self.connect(app.address), self.sink
        conn = self.conn
        assert conn is not None
        if self.epoch is None:
            # the participants' descriptors let `twophase resolve SINK` rebuild them
            self.epoch = client.register(s.name, descriptors(s.participants))
            log.info("sink %s: writer epoch %d, lineage %s", s.name, self.epoch,
                     lineage or "per query")
            self.job.fixed_part(epoch=self.epoch, coordinator_url=conn.url, token=client.token,
                                ca_pem=conn.ca_pem, retry_budget=s.retry_budget_s,
                                token_file=conn.token_file)
        if not self._preflighted:
            from twophase.spark.preflight import preflight_sink

            preflight_sink(app.jvm, app.session, s.name, s.participants, conn.url,
                           executors=s.preflight, wait_s=s.retry_budget_s, client=client)
            self._preflighted = True
        return client, self.epoch

    def console_url(self) -> str | None:
        """The web console (``/ui``), signed in with an embedded coordinator's operator
        token, else the sink's (in the URL's fragment, which browsers never send);
        ``None`` before the first batch connects."""
        if self.conn is None:
            return None
        from urllib.parse import quote

        token = self.conn.operator_token or (self.client.token if self.client else None)
        return f"{self.conn.url}/ui" + (f"#token={quote(token, safe='')}" if token else "")

    def close(self) -> None:
        self.committer.close()
        if self.client is not None:
            self.client.close()
        if self.conn is not None:
            self.conn.close()
        self.client = self.conn = None
        self.epoch = self.spark = None
        self.job.forget()

    # ------------------------------------------------------------------ one batch
    def run(self, df: DataFrame, batch_id: int) -> None:
        """Write one micro-batch exactly once: plan, prepare, decide, commit, report."""
        s, job = self.sink, self.job
        started = time.perf_counter()
        laps = Laps(started)
        # Spark, read once (the version checked before anything is begun or written):
        # the steps below take this as plain data
        spark = self.spark = read_batch(df, s.name, s.lineage, s.coordinator_host, self.spark)
        lineage = spark.lineage
        # The job's own DataFrame, planned once: its split is read from its plan, and the
        # job runs it when it keeps Spark's split (the plan travels as a local property).
        direct = job.frame(df, spark)
        laps.lap("frame_s")
        n_in = input_partitions(direct if direct is not None else df, any_split=True)
        laps.lap("split_s")
        if n_in is not None and s.partitions not in (None, n_in):
            n_in = None  # partitions=N asks for N
        # n_in == 0: Spark planned no partition at all, the batch has no rows (the
        # application's parallelism, two py4j round trips, only read when needed)
        partitions = s.partitions or (1 if n_in == 0 else n_in
                                      or default_partitions(df, spark.jvm))
        client, epoch = self.start(spark.app, lineage)
        job.check(spark.schema)
        laps.lap("setup_s")
        failpoints.hit("before_begin")
        aborted = finishing = 0
        while True:
            res = client.begin(s.name, lineage, batch_id, epoch,
                               [p.name for p in s.participants], partitions, s.vote_timeout)
            laps.lap("begin_s")
            if res.new_lineage:
                log.warning("sink %s: new lineage %s (checkpoint location changed): batch ids "
                            "restart here and are not taken for already-committed ones",
                            s.name, lineage)
            if res.kind == BeginKind.COMMITTED:
                run_through(df)
                self._report(BatchReport(batch_id, "replay", 0, sink=s.name, decision="COMMIT"),
                             started)
                return
            txn = res.txn
            assert txn is not None
            in_doubt = res.kind == BeginKind.IN_DOUBT
            plan = job.plan(res.kind, txn, res.recover, n_in, client.token)
            laps.lap("plan_s")
            outcomes, job_error = job.launch(df, plan, spark, direct, client)
            laps.lap("job_s")
            # No task waited for the decision: the driver sends every task's votes
            # (an undecided attempt, its job failed, is abandoned); a finish's is
            # decided already.
            final = decide(client, txn, epoch, votes_of(outcomes), job_error)
            laps.lap("decide_s")
            if plan.mode == PREPARE or not job_error:
                # The driver applies the decision to every branch, a finish's lost ones
                # from the handles its tasks redid. A finish whose job failed applies
                # nothing: a lost branch's vote names rows that are gone, and the retry
                # rule finishes the batch again.
                final, commit_error = self.committer.apply(client, epoch, final,
                                                           redone_handles(outcomes))
                laps.lap("driver_commit_s")
                job_error = job_error or commit_error
            rule = partial(next_step, max_attempts=s.max_attempts, backoff=s.backoff,
                           job_error=job_error)
            step = rule(final, aborted=aborted, finishing=finishing)
            if step.kind == StepKind.ABANDON:
                final = client.abandon(final.key, epoch, step.reason)
                step = rule(final, aborted=aborted, finishing=finishing, abandoned=True)
            aborted, finishing = step.aborted, step.finishing
            if step.warning:
                log.warning("%s", step.warning)
            if step.kind == StepKind.RETURN:
                self.committer.prune(s.name, lineage, batch_id)  # in the background
                failpoints.hit("before_return")
                report = summary(s.name, batch_id, final, outcomes, in_doubt)
                report.split = plan.split
                report.phases.update(laps.taken)
                self._report(report, started)
                return
            if step.kind == StepKind.GIVE_UP:
                if final.decision == Decision.ABORT:
                    self.committer.sweep(final)  # nothing left prepared behind the error
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
        self.by_batch[report.batch_id] = report
        while len(self.by_batch) > 1000:  # a long-running query: keep the recent ones
            del self.by_batch[next(iter(self.by_batch))]
        log_batch(report, [p.name for p in self.sink.participants])
        if self.sink.on_batch is not None:
            self.sink.on_batch(report)
