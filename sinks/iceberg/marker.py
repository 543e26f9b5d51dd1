"""Names, options and the batch marker of the Iceberg participant: which batches the
table's snapshot history says are committed, by which attempt, with which branches."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from twophase.errors import InvalidRequest

if TYPE_CHECKING:
    from pyiceberg.table import Table

MODES: Final = ("append", "complete")
POLICIES: Final = ("fail", "add_columns")
MARKER_KEYS: Final = ("twophase.sink", "twophase.lineage", "twophase.batch",
                      "twophase.attempt", "twophase.participant", "twophase.partitions")
_IDENT: Final = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_TRANSFORM: Final = re.compile(r"^(?P<t>identity|day|month|year|hour)\((?P<c>[^()]+)\)$")
SECRET_KEYS: Final = re.compile(r"(secret|password|token|credential|session)", re.I)
URL_PASSWORD: Final = re.compile(r"://[^/@:]*:[^/@]*@")  # a catalog uri with a password
HANDLE_CHARS: Final = 4000  # a handle value holds at most 4096 characters
COMMIT_TRIES: Final = 20
UNKNOWN: Final = -1  # a batch committed by an attempt whose snapshot has expired
NO_RETRY: Final = {"commit.retry.num-retries": "0"}


def commit_base(tbl: Table, *, trim: bool) -> Table:
    """The table a batch's snapshot is computed against: ``tbl`` with pyiceberg's own
    commit retry off (``NO_RETRY``: it would re-apply the snapshot after a lost race
    without reading our marker; ``commit_batch``'s loop does that instead), and with
    ``trim`` (a fast append) only the snapshots its refs point at, no snapshot log and
    no metadata log.

    Why trim: pyiceberg's ``Transaction`` deep-copies its table's whole metadata on
    every read of ``table_metadata`` (~16 per fast append), so a commit grew with the
    table's history (22 ms after 1 snapshot, 56 ms after 12, measured). Safe: the
    catalog's commit applies the snapshot and ref updates to the metadata it loads
    itself, and refuses them unless main still points at this base's current snapshot
    (the parent); from the base a fast append reads only that parent (its manifests,
    summary totals), the sequence number and the schema, which are all kept
    (docs/decisions.md, 2026-11-26)."""
    from pyiceberg.table import Table as TableCls

    md = tbl.metadata
    update: dict[str, object] = {"properties": {**md.properties, **NO_RETRY}}
    if trim:
        heads = {ref.snapshot_id for ref in md.refs.values()}
        update.update(snapshots=[s for s in md.snapshots if s.snapshot_id in heads],
                      snapshot_log=[], metadata_log=[])
    return TableCls(tbl.name(), md.model_copy(update=update), tbl.metadata_location,
                    tbl.io, tbl.catalog)


def split_table(table: str) -> tuple[str, ...]:
    parts = tuple(table.split(".")) if isinstance(table, str) else ()
    if len(parts) < 2 or not all(_IDENT.match(p) for p in parts):
        raise InvalidRequest(
            f"invalid Iceberg table {table!r}: use 'namespace.name' (each part 1-128 "
            "characters from A-Z a-z 0-9 _ -; nested namespaces as 'a.b.name')"
        )
    return parts


def partition_fields(partition_by: Iterable[str] | None) -> tuple[tuple[str, str], ...]:
    """``["country", "day(ts)"]`` -> ``(("identity", "country"), ("day", "ts"))``."""
    out = []
    for spec in partition_by or ():
        m = _TRANSFORM.match(spec.strip()) if isinstance(spec, str) else None
        transform, column = (m["t"], m["c"].strip()) if m else ("identity", str(spec).strip())
        if not _IDENT.match(column):
            raise InvalidRequest(
                f"invalid partition field {spec!r}: name a column, or identity(col), "
                "day(col), month(col), year(col), hour(col)"
            )
        out.append((transform, column))
    return tuple(out)


@dataclass(frozen=True)
class Marker:
    """What the snapshot history says about one sink's batches."""

    attempts: dict[tuple[str, int], tuple[int, frozenset[int] | None]]
    """(lineage, batch) -> (attempt, partitions) of the snapshot that committed it"""
    top: dict[str, int]  # lineage -> highest committed batch
    snapshots: dict[tuple[str, int], int]  # (lineage, batch) -> snapshots carrying it

    def committed(self, lineage: str, batch: int) -> int | None:
        """The attempt that committed the batch, ``UNKNOWN`` when only a later batch of
        the lineage shows it committed (its own snapshot expired), None when not."""
        if (lineage, batch) in self.attempts:
            return self.attempts[(lineage, batch)][0]
        if self.top.get(lineage, -1) > batch:
            return UNKNOWN
        return None

    def referenced(self, lineage: str, batch: int, attempt: int, partition: int) -> bool:
        """True when the snapshot of the batch took this branch's files (or may have:
        its snapshot expired), so they are the table's and never deleted."""
        done = self.committed(lineage, batch)
        if done == UNKNOWN:
            return True
        parts = self.attempts[(lineage, batch)][1] if done is not None else None
        return done == attempt and (parts is None or partition in parts)

