"""The redo guard's content digest (twophase.digest): row order does not matter, every
row and every value does."""

from __future__ import annotations

import datetime as dt
import decimal
import random

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from twophase.digest import rows_digest

SCHEMA = pa.schema([("id", pa.int64()), ("label", pa.string()), ("x", pa.float64())])
ROWS = st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), st.one_of(st.none(), st.text()),
                          st.one_of(st.none(), st.floats(allow_nan=True))),
                min_size=1, max_size=30)


Row = tuple[int, "str | None", "float | None"]


def _batches(rows: list[Row], cut: int = 0) -> list[pa.RecordBatch]:
    cols = list(zip(*rows, strict=True))
    arrays = [pa.array(list(c), f.type) for c, f in zip(cols, SCHEMA, strict=True)]
    table = pa.Table.from_arrays(arrays, schema=SCHEMA)
    if cut and cut < table.num_rows:
        return table.slice(0, cut).to_batches() + table.slice(cut).to_batches()
    return table.to_batches()


@settings(max_examples=30, deadline=None)
@given(ROWS, st.randoms(use_true_random=False), st.integers(0, 30))
def test_order_and_batching_do_not_matter(rows, rnd: random.Random, cut: int) -> None:  # type: ignore[no-untyped-def]
    shuffled = list(rows)
    rnd.shuffle(shuffled)
    assert rows_digest(SCHEMA, _batches(rows)) == rows_digest(SCHEMA, _batches(shuffled, cut))


@settings(max_examples=30, deadline=None)
@given(ROWS, st.data())
def test_a_changed_dropped_or_repeated_row_changes_it(rows, data) -> None:  # type: ignore[no-untyped-def]
    base = rows_digest(SCHEMA, _batches(rows))
    i = data.draw(st.integers(0, len(rows) - 1))
    changed = list(rows)
    rid, label, x = changed[i]
    changed[i] = (rid, (label or "") + "!", x)
    assert rows_digest(SCHEMA, _batches(changed)) != base
    assert rows_digest(SCHEMA, _batches([*rows, rows[i]])) != base  # a repeated row counts
    if len(rows) > 1:
        assert rows_digest(SCHEMA, _batches(rows[:i] + rows[i + 1:])) != base


def test_types_and_schema_are_part_of_it() -> None:
    one = pa.record_batch({"id": [1]}, schema=pa.schema([("id", pa.int64())]))
    as_int32 = pa.record_batch({"id": [1]}, schema=pa.schema([("id", pa.int32())]))
    renamed = pa.record_batch({"key": [1]}, schema=pa.schema([("key", pa.int64())]))
    digests = {rows_digest(b.schema, [b]) for b in (one, as_int32, renamed)}
    assert len(digests) == 3
    rich = pa.record_batch({
        "t": pa.array([dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone.utc)],
                      pa.timestamp("us", "UTC")),
        "d": pa.array([decimal.Decimal("1.50")], pa.decimal128(10, 2)),
        "b": pa.array([b"\x00\xff"], pa.binary()),
        "l": pa.array([[1, None]], pa.list_(pa.int64())),
    })
    d = rows_digest(rich.schema, [rich])
    assert d.startswith("b2s1:1:") and d == rows_digest(rich.schema, [rich])
    assert rows_digest(SCHEMA, []) == "b2s1:0:" + "0" * 32
