"""The verifier on files left by a crash: a staged file is a prepared leftover (fails the
check), a temp file of a prepare killed mid-write is reported apart (never visible)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from twophase.sinks.files import StagedFileParticipant
from twophase.testing.verify import verify


def test_staged_file_fails_temp_file_is_reported_apart(tmp_path: Path) -> None:
    out = tmp_path / "out"
    staging = out / "_twophase_staging"
    staging.mkdir(parents=True)
    pq.write_table(pa.table({"id": [0, 1, 2]}), out / "part-a.parquet")
    pq.write_table(pa.table({"id": [2]}), out / "part-b.parquet")  # a duplicate
    p = StagedFileParticipant(path=str(out), format="parquet")
    torn = staging / ".s~part-x.attempt-1.parquet.0123abcd.tmp"
    torn.write_bytes(b"PAR1")
    report = verify([p], [0, 1, 2, 3])
    [s] = report.systems
    assert (s.rows, s.duplicates, s.missing, s.unexpected) == (4, 1, 1, 0)
    assert s.examples == {"duplicates": [2], "missing": [3], "unexpected": []}
    assert (s.prepared_leftovers, s.temp_leftovers) == (0, 1)
    assert any("temp file" in line for line in report.lines())
    assert json.loads(report.to_json())["systems"][0]["temp_leftovers"] == 1

    (out / "part-b.parquet").unlink()
    pq.write_table(pa.table({"id": [3]}), out / "part-c.parquet")
    assert verify([p], [0, 1, 2, 3]).ok  # the temp file alone does not fail exactly-once
    pq.write_table(pa.table({"id": [9]}), staging / "s~part-y.attempt-1.parquet")
    after = verify([p], [0, 1, 2, 3])
    assert not after.ok and after.systems[0].prepared_leftovers == 1
