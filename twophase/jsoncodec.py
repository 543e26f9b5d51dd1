"""Rows of an Arrow record batch as JSON objects, one stable encoding for every sink.

JSON lines files and Kafka values use the same bytes for the same row, so a consumer
can compare outputs across systems and a replayed batch produces identical messages.
Encodings (chosen to be lossless and locale-free):

- integers, booleans, strings: JSON numbers, booleans, strings; NULL is ``null``;
- floats: JSON numbers; NaN and +/-infinity have no JSON form and raise ``ValueError``
  naming the column and row (a silent ``NaN`` token would break strict readers);
- timestamps: ISO-8601 in UTC with a ``Z`` suffix, fraction digits per the unit
  (``2024-01-02T03:04:05.123456Z``); a timestamp without a time zone is taken as UTC;
- dates ``YYYY-MM-DD``; times ``HH:MM:SS[.ffffff]``;
- decimals as strings in plain notation (``"12.50"``), never floats: no rounding;
- binary as standard base64 strings;
- lists, structs and maps recursively (maps as ``[[key, value], ...]``).

Pure: no I/O, no global state.
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import json
import math
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

from twophase.errors import InvalidRequest

__all__ = ["encode_value", "json_rows", "rows_to_json_lines"]

_ENCODER = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, separators=(",", ":"), check_circular=False
)


def encode_value(value: Any) -> Any:
    """One Python value (as ``to_pylist`` returns it) to a JSON-ready value.

    Raises ``ValueError`` for values JSON cannot carry (NaN, infinity).
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequest(f"{value!r} has no JSON encoding")
        return value
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise InvalidRequest(f"decimal {value!r} has no JSON encoding")
        return format(value, "f")
    if isinstance(value, _dt.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(_dt.timezone.utc).replace(tzinfo=None)
        return value.isoformat() + "Z"
    if isinstance(value, (_dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, _dt.timedelta):
        return value.total_seconds()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, dict):
        return {str(k): encode_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_value(v) for v in value]
    raise InvalidRequest(f"values of type {type(value).__name__} have no JSON encoding")


def _column_values(name: str, column: pa.Array) -> list[Any]:
    """A column as JSON-ready Python values, vectorised where Arrow can do it."""
    typ = column.type
    if pat.is_dictionary(typ):
        column = column.dictionary_decode()
        typ = column.type
    if pat.is_floating(typ):
        finite = pc.is_finite(column)
        bad = pc.and_kleene(pc.is_valid(column), pc.invert(finite))
        if pc.any(bad).as_py():
            row = pc.index(bad, True).as_py()
            raise InvalidRequest(
                f"column {name!r} row {row}: {column[row].as_py()!r} has no JSON encoding "
                "(NaN and infinity are not JSON numbers)"
            )
        return column.to_pylist()  # type: ignore[no-any-return]
    if pat.is_integer(typ) or pat.is_boolean(typ) or pat.is_string(typ) or pat.is_large_string(
        typ
    ) or pat.is_null(typ):
        return column.to_pylist()  # type: ignore[no-any-return]
    if pat.is_timestamp(typ):
        utc = column.cast(pa.timestamp(typ.unit, "UTC"))
        return pc.strftime(utc, format="%Y-%m-%dT%H:%M:%SZ").to_pylist()  # type: ignore[no-any-return]
    if pat.is_date(typ):
        return pc.strftime(column, format="%Y-%m-%d").to_pylist()  # type: ignore[no-any-return]
    values = column.to_pylist()
    out: list[Any] = []
    for row, value in enumerate(values):
        try:
            out.append(encode_value(value))
        except ValueError as exc:
            raise InvalidRequest(f"column {name!r} row {row}: {exc}") from None
    return out


def json_rows(batch: pa.RecordBatch) -> Iterator[bytes]:
    """One compact UTF-8 JSON object per row, keys in column order.

    Raises ``ValueError`` naming the column and row of the first value JSON cannot carry,
    before yielding anything.
    """
    names = batch.schema.names
    if len(set(names)) != len(names):
        raise InvalidRequest(f"duplicate column names {names!r}: a JSON object needs unique keys")
    columns = [_column_values(n, batch.column(i)) for i, n in enumerate(names)]
    encode = _ENCODER.encode
    if not columns:
        for _ in range(batch.num_rows):
            yield b"{}"
        return
    for values in zip(*columns, strict=True):
        yield encode(dict(zip(names, values, strict=True))).encode("utf-8")


def rows_to_json_lines(batch: pa.RecordBatch) -> bytes:
    """The whole batch as JSON lines (each object followed by ``\\n``)."""
    return b"".join(line + b"\n" for line in json_rows(batch))
