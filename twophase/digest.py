"""An order-independent content digest of a partition's rows, carried by the vote.

Why: a branch lost after the COMMIT decision (a Kafka transaction dies with its producer)
is *redone* from the replayed micro-batch. That is exactly-once only if the replay has
the same rows as the vote. A row count misses a changed value; this digest does not:
each row is hashed (BLAKE2b, 128 bits) over a canonical serialization (the ``repr`` of
its Python values, in column order, after the column names and types) and the hashes
are added modulo 2**128, so the row order (which a replay need not keep) does not
matter while every row, including a repeated one, does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["VERSION", "RowsDigest", "rows_digest", "same_kind"]

VERSION = "b2s1"
_MOD = 1 << 128


class RowsDigest:
    """The digest built up batch by batch, so a task streaming its partition into the
    participants never holds it whole to compute the digest of its vote."""

    def __init__(self, schema: pa.Schema) -> None:
        header = repr([(f.name, str(f.type)) for f in schema]).encode()
        self._base = hashlib.blake2b(header, digest_size=16)
        self._total = 0
        self.rows = 0

    def update(self, batch: pa.RecordBatch) -> None:
        columns = [c.to_pylist() for c in batch.columns]
        for row in zip(*columns, strict=True):
            h = self._base.copy()
            h.update(repr(row).encode("utf-8", "surrogatepass"))
            self._total += int.from_bytes(h.digest(), "big")
        self.rows += batch.num_rows

    def value(self) -> str:
        """``b2s1:<rows>:<sum of row hashes, 32 hex digits>``."""
        return f"{VERSION}:{self.rows}:{self._total % _MOD:032x}"


def rows_digest(schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> str:
    """``b2s1:<rows>:<sum of row hashes, 32 hex digits>`` of ``batches``."""
    digest = RowsDigest(schema)
    for batch in batches:
        digest.update(batch)
    return digest.value()


def same_kind(a: str, b: str) -> bool:
    """Whether two digests were made the same way (comparable): a vote from another
    version's algorithm cannot be checked against this one's."""
    return a.split(":", 1)[0] == b.split(":", 1)[0]
