"""``TransactionalSink``: the callable you hand to ``df.writeStream.foreachBatch``.

The door checks the sink's options once and hands each micro-batch to the batch engine
(:class:`twophase.engine.batch.BatchEngine`: plan, prepare, decide, commit, report; see
ARCHITECTURE.md for the picture); a failure is logged and raised as one sentence."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from twophase.client.connection import check_coordinator
from twophase.engine.batch import BatchEngine
from twophase.engine.plan import fixed_split
from twophase.engine.report import (
    BatchReport,
    default_logging,
    failure,
    progress_listener,
    short_error,
)
from twophase.errors import BatchFailed, InvalidRequest, TwophaseError
from twophase.names import LINEAGE_RULE, validate_lineage, validate_name
from twophase.options import MARKER_KEEP_BATCHES, check_sink_options
from twophase.participant import Participant, check_durable
from twophase.spark.session import spark_connect_client

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

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
    it over HTTPS). The tasks prepare and end; the driver decides and commits, so a sink
    runs on any cluster shape: dynamic allocation, speculation, more partitions than task
    slots (docs/cluster.md). ``cluster_wait`` is accepted with a DeprecationWarning and
    ignored (it bounded the barrier stage's wait for task slots, retired in 0.4).
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
        cluster_wait: float | None = None,
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
        # the tasks prepare and end before the decision: each prepare must outlive them
        check_durable(self.name, self.participants)
        if cluster_wait is not None:
            warnings.warn("TransactionalSink(cluster_wait=...) has no effect since 0.4 (it "
                          "bounded the barrier stage's wait for task slots, retired with "
                          "Kafka's in-task prepare): drop it", DeprecationWarning, stacklevel=2)
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
        self.retry_budget_s = float(retry_budget_s)
        self.preflight = preflight
        if json_logs:  # one JSON object per line on stderr, as the daemon logs
            from twophase.logs import setup_logging

            setup_logging("info")
        else:
            default_logging()
        self._engine = BatchEngine(self, keep=marker_keep_batches)
        self.history: list[BatchReport] = self._engine.history

    @property
    def console_url(self) -> str | None:
        """The web console (``/ui``), signed in with an embedded coordinator's operator
        token, else the sink's (in the URL's fragment, which browsers never send);
        ``None`` before the first batch connects."""
        conn, client = self._engine.conn, self._engine.client
        if conn is None:
            return None
        from urllib.parse import quote

        token = conn.operator_token or (client.token if client else None)
        return f"{conn.url}/ui" + (f"#token={quote(token, safe='')}" if token else "")

    def report(self, batch_id: int) -> BatchReport | None:
        """The twophase outcome of micro-batch ``batch_id`` in this driver run (what a
        ``StreamingQueryListener`` looks up from ``event.progress.batchId``)."""
        return self._engine.by_batch.get(batch_id)

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
        self._engine.close()

    # ------------------------------------------------------------------ the batch
    def __call__(self, df: DataFrame, batch_id: int) -> None:
        """Write one micro-batch exactly once (foreachBatch calls this). A failure is
        logged as one ERROR line, ``sink S batch N failed: <participant>: <cause>. Fix:
        <fix>``, and raised with that sentence as its first line, before Spark wraps it."""
        try:
            self._engine.run(df, batch_id)
        except TwophaseError as exc:
            first, failed = failure(self.name, batch_id, exc)
            log.error("%s", first)
            raise failed from None
        except Exception as exc:
            log.error("sink %s batch %d failed: %s", self.name, batch_id, short_error(exc))
            raise
