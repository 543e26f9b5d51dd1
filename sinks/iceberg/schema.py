"""The Iceberg table against the stream: created from its schema when missing, its
partition spec and column types checked (or its columns added, ``add_columns``)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from twophase.errors import InvalidRequest

if TYPE_CHECKING:
    import pyarrow as pa
    from pyiceberg.table import Table

    from twophase.sinks.iceberg.participant import IcebergParticipant

__all__ = ["check_spec", "create", "fit"]


def create(part: IcebergParticipant, schema: pa.Schema) -> Table:
    """The namespace and table from the stream's schema, with the sink's partition spec."""
    from pyiceberg.exceptions import NamespaceAlreadyExistsError
    from pyiceberg.partitioning import PartitionField
    from pyiceberg.schema import Schema
    from pyiceberg.transforms import parse_transform
    from pyiceberg.types import NestedField

    cat = part._cat()
    with contextlib.suppress(NamespaceAlreadyExistsError):  # a concurrent creator
        cat.create_namespace_if_not_exists(part.identifier[:-1])
    names = set(schema.names)
    for _, column in part.partition_by:
        if column not in names:
            raise InvalidRequest(
                f"{part.describe()}: partition_by names column {column!r}, which the "
                f"stream does not have (its columns: {', '.join(schema.names)})"
            )
    tbl = cat.create_table_if_not_exists(part.identifier, schema=schema)
    if part.partition_by and tbl.spec().is_unpartitioned() and not tbl.metadata.snapshots:
        ice: Schema = tbl.schema()
        fields = []
        for i, (transform, column) in enumerate(part.partition_by):
            src: NestedField = ice.find_field(column)
            name = column if transform == "identity" else f"{column}_{transform}"
            fields.append(PartitionField(source_id=src.field_id, field_id=1000 + i,
                                         transform=parse_transform(transform), name=name))
        with tbl.update_spec() as update:
            for field in fields:
                update.add_field(ice.find_column_name(field.source_id) or "",
                                 field.transform, field.name)
        tbl = cat.load_table(part.identifier)
    return tbl

def check_spec(part: IcebergParticipant, tbl: Table) -> None:
    """Refuse a table partitioned otherwise than ``partition_by`` says."""
    if not part.partition_by:
        return
    ice = tbl.schema()
    have = tuple(
        (str(f.transform) if str(f.transform) != "identity" else "identity",
         ice.find_column_name(f.source_id))
        for f in tbl.spec().fields
    )
    if have != part.partition_by:
        shown = ", ".join(f"{t}({c})" for t, c in have) or "unpartitioned"
        raise InvalidRequest(
            f"{part.describe()}: the table is partitioned by [{shown}], not by "
            f"partition_by={[f'{t}({c})' for t, c in part.partition_by]}; pass the "
            "table's own spec (or none: an existing table keeps its spec)"
        )

def fit(part: IcebergParticipant, tbl: Table, schema: pa.Schema) -> None:
    """Refuse a stream that does not fit the table (or add its columns, ``add_columns``)."""
    from pyiceberg.io.pyarrow import _check_pyarrow_schema_compatible

    ice = tbl.schema()
    have = {f.name for f in ice.fields}
    extra = [n for n in schema.names if n not in have]
    missing = [f.name for f in ice.fields if f.required and f.name not in schema.names]
    if extra and part.on_schema_change == "add_columns" and not missing:
        import pyarrow

        # rows already in the table lack the new columns: they are optional, even
        # when the stream's are not (a literal, e.g.): Iceberg refuses a required one
        widened = pyarrow.schema([f.with_nullable(True) if f.name in extra else f
                                  for f in schema])
        with tbl.update_schema() as update:
            update.union_by_name(widened)
        tbl = part._load()
        ice = tbl.schema()
        extra = []
    problems = []
    if extra:
        problems.append(f"columns not in the table: {', '.join(extra)}")
    if missing:
        problems.append(f"required table columns the stream lacks: {', '.join(missing)}")
    if not problems:
        try:
            _check_pyarrow_schema_compatible(ice, schema,
                                             format_version=tbl.metadata.format_version)
        except ValueError as exc:
            problems.append(f"column types differ:\n{exc}")
    if problems:
        raise InvalidRequest(
            f"{part.describe()}: the stream does not fit the existing table: "
            + "; ".join(problems)
            + ". Fix: select and cast the stream's columns to the table's, or pass "
            "on_schema_change='add_columns' to add new columns, or write to a new table"
        )

