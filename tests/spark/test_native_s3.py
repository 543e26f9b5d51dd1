"""The native data path of an ``s3://`` files participant, under real Spark against the
suite's S3-API server (moto, signatures enforced): a driver of its own (local[2] with
Hadoop's S3A jars, ``twophase/testing/s3a.pom.xml``) has Spark's Parquet writer write
the batches through ``s3a://`` (its participant refuses rows in ``prepare``, and the
committed objects were written by parquet-mr, not pyarrow), is SIGKILLed after Spark
wrote an attempt (no vote: the restart sweeps the write folder by name) and with COMMIT
decided before the commit (the restart finishes it); then this process's session,
without S3A, takes the Python path (told once, with the fix), finishes the batch and
writes one more. Every id is committed once, nothing is left staged or open, and the
Python path writes the same objects with the same values."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.support.s3 import keys, read_rows, unique_prefix
from tests.support.s3native_job import LINEAGE, SINK, batch_df
from twophase import TransactionalSink, failpoints
from twophase.participant import BranchStatus
from twophase.sinks import s3native
from twophase.sinks.files import STAGING_DIR
from twophase.sinks.s3 import S3StagedFileParticipant
from twophase.testing.locals3 import LocalS3
from twophase.testing.s3ajars import s3a_jars

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[2]
NAME = "files-out"


def _drive(tmp: Path, s3: LocalS3, url: str, batches: list[list[int]],
           arm: list[Any]) -> tuple[int, list[Any]]:
    """One run of the child driver (tests/support/s3native_job.py): its exit code and
    what it printed (the path taken, then one outcome per batch)."""
    job = tmp / f"job-{arm[0]}.json"
    job.write_text(json.dumps({
        "url": url, "storage_options": s3.storage_options, "batches": batches, "arm": arm,
        "coordinator": f"sqlite:///{tmp / 'coord.db'}",
        "jars": [str(j) for j in s3a_jars()]}))
    env = {k: v for k, v in os.environ.items()
           if k not in (failpoints.ENV, failpoints.ONCE_DIR_ENV) and not k.startswith("AWS_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    with open(tmp / "driver.log", "a") as err:
        done = subprocess.run([sys.executable, "-m", "tests.support.s3native_job", str(job)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err,
                              text=True, timeout=600, check=False)
    return done.returncode, [json.loads(x) for x in done.stdout.splitlines()
                             if x.startswith(("{", "["))]


def _writers(s3: LocalS3, part: S3StagedFileParticipant, names: list[str]) -> set[str]:
    """The Parquet writer of each committed object (``created_by``'s first word)."""
    fs = part.arrow_filesystem()
    return {pq.read_metadata(f"{part.bucket}/{part.prefix}{n}", filesystem=fs)
            .created_by.split()[0] for n in names}


def test_s3_native_write_kills_and_the_python_path(
    spark: Any, s3: LocalS3, s3_bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = unique_prefix("nat")
    url = f"s3://{s3_bucket}/{prefix}"
    log = tmp_path / "driver.log"
    reader = S3StagedFileParticipant(url, name=NAME, storage_options=s3.storage_options,
                                     native=False)

    def staged() -> list[str]:
        return [k for k in keys(s3, s3_bucket, prefix) if k.startswith(STAGING_DIR + "/")]

    # 1. native: 300 rows, none, 20 shuffled; killed after Spark wrote batch 3 (no vote)
    rc, out = _drive(tmp_path, s3, url, [[0, 300], [1, 0], [2, 20], [3, 40]],
                     [3, "after_prepare=kill*1"])
    assert rc == -9, log.read_text()[-3000:]
    assert out == [{"native": [NAME]}, ["committed", 300, 3], ["committed", 0, 3],
                   ["committed", 20, 3]], log.read_text()[-3000:]
    folder = f"{STAGING_DIR}/{SINK}~spark-{SINK}~{LINEAGE}-{3:020d}-{NAME}.attempt-1/"
    left = staged()
    assert left and all(k.startswith(folder) for k in left), left  # Spark's objects only
    (ref,) = reader.in_doubt(SINK)  # the write folder, as its attempt's partition 0
    assert (ref.batch_id, ref.attempt, ref.partition) == (3, 1, 0)
    assert reader.status(ref) == BranchStatus.PREPARED
    assert s3.open_uploads(s3_bucket, prefix) == []

    # 2. restart: batch 3's next attempt sweeps the folder by name and commits; killed
    # with COMMIT decided for batch 4, before its commit (prepared: markers, open uploads)
    rc, out = _drive(tmp_path, s3, url, [[3, 40], [4, 30]], [4, "before_commit=kill*1"])
    assert rc == -9, log.read_text()[-3000:]
    assert out == [{"native": [NAME]}, ["committed", 40, 3]], log.read_text()[-3000:]
    markers = staged()
    assert markers and all("/" not in k.removeprefix(STAGING_DIR + "/") for k in markers)
    assert len(s3.open_uploads(s3_bucket, prefix)) == len(markers)

    # 3. restart here: no S3A in this session, so the Python path, told once with the
    # fix; batch 4 is finished by name (the same commit model), batch 5 from Python
    s3native._told.clear()
    with caplog.at_level(logging.WARNING, logger="twophase.sink"):
        sink = TransactionalSink(SINK, [S3StagedFileParticipant(
            url, name=NAME, storage_options=s3.storage_options)],
            f"sqlite:///{tmp_path / 'coord.db'}", lineage=LINEAGE, preflight=False)
    assert sink._engine.job.native == ()
    assert "org.apache.hadoop:hadoop-aws" in caplog.text
    try:
        sink(batch_df(spark, 4, 30), 4)
        sink(batch_df(spark, 5, 10), 5)
        assert [r.outcome for r in sink.history] == ["recovered", "committed"]
        assert sink.history[-1].rows == 10
    finally:
        sink.close()
    ids = sorted(r["id"] for r in read_rows(s3, s3_bucket, prefix, "parquet", ["id"]))
    assert ids == [b * 1000 + i for b, n in ((0, 300), (2, 20), (3, 40), (4, 30), (5, 10))
                   for i in range(n)]
    assert staged() == [] and s3.open_uploads(s3_bucket, prefix) == []
    assert reader.in_doubt(SINK) == []
    names = [k for k in keys(s3, s3_bucket, prefix) if "/" not in k]
    spark_made = [n for n in names if f"-{5:020d}-" not in n]
    assert _writers(s3, reader, spark_made) == {"parquet-mr"}  # Spark's writer, via S3A
    assert _writers(s3, reader, sorted(set(names) - set(spark_made))) == {"parquet-cpp-arrow"}

    # 4. the Python path writes batches 0-2 as the same objects with the same values
    other = unique_prefix("py")
    python = S3StagedFileParticipant(f"s3://{s3_bucket}/{other}", name=NAME,
                                     storage_options=s3.storage_options, native=False)
    sink = TransactionalSink(SINK, [python], f"sqlite:///{tmp_path / 'py.db'}",
                             lineage=LINEAGE, preflight=False)
    try:
        for batch, rows in ((0, 300), (1, 0), (2, 20)):
            sink(batch_df(spark, batch, rows), batch)
    finally:
        sink.close()
    first = [n for n in names if any(f"-{b:020d}-" in n for b in (0, 1, 2))]
    assert keys(s3, s3_bucket, other) == first
    fs = reader.arrow_filesystem()
    for n in first:
        mine = pq.read_table(f"{s3_bucket}/{prefix}/{n}", filesystem=fs)
        theirs = pq.read_table(f"{s3_bucket}/{other}/{n}", filesystem=fs)
        assert mine.cast(theirs.schema).equals(theirs), n
