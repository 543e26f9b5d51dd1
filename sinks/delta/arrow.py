"""The stream's Arrow data in the Delta table's terms: its schema as Delta stores it,
rows conformed to the table's schema, split by the table's partition values."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["arrow_schema_of", "conform", "delta_schema", "partition_value", "partitionable",
           "pyarrow_module", "split_by_partition"]


def pyarrow_module() -> Any:
    import pyarrow as pa

    return pa


def delta_schema(schema: pa.Schema) -> pa.Schema:
    """The stream's Arrow schema as Delta stores it: timestamps with a zone become UTC
    (the same instants; Delta's ``timestamp`` is UTC), without one ``timestamp_ntz``
    (microseconds), nested types alike."""
    pa = pyarrow_module()
    return pa.schema([pa.field(f.name, _delta_type(f.type), f.nullable) for f in schema])


def _delta_type(t: Any) -> Any:
    pa = pyarrow_module()
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz="UTC" if t.tz else None)
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(pa.field(t.value_field.name, _delta_type(t.value_type),
                                 t.value_field.nullable))
    if pa.types.is_map(t):
        return pa.map_(_delta_type(t.key_type),
                       pa.field("value", _delta_type(t.item_type), t.item_field.nullable))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _delta_type(f.type), f.nullable) for f in t])
    return t


def arrow_schema_of(dt: Any) -> pa.Schema:
    return pyarrow_module().schema(dt.schema().to_arrow())


def partitionable(t: Any) -> bool:
    pa = pyarrow_module()
    return bool(pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_boolean(t)
                or pa.types.is_date32(t))


def partition_value(v: Any) -> str | None:
    """Delta's partition value serialization; an empty string is null, as in Spark."""
    if v is None or v == "":
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if hasattr(v, "isoformat"):
        return str(v.isoformat())
    return str(v)


def split_by_partition(batch: pa.RecordBatch, parts: list[str]
           ) -> Iterator[tuple[dict[str, str | None], pa.RecordBatch]]:
    """The batch's rows per value of the table's partition columns, without those columns
    (Delta keeps partition values in the log, not in the data files)."""
    if not parts:
        yield {}, batch
        return
    import pyarrow.compute as pc

    pa = pyarrow_module()
    keep = [n for n in batch.schema.names if n not in parts]
    combos = pa.Table.from_batches([batch]).select(parts).group_by(
        parts, use_threads=False).aggregate([]).to_pylist()
    for combo in combos:
        mask = None
        for c in parts:
            col, v = batch.column(c), combo[c]
            m = pc.is_null(col) if v is None else \
                pc.fill_null(pc.equal(col, pa.scalar(v, col.type)), False)
            mask = m if mask is None else pc.and_(mask, m)
        yield {c: partition_value(combo[c]) for c in parts}, batch.filter(mask).select(keep)




def conform(batch: pa.RecordBatch, target: pa.Schema) -> pa.RecordBatch:
    """The batch in the table's schema: its column order and types (same instants for
    timestamps), nulls for nullable table columns the stream lacks."""
    pa = pyarrow_module()
    cols = []
    for f in target:
        if f.name in batch.schema.names:
            col = batch.column(f.name)
            cols.append(col if col.type == f.type else col.cast(f.type))
        else:
            cols.append(pa.nulls(batch.num_rows, f.type))
    return pa.RecordBatch.from_arrays(cols, schema=target)

