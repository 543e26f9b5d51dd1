"""S3 test support: one private S3-API server (moto, signatures enforced) per session.

- ``s3`` (session): a :class:`~twophase.testing.locals3.LocalS3` on a free loopback port,
  started here and stopped at the end of the session.
- ``s3_bucket`` (session): a bucket in it; every test writes under its own prefix.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow.dataset as ds
import pytest

from twophase.sinks.s3 import S3StagedFileParticipant
from twophase.testing.locals3 import LocalS3


@pytest.fixture(scope="session")
def s3() -> Iterator[LocalS3]:
    server = LocalS3()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_bucket(s3: LocalS3) -> str:
    return s3.create_bucket("twophase-tests")


def unique_prefix(tag: str = "t") -> str:
    return f"{tag}-{uuid.uuid4().hex[:10]}"


def keys(s3: LocalS3, bucket: str, prefix: str) -> list[str]:
    """Every object key under ``prefix`` (relative to it), staging folder included."""
    found: list[str] = []
    for page in s3.client().get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix + "/"):
        found += [o["Key"].removeprefix(prefix + "/") for o in page.get("Contents", [])]
    return sorted(found)


def read_rows(s3: LocalS3, bucket: str, prefix: str, fmt: str,
              columns: list[str]) -> list[dict[str, Any]]:
    """The rows a consumer reads under ``s3://bucket/prefix``: a pyarrow dataset over
    ``pyarrow.fs.S3FileSystem`` (discovery ignores ``_``/``.`` names) for Parquet; the
    objects' lines for JSON lines (pyarrow's JSON reader refuses empty files)."""
    visible = [k for k in keys(s3, bucket, prefix) if "/" not in k and k.startswith("part-")]
    if fmt == "jsonl":
        body = s3.client().get_object
        return [json.loads(line) for k in visible
                for line in body(Bucket=bucket, Key=f"{prefix}/{k}")["Body"].read().splitlines()]
    fs = S3StagedFileParticipant(f"s3://{bucket}/{prefix}",
                                 storage_options=s3.storage_options).arrow_filesystem()
    try:
        dataset = ds.dataset(f"{bucket}/{prefix}", format="parquet", filesystem=fs)
    except FileNotFoundError:  # no object under the prefix at all
        assert visible == []
        return []
    assert sorted(dataset.files) == [f"{bucket}/{prefix}/{k}" for k in visible], \
        "the dataset reader sees objects that are not committed"
    if not visible:
        return []
    return dataset.to_table(columns=columns).to_pylist()
