"""Arrow <-> PostgreSQL: column types, table fit, and the COPY payload.

Why CSV built by pyarrow: measured in ``bench/participants.py`` (``copy_methods``
section), ``pyarrow.csv.write_csv`` into ``COPY ... FROM STDIN (FORMAT csv)`` is several
times faster than psycopg's ``Copy.write_row`` per row, because the whole batch is
formatted column-wise in C++ with no Python object per value, and the server parses CSV
about as fast as text format. Binary COPY would need per-value Python packing again.
Round-trip rules the CSV relies on (tested in
``tests/sinks/postgres/test_postgres_participant.py``):

- NULL is an unquoted empty field; Arrow quotes every string, so ``""`` is an empty string;
- quotes, commas and newlines inside strings are quoted by Arrow the CSV way;
- timestamps with a zone end in ``Z``; the session runs with ``TimeZone=UTC`` so naive
  timestamps are read as UTC too;
- floats use the shortest round-trip form (``nan``, ``inf``, ``-inf`` are accepted by
  PostgreSQL);
- binary columns are turned into bytea hex text (``\\x...``) first: raw bytes are not CSV;
- nested columns (``nested="json"``, the default): a struct or a map becomes ``jsonb`` (JSON
  text per value; a map's keys become strings), a list of a scalar type becomes that
  type's PostgreSQL array (array literal text, ``{1,NULL,3}``), a list of nested values
  ``jsonb``, as most tools store them. In JSON, NaN and infinities become the strings
  ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, decimals, dates and timestamps strings, bytes
  ``"\\x..."`` hex strings. ``nested="refuse"`` refuses nested columns instead.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Final, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.types as pat

from twophase.errors import InvalidRequest

__all__ = [
    "NESTED_POLICIES",
    "ExistingColumn",
    "Nested",
    "UnsupportedType",
    "csv_chunks",
    "pg_type_for",
    "table_misfits",
]

CHUNK_ROWS = 65_536
"""Rows per CSV chunk handed to COPY: bounds memory, large enough to amortise calls."""

_WRITE = pacsv.WriteOptions(include_header=False, batch_size=CHUNK_ROWS)

Nested = Literal["json", "refuse"]
NESTED_POLICIES: Final = ("json", "refuse")


class UnsupportedType(InvalidRequest):
    """An Arrow type with no PostgreSQL column type in the mapping."""


@dataclass(frozen=True)
class ExistingColumn:
    name: str
    type: str  # format_type(): e.g. "bigint", "numeric(12,2)", "timestamp with time zone"
    not_null: bool
    has_default: bool


def _scalar_type(t: pa.DataType) -> str | None:
    """The PostgreSQL type of a non-nested Arrow type, None when there is none."""
    if pat.is_dictionary(t):
        t = t.value_type
    if pat.is_int64(t) or pat.is_uint32(t):
        return "bigint"
    if pat.is_int32(t) or pat.is_uint16(t):
        return "integer"
    if pat.is_int16(t) or pat.is_int8(t) or pat.is_uint8(t):
        return "smallint"
    if pat.is_float64(t):
        return "double precision"
    if pat.is_float32(t) or pat.is_float16(t):
        return "real"
    if pat.is_string(t) or pat.is_large_string(t):
        return "text"
    if pat.is_boolean(t):
        return "boolean"
    if pat.is_timestamp(t):
        return "timestamp with time zone"
    if pat.is_date(t):
        return "date"
    if pat.is_decimal(t):
        return f"numeric({t.precision},{t.scale})"
    if pat.is_binary(t) or pat.is_large_binary(t) or pat.is_fixed_size_binary(t):
        return "bytea"
    return None


def _is_list(t: pa.DataType) -> bool:
    return bool(pat.is_list(t) or pat.is_large_list(t) or pat.is_fixed_size_list(t))


def _is_nested(t: pa.DataType) -> bool:
    return bool(_is_list(t) or pat.is_struct(t) or pat.is_map(t))


def _as_array(t: pa.DataType) -> bool:
    """A list whose elements have a scalar PostgreSQL type: stored as that type's array."""
    return _is_list(t) and _scalar_type(t.value_type) is not None


def pg_type_for(field: pa.Field, nested: Nested = "json") -> str:
    """The column type a missing table is created with."""
    t = field.type.value_type if pat.is_dictionary(field.type) else field.type
    scalar = _scalar_type(t)
    if scalar is not None:
        return scalar
    if _is_nested(t):
        if nested == "refuse":
            raise UnsupportedType(
                f"column {field.name!r} has the nested Arrow type {t}, and nested='refuse' "
                "refuses nested columns: flatten or serialize it before the sink (e.g. "
                "to_json), or pass nested='json' to store structs and maps as jsonb and "
                "lists as arrays"
            )
        if _as_array(t):
            return f"{_scalar_type(t.value_type)}[]"
        return "jsonb"
    raise UnsupportedType(
        f"column {field.name!r} has Arrow type {t} which has no PostgreSQL mapping "
        "(supported: integers, floats, string, bool, timestamp, date, decimal, binary, "
        "and with nested='json' structs, maps and lists): cast it before the sink"
    )


_INTS = {"smallint": 2, "integer": 4, "bigint": 8}


def _accepts(pg: str, field: pa.Field, nested: Nested = "json") -> bool:
    """Can every value of the Arrow field be stored in a column of type ``pg``?"""
    t = field.type.value_type if pat.is_dictionary(field.type) else field.type
    want = pg_type_for(field, nested)
    if pg == want:
        return True
    if want == "jsonb":
        return pg == "json"
    if pat.is_integer(t):
        width = _INTS.get(want, 8)
        return (pg in _INTS and _INTS[pg] >= width) or pg == "numeric" or (
            pg.startswith("numeric(") and _numeric_digits(pg)[0] - _numeric_digits(pg)[1] >= 19
        )
    if pat.is_floating(t):
        return pg == "double precision"
    if pat.is_string(t) or pat.is_large_string(t):
        return pg in ("text", "character varying") or pg.startswith("character varying(")
    if pat.is_timestamp(t):
        return bool(t.tz is None and pg == "timestamp without time zone")
    if pat.is_decimal(t):
        if pg == "numeric":
            return True
        if pg.startswith("numeric("):
            p, s = _numeric_digits(pg)
            return bool(s == t.scale and p - s >= t.precision - t.scale)
        return False
    return False


def _numeric_digits(pg: str) -> tuple[int, int]:
    inner = pg[len("numeric(") : -1]
    p, _, s = inner.partition(",")
    return int(p), int(s or 0)


def table_misfits(
    schema: pa.Schema, columns: list[ExistingColumn], nested: Nested = "json"
) -> list[str]:
    """Every reason the existing table cannot take rows of ``schema`` (empty: it fits)."""
    by_name = {c.name: c for c in columns}
    problems: list[str] = []
    for field in schema:
        col = by_name.get(field.name)
        if col is None:
            problems.append(f"column {field.name!r} is missing from the table")
            continue
        try:
            ok = _accepts(col.type, field, nested)
        except UnsupportedType as exc:
            problems.append(str(exc))
            continue
        if not ok:
            problems.append(
                f"column {field.name!r} is {col.type} in the table but the data is Arrow "
                f"{field.type} (expected {pg_type_for(field, nested)})"
            )
    names = set(schema.names)
    for col in columns:
        if col.name not in names and col.not_null and not col.has_default:
            problems.append(
                f"table column {col.name!r} is NOT NULL without a default but the data has "
                "no such column"
            )
    return problems


def _hex_bytea(column: pa.Array) -> pa.Array:
    return pa.array(
        [None if v is None else "\\x" + v.hex() for v in column.to_pylist()], pa.string()
    )


def _jsonable(value: Any, t: pa.DataType) -> Any:
    """A Python value of Arrow type ``t`` as plain JSON data (see the module docstring)."""
    if value is None:
        return None
    if pat.is_dictionary(t):
        t = t.value_type
    if pat.is_struct(t):
        return {t.field(i).name: _jsonable(value.get(t.field(i).name), t.field(i).type)
                for i in range(t.num_fields)}
    if pat.is_map(t):
        return {k if isinstance(k, str) else json.dumps(_jsonable(k, t.key_type)):
                _jsonable(v, t.item_type) for k, v in value}
    if _is_list(t):
        return [_jsonable(v, t.value_type) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (bytes, bytearray)):
        return "\\x" + bytes(value).hex()
    if isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)  # Decimal, timedelta: their exact text


def _array_item(value: Any) -> str:
    """One element of a PostgreSQL array literal."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        return repr(value) if math.isfinite(value) else (
            "Infinity" if value > 0 else "-Infinity")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        text = "\\x" + bytes(value).hex()
    elif hasattr(value, "isoformat"):
        text = value.isoformat()
    else:
        text = str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _nested_text(column: pa.Array) -> pa.Array:
    """A nested column as the text PostgreSQL reads into its column: an array literal
    for a list of scalars, JSON otherwise."""
    t = column.type
    values = column.to_pylist()
    if _as_array(t):
        return pa.array([None if v is None else "{" + ",".join(map(_array_item, v)) + "}"
                         for v in values], pa.string())
    return pa.array([None if v is None else json.dumps(_jsonable(v, t), ensure_ascii=False,
                                                       allow_nan=False)
                     for v in values], pa.string())


def _prepare_for_csv(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Replace columns whose Arrow CSV form PostgreSQL cannot read."""
    arrays: list[pa.Array] = []
    changed = False
    for column in batch.columns:
        t = column.type
        if pat.is_dictionary(t):
            column, t, changed = column.dictionary_decode(), column.type.value_type, True
        if pat.is_binary(t) or pat.is_large_binary(t) or pat.is_fixed_size_binary(t):
            column, changed = _hex_bytea(column), True
        elif _is_nested(t):
            column, changed = _nested_text(column), True
        elif pat.is_large_string(t):
            column, changed = pc.cast(column, pa.string()), True
        arrays.append(column)
    if not changed:
        return batch
    return pa.RecordBatch.from_arrays(arrays, names=batch.schema.names)


def csv_chunks(batch: pa.RecordBatch) -> list[pa.Buffer]:
    """The batch as CSV buffers for ``COPY ... (FORMAT csv)``, at most CHUNK_ROWS each."""
    batch = _prepare_for_csv(batch)
    out: list[pa.Buffer] = []
    for offset in range(0, batch.num_rows, CHUNK_ROWS):
        sink = pa.BufferOutputStream()
        pacsv.write_csv(batch.slice(offset, CHUNK_ROWS), sink, _WRITE)
        out.append(sink.getvalue())
    return out
