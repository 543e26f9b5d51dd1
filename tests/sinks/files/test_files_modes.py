"""StagedFileParticipant: what each output mode means, and schema changes of a folder
(refused before any write, naming the columns; additions allowed when asked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from twophase.errors import InvalidRequest
from twophase.participant import BranchRef, ParticipantError
from twophase.sinks.files import StagedFileParticipant

BASE = pa.schema([("id", pa.int64()), ("name", pa.string())])
WIDER = pa.schema([("id", pa.int64()), ("name", pa.string()), ("region", pa.string())])


def _land(p: StagedFileParticipant, schema: pa.Schema, rows: list[dict[str, Any]],
          batch_id: int) -> None:
    b = BranchRef(sink="f", lineage="lin", batch_id=batch_id, attempt=1,
                  participant=p.name, partition=0)
    p.check(schema)
    p.commit(b, p.prepare(b, schema, [pa.RecordBatch.from_pylist(rows, schema=schema)]))


def _visible(path: Path) -> list[str]:
    return sorted(f.name for f in path.iterdir() if not f.name.startswith(("_", ".")))


def test_only_append_mode_with_a_message_saying_what_modes_mean(tmp_path: Path) -> None:
    assert StagedFileParticipant(str(tmp_path)).mode == "append"
    for mode in ("complete", "upsert"):
        with pytest.raises(InvalidRequest) as info:
            StagedFileParticipant(str(tmp_path), mode=mode)
        msg = str(info.value)
        assert "only appends" in msg and "mode='upsert' or 'complete'" in msg, msg
    with pytest.raises(InvalidRequest, match="on_schema_change must be one of fail, add_columns"):
        StagedFileParticipant(str(tmp_path), on_schema_change="merge")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_new_column_refused_by_default_naming_it_before_any_write(
    tmp_path: Path, fmt: str
) -> None:
    p = StagedFileParticipant(str(tmp_path), format=fmt)
    _land(p, BASE, [{"id": 1, "name": "a"}], 0)
    before = _visible(tmp_path)
    with pytest.raises(ParticipantError) as info:
        p.check(WIDER)
    msg = str(info.value)
    assert "new column(s) 'region'" in msg and "on_schema_change='add_columns'" in msg, msg
    assert _visible(tmp_path) == before
    assert list((tmp_path / "_twophase_staging").iterdir()) == []


def test_add_columns_allows_additions_and_readers_merge(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path), on_schema_change="add_columns")
    _land(p, BASE, [{"id": 1, "name": "a"}], 0)
    _land(p, WIDER, [{"id": 2, "name": "b", "region": "eu"}], 1)
    merged = ds.dataset(str(tmp_path), format="parquet",
                        schema=WIDER).to_table().sort_by("id").to_pylist()
    assert merged == [{"id": 1, "name": "a", "region": None},
                      {"id": 2, "name": "b", "region": "eu"}]


def test_type_change_and_dropped_column_refused_under_every_policy(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path), on_schema_change="add_columns")
    _land(p, WIDER, [{"id": 1, "name": "a", "region": "eu"}], 0)
    retyped = pa.schema([("id", pa.string()), ("name", pa.string()), ("region", pa.string())])
    with pytest.raises(ParticipantError, match="column 'id' is int64 in the folder's files "
                       "but string in the batch"):
        p.check(retyped)
    with pytest.raises(ParticipantError, match="column\\(s\\) 'region' are in the folder's "
                       "files but not in the batch"):
        p.check(BASE)
    assert len(_visible(tmp_path)) == 1


def test_descriptor_carries_the_schema_policy(tmp_path: Path) -> None:
    p = StagedFileParticipant(str(tmp_path), on_schema_change="add_columns")
    assert StagedFileParticipant.from_descriptor(p.descriptor(), {}).on_schema_change == \
        "add_columns"


def test_object_storage_takes_the_same_mode_and_refuses_what_it_cannot_check() -> None:
    # Built without contacting any server: the refusals come at construction.
    opts = {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"}
    p = StagedFileParticipant("s3://bucket/prefix", storage_options=opts, mode="append")
    assert p.mode == "append" and p.on_schema_change == "fail"
    with pytest.raises(InvalidRequest, match="only appends"):
        StagedFileParticipant("s3://bucket/prefix", storage_options=opts, mode="complete")
    with pytest.raises(InvalidRequest, match="not supported on object storage"):
        StagedFileParticipant("s3://bucket/prefix", storage_options=opts,
                              on_schema_change="add_columns")
