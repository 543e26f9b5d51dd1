"""The S3 native path's second half without Spark, against the suite's S3-API server:
objects laid out as Spark's writer leaves an attempt's write folder become prepared
branches by server-side copies (``adopt``), commit as the Python path's, and a write
folder left by a driver killed before adopt is PREPARED, in doubt and swept by name.
(Spark's own write through S3A: tests/spark/test_native_s3.py.)"""

from __future__ import annotations

import io
import os
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.s3 import keys, read_rows, unique_prefix
from twophase.participant import BranchRef, BranchStatus
from twophase.protocol import TxnKey
from twophase.sinks import s3native
from twophase.sinks.files import STAGING_DIR
from twophase.sinks.s3 import S3StagedFileParticipant
from twophase.testing.locals3 import LocalS3

KEY = TxnKey("nat", "lin-1", 7, 1)


def _participant(s3: LocalS3, bucket: str) -> S3StagedFileParticipant:
    return S3StagedFileParticipant(f"s3://{bucket}/{unique_prefix('adopt')}", name="out",
                                   storage_options=s3.storage_options, native=False)


def _spark_write(s3: LocalS3, part: S3StagedFileParticipant, key: TxnKey,
                 files: dict[int, pa.Table]) -> None:
    """Objects named as Spark's Parquet writer names them, under the attempt's folder,
    with S3A's directory marker beside them."""
    folder = part.native_location(key).removeprefix(f"s3a://{part.bucket}/")
    client = s3.client()
    client.put_object(Bucket=part.bucket, Key=folder + "/", Body=b"")
    for p, table in files.items():
        buf = io.BytesIO()
        pq.write_table(table, buf)
        client.put_object(Bucket=part.bucket,
                          Key=f"{folder}/part-{p:05d}-1f2e-c000.snappy.parquet",
                          Body=buf.getvalue())


def _staged(s3: LocalS3, part: S3StagedFileParticipant) -> list[str]:
    return [k for k in keys(s3, part.bucket, part.prefix.rstrip("/"))
            if k.startswith(STAGING_DIR)]


def test_adopt_then_commit_reads_back_as_the_python_path(s3: LocalS3, s3_bucket: str) -> None:
    part = _participant(s3, s3_bucket)
    tables = {0: pa.table({"id": [1, 2, 3]}), 1: pa.table({"id": pa.array([], pa.int64())}),
              2: pa.table({"id": [4]})}
    _spark_write(s3, part, KEY, tables)
    handles = part.adopt(KEY, 3)
    assert sorted(handles) == [0, 2]  # a zero-row file is no branch, as prepare writes none
    assert [handles[p]["rows"] for p in (0, 2)] == ["3", "1"]
    # only the markers are left staged: the write folder is gone, two uploads open
    assert sorted(_staged(s3, part)) == sorted(
        f"{STAGING_DIR}/{part.staged_name(BranchRef(*KEY, 'out', p))}" for p in (0, 2))
    assert len(s3.open_uploads(s3_bucket, part.prefix)) == 2
    for p, handle in handles.items():
        ref = BranchRef(*KEY, participant="out", partition=p)
        assert part.status(ref) == BranchStatus.PREPARED
        part.commit(ref, handle)
        assert part.status(ref) == BranchStatus.COMMITTED
    rows = read_rows(s3, s3_bucket, part.prefix.rstrip("/"), "parquet", ["id"])
    assert sorted(r["id"] for r in rows) == [1, 2, 3, 4]
    assert _staged(s3, part) == [] and s3.open_uploads(s3_bucket, part.prefix) == []
    # a redo of the committed checkpoint (attempt 2) finds the final objects: no copy
    again = KEY._replace(attempt=2)
    _spark_write(s3, part, again, tables)
    assert {p: h["state"] for p, h in part.adopt(again, 3).items()} == \
        {0: "already-committed", 2: "already-committed"}
    assert _staged(s3, part) == [] and s3.open_uploads(s3_bucket, part.prefix) == []


def test_a_write_folder_left_unadopted_is_prepared_and_swept(s3: LocalS3,
                                                             s3_bucket: str) -> None:
    part = _participant(s3, s3_bucket)
    _spark_write(s3, part, KEY, {0: pa.table({"id": [1]}), 1: pa.table({"id": [2]})})
    other = S3StagedFileParticipant(f"s3://{s3_bucket}/{part.prefix}", name="another",
                                    storage_options=s3.storage_options, native=False)
    assert other.in_doubt("nat") == []  # another participant's folder is not its own
    (ref,) = part.in_doubt("nat")
    assert ref == BranchRef(*KEY, participant="out", partition=0)
    assert part.status(replace(ref, partition=1)) == BranchStatus.PREPARED
    assert part.read_back("id").prepared == 1
    part.abort(replace(ref, partition=1), None)  # any branch of the attempt sweeps it
    assert _staged(s3, part) == [] and part.in_doubt("nat") == []
    assert part.status(ref) == BranchStatus.ABSENT


def test_an_object_over_the_copy_limit_is_copied_in_ranges(
    s3: LocalS3, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 copies at most 5 GiB in one UploadPartCopy: here the limit is lowered to 6 MiB
    (5 MiB parts, S3's minimum but for the last) and a 12 MiB object takes three."""
    monkeypatch.setattr(s3native, "MAX_COPY", 6 << 20)
    monkeypatch.setattr(s3native, "COPY_PART", 5 << 20)
    part = _participant(s3, s3_bucket)
    blob = pa.table({"b": [os.urandom(4 << 20) for _ in range(3)]})
    _spark_write(s3, part, KEY, {0: blob})
    (handle,) = part.adopt(KEY, 1).values()
    assert len(handle["etags"].split(",")) == 3
    ref = BranchRef(*KEY, participant="out", partition=0)
    part.commit(ref, handle)
    fs: Any = part.arrow_filesystem()
    got = pq.read_table(f"{part.bucket}/{part.final_key(ref)}", filesystem=fs)
    assert got.equals(blob)


def test_hadoop_options_of_storage_options() -> None:
    opts = s3native.hadoop_options({
        "endpoint_url": "http://127.0.0.1:9000", "aws_access_key_id": "AK",
        "aws_secret_access_key": "SK", "aws_session_token": "T", "region_name": "eu-west-1"})
    assert opts == {
        "fs.s3a.endpoint": "http://127.0.0.1:9000", "fs.s3a.path.style.access": "true",
        "fs.s3a.connection.ssl.enabled": "false", "fs.s3a.endpoint.region": "eu-west-1",
        "fs.s3a.access.key": "AK", "fs.s3a.secret.key": "SK", "fs.s3a.session.token": "T",
        "fs.s3a.aws.credentials.provider":
            "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"}
    assert s3native.hadoop_options({}) == {}  # S3A's own chain, as boto3's
