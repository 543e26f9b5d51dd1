"""Arrow schema -> SQLAlchemy columns, and the check of an existing table against it.

One fixed vocabulary of column types (no user text reaches a type). A type with no SQL
column here is refused by name with the fix, before anything is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import pyarrow as pa
import sqlalchemy as sa
from sqlalchemy.dialects import mysql

__all__ = ["UnsupportedType", "family_of_arrow", "misfits", "sql_type_for"]

KEY_STRING_LENGTH = 255
"""A string key column is VARCHAR(255): MySQL cannot index an unbounded TEXT."""


class UnsupportedType(ValueError):
    """An Arrow type that has no SQL column type in this participant."""


def sql_type_for(field: pa.Field, *, key: bool = False) -> sa.types.TypeEngine[Any]:
    t = field.type
    if pa.types.is_boolean(t):
        return sa.Boolean(create_constraint=False)
    if pa.types.is_int8(t) or pa.types.is_int16(t) or pa.types.is_uint8(t):
        return sa.SmallInteger()
    if pa.types.is_int32(t) or pa.types.is_uint16(t):
        return sa.Integer()
    if pa.types.is_int64(t) or pa.types.is_uint32(t):
        return sa.BigInteger()
    if pa.types.is_uint64(t):
        return sa.Numeric(20, 0)
    if pa.types.is_float16(t) or pa.types.is_float32(t):
        return sa.Float(24)
    if pa.types.is_float64(t):
        return sa.Double()
    if pa.types.is_decimal(t):
        return sa.Numeric(t.precision, t.scale)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or _is_string_view(t):
        if key:
            return sa.String(KEY_STRING_LENGTH)
        return sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        if key:
            return sa.LargeBinary(KEY_STRING_LENGTH).with_variant(
                mysql.VARBINARY(KEY_STRING_LENGTH), "mysql", "mariadb")
        return sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")
    if pa.types.is_date(t):
        return sa.Date()
    if pa.types.is_timestamp(t):
        return sa.DateTime(timezone=t.tz is not None).with_variant(
            mysql.DATETIME(fsp=6), "mysql", "mariadb")
    raise UnsupportedType(
        f"column {field.name!r} has Arrow type {t}, which has no SQL column type here "
        "(supported: booleans, integers, floats, decimals, strings, binary, dates, "
        "timestamps); convert it before the sink, e.g. to_json(col) for lists, structs "
        "and maps, or cast(col as string)"
    )


def _is_string_view(t: pa.DataType) -> bool:
    f = getattr(pa.types, "is_string_view", None)
    return bool(f and f(t))


def family_of_arrow(t: pa.DataType) -> str:
    if pa.types.is_boolean(t) or pa.types.is_integer(t):
        return "integer"
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_timestamp(t):
        return "datetime"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "binary"
    return "string"


def _family_of_sql(t: sa.types.TypeEngine[Any]) -> str | None:
    try:
        py = t.python_type
    except NotImplementedError:
        return None
    if py is bool or py is int:
        return "integer"
    if py in (float, Decimal):
        return "number"
    if py is datetime:
        return "datetime"
    if py is date:
        return "date"
    if py is bytes:
        return "binary"
    if py is str:
        return "string"
    return None


_FITS = {
    "integer": {"integer", "number"},  # an int column may go to DECIMAL or DOUBLE
    "number": {"number"},
    "datetime": {"datetime"},
    "date": {"date", "datetime"},
    "binary": {"binary"},
    "string": {"string"},
}


def misfits(schema: pa.Schema, columns: Sequence[dict[str, Any]]) -> list[str]:
    """What keeps rows of ``schema`` out of a table with these reflected ``columns``."""
    have = {c["name"]: c for c in columns}
    problems = []
    for field in schema:
        col = have.get(field.name)
        if col is None:
            problems.append(f"column {field.name!r} is in the data but not in the table")
            continue
        family = _family_of_sql(col["type"])
        want = family_of_arrow(field.type)
        if family is not None and family not in _FITS[want]:
            problems.append(
                f"column {field.name!r} is {col['type']} in the table but {field.type} "
                "in the data"
            )
    for name, col in have.items():
        if (name not in schema.names and not col.get("nullable", True)
                and col.get("default") is None and col.get("autoincrement") is not True):
            problems.append(
                f"table column {name!r} is NOT NULL without a default and the data has "
                "no such column"
            )
    return problems
