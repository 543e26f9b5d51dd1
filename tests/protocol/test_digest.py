"""The redo guard's content digest (twophase.digest): row order does not matter, every
row and every value does."""

from __future__ import annotations

import datetime as dt
import decimal
import random

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twophase.digest import KINDS, LEGACY, VERSION, make_digest, rows_digest

SCHEMA = pa.schema([("id", pa.int64()), ("label", pa.string()), ("x", pa.float64())])
ROWS = st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), st.one_of(st.none(), st.text()),
                          st.one_of(st.none(), st.floats(allow_nan=True))),
                min_size=1, max_size=30)


Row = tuple[int, "str | None", "float | None"]
_digest = rows_digest


def _batches(rows: list[Row], cut: int = 0) -> list[pa.RecordBatch]:
    cols = list(zip(*rows, strict=True))
    arrays = [pa.array(list(c), f.type) for c, f in zip(cols, SCHEMA, strict=True)]
    table = pa.Table.from_arrays(arrays, schema=SCHEMA)
    if cut and cut < table.num_rows:
        return table.slice(0, cut).to_batches() + table.slice(cut).to_batches()
    return table.to_batches()


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=30, deadline=None)
@given(rows=ROWS, rnd=st.randoms(use_true_random=False), cut=st.integers(0, 30))
def test_order_and_batching_do_not_matter(rows, rnd: random.Random, cut: int, kind: str) -> None:  # type: ignore[no-untyped-def]
    shuffled = list(rows)
    rnd.shuffle(shuffled)
    assert (rows_digest(SCHEMA, _batches(rows), kind)
            == rows_digest(SCHEMA, _batches(shuffled, cut), kind))


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=30, deadline=None)
@given(rows=ROWS, data=st.data())
def test_a_changed_dropped_or_repeated_row_changes_it(rows, data, kind: str) -> None:  # type: ignore[no-untyped-def]
    def rows_digest(schema: pa.Schema, batches: list[pa.RecordBatch]) -> str:
        return _digest(schema, batches, kind)

    base = rows_digest(SCHEMA, _batches(rows))
    i = data.draw(st.integers(0, len(rows) - 1))
    changed = list(rows)
    rid, label, x = changed[i]
    changed[i] = (rid, (label or "") + "!", x)
    assert rows_digest(SCHEMA, _batches(changed)) != base
    assert rows_digest(SCHEMA, _batches([*rows, rows[i]])) != base  # a repeated row counts
    if len(rows) > 1:
        assert rows_digest(SCHEMA, _batches(rows[:i] + rows[i + 1:])) != base


@pytest.mark.parametrize("kind", KINDS)
def test_types_and_schema_are_part_of_it(kind: str) -> None:
    def rows_digest(schema: pa.Schema, batches: list[pa.RecordBatch]) -> str:
        return _digest(schema, batches, kind)

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
    assert d.startswith(f"{kind}:1:") and d == rows_digest(rich.schema, [rich])
    assert rows_digest(SCHEMA, []) == f"{kind}:0:" + "0" * 32
    if kind == LEGACY:  # what older versions stored with their votes, unchanged
        assert d.startswith("b2s1:1:") and d == rows_digest(rich.schema, [rich])
        assert rows_digest(SCHEMA, []) == "b2s1:0:" + "0" * 32


def _wide(n: int, seed: int = 7) -> pa.Table:
    """Every column kind the vectorised digest reads from buffers, nulls included."""
    rng = np.random.default_rng(seed)
    ids = np.arange(n, dtype=np.int64)
    def nulls(values: list[object]) -> list[object]:
        return [None if i % 7 == 3 else v for i, v in enumerate(values)]
    return pa.table({
        "i64": pa.array(ids), "i8": pa.array(nulls(list((ids % 100).tolist())), pa.int8()),
        "u32": pa.array((ids * 7).astype(np.uint32)),
        "f64": pa.array(nulls(list(rng.normal(size=n))), pa.float64()),
        "f32": pa.array(rng.normal(size=n).astype(np.float32)),
        "b": pa.array(nulls([bool(i % 3) for i in range(n)]), pa.bool_()),
        "s": pa.array(nulls([f"label-{i}" * (i % 4) for i in range(n)]), pa.string()),
        "ls": pa.array([f"é{i}" for i in range(n)], pa.large_string()),
        "bin": pa.array(nulls([bytes([i % 256]) * (i % 5) for i in range(n)]), pa.binary()),
        "fsb": pa.array([i.to_bytes(3, "big") for i in range(n)], pa.binary(3)),
        "dec": pa.array(nulls([decimal.Decimal(i) / 100 for i in range(n)]),
                        pa.decimal128(12, 2)),
        "ts": pa.array(ids * 1_000_003, pa.timestamp("us", "UTC")),
        "date": pa.array((ids % 20000).astype(np.int32), pa.date32()),
        "dict": pa.array([f"k{i % 5}" for i in range(n)]).dictionary_encode(),
        "list": pa.array(nulls([[i, None] if i % 2 else [] for i in range(n)]),
                         pa.list_(pa.int64())),
        "nul": pa.nulls(n),
    })


@pytest.mark.parametrize("kind", KINDS)
def test_every_column_kind_ignores_order_slicing_and_batching(kind: str) -> None:
    """Replays hand over sliced arrays (non-zero offsets) in other batch sizes and row
    orders: the digest reads each buffer from the array's offset, so only values count."""
    t = _wide(500)
    base = rows_digest(t.schema, t.to_batches(), kind)
    perm = np.random.default_rng(1).permutation(t.num_rows)
    shuffled = t.take(pa.array(perm)).combine_chunks()
    assert rows_digest(t.schema, shuffled.to_batches(max_chunksize=37), kind) == base
    slices = [shuffled.slice(i, 61).to_batches()[0] for i in range(0, t.num_rows, 61)]
    assert rows_digest(t.schema, slices, kind) == base


@pytest.mark.parametrize("column", [c for c in _wide(1).column_names if c != "nul"])
def test_one_changed_value_in_any_column_changes_it(column: str) -> None:
    """v2: a single value changed (or set to null) in any column kind changes the digest,
    and so does moving a value to another row."""
    t = _wide(200)
    base = rows_digest(t.schema, t.to_batches())
    values = t.column(column).to_pylist()
    donor = next(v for v in values if v is not None and v != values[10])
    for new in (donor, None):
        if values[10] == new:
            continue
        changed = list(values)
        changed[10] = new
        arr = pa.array(changed, t.schema.field(column).type)
        other = t.set_column(t.schema.get_field_index(column), column, arr)
        assert rows_digest(t.schema, other.to_batches()) != base, (column, new)


def test_floats_nan_payloads_are_one_value_and_signed_zero_is_not() -> None:
    schema = pa.schema([("x", pa.float64())])
    quiet = np.array([np.nan], np.float64)
    other_nan = np.array([0x7FF0000000000123], np.uint64).view(np.float64)
    one = rows_digest(schema, [pa.record_batch([pa.array(quiet)], schema=schema)])
    two = rows_digest(schema, [pa.record_batch([pa.array(other_nan)], schema=schema)])
    assert one == two
    zero = rows_digest(schema, [pa.record_batch([pa.array([0.0])], schema=schema)])
    neg = rows_digest(schema, [pa.record_batch([pa.array([-0.0])], schema=schema)])
    assert zero != neg


def test_swapped_values_between_columns_or_rows_change_it() -> None:
    schema = pa.schema([("a", pa.int64()), ("b", pa.int64())])
    def d(a: list[int], b: list[int]) -> str:
        return rows_digest(schema, [pa.record_batch([pa.array(a), pa.array(b)],
                                                    schema=schema)])
    assert d([1, 2], [3, 4]) != d([3, 4], [1, 2])  # columns swapped
    assert d([1, 2], [3, 4]) != d([1, 2], [4, 3])  # rows re-paired
    assert d([1, 2], [3, 4]) == d([2, 1], [4, 3])  # same rows, other order
    s = pa.schema([("s", pa.string())])
    def ds(v: list[str]) -> str:
        return rows_digest(s, [pa.record_batch([pa.array(v)], schema=s)])
    assert ds(["ab", "c"]) != ds(["a", "bc"])  # bytes moved across a value boundary
    assert ds(["ab"]) != ds(["ba"]) and ds([""]) != ds(["\x00"])


def test_the_streaming_digest_is_the_kind_stored_with_votes() -> None:
    assert VERSION == "v2" and make_digest(SCHEMA).value() == "v2:0:" + "0" * 32
    with pytest.raises(ValueError, match="unknown content digest kind 'v9'"):
        make_digest(SCHEMA, "v9")
