"""Exactly-once into a Delta Lake table (deltalake, delta-rs), one table version per batch.

A table commits once per batch (:class:`~twophase.participant.BatchParticipant`):

- **prepare** (each task): the branch's rows become Parquet data files under
  ``<table>/twophase-<sink>/<lineage>/<batch>/``, named after participant, partition,
  attempt and sequence. No log entry references them, so no reader sees them. The task
  votes a handle naming them with what their add actions need (size, partition values,
  stats); each file's footer holds the same, so a recovery that finds a branch's files by
  name, without its vote, commits the same add actions.
- **commit_batch** (the driver, after COMMIT): ONE Delta commit of add actions for every
  branch's files. It carries Delta's own ``SetTransaction(app_id, version=batch id)``
  with ``app_id = twophase-<sink>-<lineage>``, the same idempotency state Spark's Delta
  sink keeps as ``txnAppId``/``txnVersion``, and commit info naming sink, lineage, batch
  and attempt.

The app transaction's version is the marker. A batch is in the table once the version
reaches its id: batches of one lineage commit in order, because a micro-batch returns
only once committed. A commit that loses an optimistic race (another writer's version
landed first) is not rebased by delta-rs (``max_commit_retries=0``). Our loop reads the
marker again and commits only when the batch is still missing, so the winner may have
been this very batch, from another process.
"""

from twophase.sinks.delta.arrow import delta_schema
from twophase.sinks.delta.participant import DeltaParticipant, app_id

__all__ = ["DeltaParticipant", "app_id", "delta_schema"]
