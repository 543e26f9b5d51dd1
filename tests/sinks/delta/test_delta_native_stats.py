"""The native path's Delta statistics, read from a Parquet footer, are the ones the Python
path gathers while writing (the same rule: whole or only the row count), and a file that
does not fit the table is named with its cause."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from twophase.sinks.delta.native import misfits, stats_from_parquet
from twophase.sinks.delta.writer import Stats


def _both(tmp_path: Path, table: pa.Table) -> tuple[str, str]:
    path = tmp_path / "f.parquet"
    pq.write_table(table, path, row_group_size=3)  # several row groups
    st = Stats(table.schema)
    for batch in table.to_batches(max_chunksize=3):
        st.add(batch)
    return stats_from_parquet(pq.read_metadata(path)), st.json()


def test_footer_statistics_are_the_python_paths(tmp_path: Path) -> None:
    t0 = dt.datetime(2026, 1, 1, 0, 0, 0, 1500, tzinfo=dt.timezone.utc)
    table = pa.table({
        "id": pa.array([5, 1, None, 9, 3, 7, 2], pa.int64()),
        "name": ["b", "a", "c", None, "e", "z", "m"],
        "ts": pa.array([t0 + dt.timedelta(seconds=i) for i in range(7)],
                       pa.timestamp("us", tz="UTC")),
        "day": pa.array([dt.date(2026, 1, i + 1) for i in range(7)], pa.date32()),
        "ok": [True, False, None, True, True, False, True],
        "gone": pa.nulls(7, pa.int32()),  # all null: a null count, no range
    })
    footer, python = _both(tmp_path, table)
    assert json.loads(footer) == json.loads(python)
    stats = json.loads(footer)
    assert stats["minValues"]["id"] == 1 and stats["maxValues"]["ts"].endswith(".002Z")
    assert stats["nullCount"] == {"id": 1, "name": 1, "ts": 0, "day": 0, "ok": 1, "gone": 7}


def test_a_float_or_a_long_string_leaves_only_the_row_count(tmp_path: Path) -> None:
    floats = pa.table({"id": [1, 2], "x": [0.5, float("nan")]})
    assert json.loads(_both(tmp_path, floats)[0]) == {"numRecords": 2}
    long = pa.table({"id": [1, 2], "s": ["a", "x" * 40]})
    footer, python = _both(tmp_path, long)
    assert json.loads(footer) == json.loads(python) == {"numRecords": 2}


def test_a_file_that_does_not_fit_the_table_is_named() -> None:
    table = pa.schema([pa.field("id", pa.int64()), pa.field("ts", pa.timestamp("us", tz="UTC")),
                       pa.field("pair", pa.list_(pa.field("element", pa.int64()))),
                       pa.field("later", pa.string())])
    spark = pa.schema([pa.field("id", pa.int64(), False),
                       pa.field("ts", pa.timestamp("us", tz="UTC")),
                       pa.field("pair", pa.list_(pa.int64()))])
    assert misfits(spark, table) == []  # nullability, a list item's name, a later column
    wrong = pa.schema([pa.field("id", pa.int32()), pa.field("extra", pa.string())])
    assert misfits(wrong, table) == [
        "column types differ: id (file int32, table int64)", "columns not in the table: extra"]
