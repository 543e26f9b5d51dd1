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

__all__ = ["VERSION", "rows_digest"]

VERSION = "b2s1"
_MOD = 1 << 128


def rows_digest(schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> str:
    """``b2s1:<rows>:<sum of row hashes, 32 hex digits>`` of ``batches``."""
    header = repr([(f.name, str(f.type)) for f in schema]).encode()
    base = hashlib.blake2b(header, digest_size=16)
    total, rows = 0, 0
    for batch in batches:
        columns = [c.to_pylist() for c in batch.columns]
        for row in zip(*columns, strict=True):
            h = base.copy()
            h.update(repr(row).encode("utf-8", "surrogatepass"))
            total += int.from_bytes(h.digest(), "big")
        rows += batch.num_rows
    return f"{VERSION}:{rows}:{total % _MOD:032x}"
