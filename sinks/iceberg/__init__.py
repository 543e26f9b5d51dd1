"""Exactly-once into an Apache Iceberg table (pyiceberg), one snapshot per micro-batch.

A table commits once per batch (:class:`~twophase.participant.BatchParticipant`): each
task writes its branch's rows as Parquet data files under the table's data folder, named
after (sink, lineage, batch, attempt, participant, partition) and referenced by no
snapshot, so no reader sees them; it votes a handle naming them. After the COMMIT
decision the driver calls :meth:`IcebergParticipant.commit_batch` once: one fast-append
snapshot adding every branch's files, whose summary carries the marker
``twophase.sink`` / ``twophase.lineage`` / ``twophase.batch`` / ``twophase.attempt``.
The marker is read back from the table's snapshot history, so a second commit of the
batch (a retry, a recovery, ``twophase resolve``) is a no-op.

A commit that loses the optimistic race on the catalog (another writer's snapshot
landed first: ``CommitFailedException``) is retried here, after reading the marker
again: pyiceberg's own retry (which re-applies the snapshot without looking) is switched
off for our commits, because the winner may have been this very batch committed by
another process.
"""

from twophase.sinks.iceberg.marker import MARKER_KEYS
from twophase.sinks.iceberg.participant import IcebergParticipant

__all__ = ["MARKER_KEYS", "IcebergParticipant"]
