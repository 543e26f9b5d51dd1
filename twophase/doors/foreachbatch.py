"""``TransactionalSink``: the callable you hand to ``df.writeStream.foreachBatch``.

The door checks the sink's options once and hands each micro-batch to the batch engine
(:class:`twophase.engine.batch.BatchEngine`: plan, prepare, decide, commit, report; see
ARCHITECTURE.md for the picture); a failure is logged and raised as one sentence."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from twophase.engine.batch import BatchEngine
from twophase.engine.report import (
    BatchReport,
    default_logging,
    failure,
    progress_listener,
    short_error,
)
from twophase.engine.settings import SinkSettings
from twophase.errors import BatchFailed, InvalidRequest, TwophaseError
from twophase.names import LINEAGE_RULE
from twophase.options import MARKER_KEEP_BATCHES, VOTE_TIMEOUT
from twophase.participant import Participant
from twophase.spark.session import spark_connect_client

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["BatchFailed", "BatchReport", "TransactionalSink"]

log = logging.getLogger("twophase.sink")


class TransactionalSink:
    """Exactly-once ``foreachBatch`` sink over several participants.

    ``coordinator``: a store URL (``sqlite:///path.db``, ``postgresql://...``: an embedded
    coordinator starts in this driver) or a daemon URL (``http(s)://host:port``, with a
    data token from ``token=`` or ``token_file=``, re-read after a 401). The tasks prepare
    and end, the driver decides and commits, so a sink runs on any cluster shape
    (docs/cluster.md). Each option, its default and its bounds: docs/user/configuration.md
    (checked by :class:`twophase.engine.settings.SinkSettings`, whichever door the sink
    goes through). ``cluster_wait`` is accepted with a DeprecationWarning and ignored
    (0.4 retired the barrier stage it bounded)."""

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
        vote_timeout: float = VOTE_TIMEOUT,
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
        if cluster_wait is not None:
            warnings.warn("TransactionalSink(cluster_wait=...) has no effect since 0.4 (it "
                          "bounded the barrier stage's wait for task slots, retired with "
                          "Kafka's in-task prepare): drop it", DeprecationWarning, stacklevel=2)
        self.settings = SinkSettings(
            name, tuple(participants), coordinator, token=token, token_file=token_file,
            partitions=partitions, max_attempts=max_attempts, backoff=backoff,
            vote_timeout=vote_timeout, lineage=lineage, on_batch=on_batch,
            coordinator_host=coordinator_host, coordinator_tls=coordinator_tls,
            retry_budget_s=retry_budget_s, preflight=preflight,
            marker_keep_batches=marker_keep_batches)
        if lineage is None and spark_connect_client():
            raise InvalidRequest(
                f"sink {name!r}: under Spark Connect foreachBatch runs in a server-side "
                "Python process that cannot see the streaming query's id; pass "
                f"lineage='<{LINEAGE_RULE}>' naming this query's checkpoint "
                "(a new checkpoint location needs a new lineage; docs/cluster.md)"
            )
        self.name, self.participants = self.settings.name, self.settings.participants
        default_logging(json_logs)
        self._engine = BatchEngine(self.settings)
        self.history: list[BatchReport] = self._engine.history

    @property
    def console_url(self) -> str | None:
        """The web console (``/ui``), signed in with an embedded coordinator's operator
        token, else the sink's (in the URL's fragment, which browsers never send);
        ``None`` before the first batch connects."""
        return self._engine.console_url()

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
