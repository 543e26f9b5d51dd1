"""The shared JSON row encoding: stable, lossless, and loud about what JSON cannot carry."""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json

import pyarrow as pa
import pytest

from twophase.jsoncodec import encode_value, json_rows, rows_to_json_lines


def _batch(**cols: pa.Array) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(list(cols.values()), names=list(cols))


def test_scalar_types_round_trip_with_stable_encodings() -> None:
    batch = _batch(
        i=pa.array([1, None, -(2**62)], pa.int64()),
        f=pa.array([1.5, None, -0.25]),
        s=pa.array(['a "quoted"\nline', None, "ünï"]),
        b=pa.array([True, False, None]),
        ts=pa.array(
            [dt.datetime(2024, 1, 2, 3, 4, 5, 123456), None, dt.datetime(1970, 1, 1)],
            pa.timestamp("us", tz="UTC"),
        ),
        d=pa.array([dt.date(2024, 2, 29), None, dt.date(1, 1, 1)]),
        dec=pa.array(
            [decimal.Decimal("12.50"), None, decimal.Decimal("0.00")], pa.decimal128(10, 2)
        ),
        bin=pa.array([b"\x00\xff", None, b""]),
    )
    rows = [json.loads(line) for line in json_rows(batch)]
    assert rows[0] == {
        "i": 1,
        "f": 1.5,
        "s": 'a "quoted"\nline',
        "b": True,
        "ts": "2024-01-02T03:04:05.123456Z",
        "d": "2024-02-29",
        "dec": "12.50",
        "bin": base64.b64encode(b"\x00\xff").decode(),
    }
    assert rows[1] == {k: None for k in rows[0]} | {"b": False}
    assert rows[2]["i"] == -(2**62)
    assert rows[2]["s"] == "ünï"
    assert rows[2]["ts"] == "1970-01-01T00:00:00.000000Z"
    assert rows[2]["dec"] == "0.00"
    assert rows[2]["bin"] == ""


def test_output_is_compact_utf8_and_keys_keep_column_order() -> None:
    batch = _batch(z=pa.array([1]), a=pa.array(["é"]))
    (line,) = list(json_rows(batch))
    assert line == '{"z":1,"a":"é"}'.encode()
    assert rows_to_json_lines(batch) == line + b"\n"


def test_timestamps_in_other_zones_are_written_in_utc() -> None:
    ts = pa.array([dt.datetime(2024, 6, 1, 12, 0, tzinfo=dt.timezone.utc)], pa.timestamp("ms"))
    paris = ts.cast(pa.timestamp("ms", tz="Europe/Paris"))
    (line,) = list(json_rows(_batch(t=paris)))
    assert json.loads(line) == {"t": "2024-06-01T12:00:00.000Z"}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_floats_raise_naming_column_and_row(bad: float) -> None:
    batch = _batch(ok=pa.array([1, 2, 3]), price=pa.array([1.0, None, bad]))
    with pytest.raises(ValueError, match=r"column 'price' row 2"):
        list(json_rows(batch))


def test_nested_values_are_encoded_recursively() -> None:
    batch = _batch(
        tags=pa.array([["a", "b"], None]),
        st=pa.array(
            [{"x": 1, "when": dt.date(2020, 1, 1)}, None],
            pa.struct([("x", pa.int32()), ("when", pa.date32())]),
        ),
    )
    rows = [json.loads(line) for line in json_rows(batch)]
    assert rows == [
        {"tags": ["a", "b"], "st": {"x": 1, "when": "2020-01-01"}},
        {"tags": None, "st": None},
    ]


def test_nan_inside_a_list_is_refused_with_its_position() -> None:
    batch = _batch(v=pa.array([[1.0], [2.0, float("nan")]]))
    with pytest.raises(ValueError, match=r"column 'v' row 1"):
        list(json_rows(batch))


def test_encode_value_decimal_is_plain_notation() -> None:
    assert encode_value(decimal.Decimal("1E+3")) == "1000"
    assert encode_value(decimal.Decimal("0E-10")) == "0.0000000000"
    with pytest.raises(ValueError):
        encode_value(decimal.Decimal("NaN"))


def test_duplicate_column_names_are_refused() -> None:
    batch = pa.RecordBatch.from_arrays([pa.array([1]), pa.array([2])], names=["a", "a"])
    with pytest.raises(ValueError, match="duplicate column"):
        list(json_rows(batch))


def test_empty_batch_yields_nothing() -> None:
    assert list(json_rows(_batch(a=pa.array([], pa.int64())))) == []
