"""StagedFileParticipant on object storage (``s3://``) against a real S3-API server.

The server is moto's standalone server on loopback with signatures enforced
(``tests/support/s3.py``). The conformance suite runs here as for every durable
participant (cross-process commit and abort after the preparer's SIGKILL included); the
rest is what only object storage has: multipart parts, uploads killed midway, metadata
markers, bad buckets, keys and endpoints.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from tests.support.s3 import keys, read_rows, unique_prefix
from twophase.errors import InvalidRequest
from twophase.participant import (
    BranchRef,
    BranchStatus,
    Participant,
    ParticipantError,
    PrepareRefused,
)
from twophase.sinks.files import STAGING_DIR, StagedFileParticipant
from twophase.sinks.s3 import BRANCH_META, S3StagedFileParticipant
from twophase.testing.conformance import Harness, applicable_checks
from twophase.testing.locals3 import LocalS3
from twophase.testing.servers import free_port

SCHEMA = pa.schema([("id", pa.int64()), ("v", pa.float64())])


class S3Target:
    """A fresh prefix in the session's bucket."""

    def __init__(self, s3: LocalS3, bucket: str, fmt: str) -> None:
        self.s3, self.bucket, self.fmt = s3, bucket, fmt
        self.prefix = unique_prefix(f"conf-{fmt}")

    def participant(self) -> Participant:
        return StagedFileParticipant(f"s3://{self.bucket}/{self.prefix}", self.fmt,
                                     storage_options=self.s3.storage_options)

    def rows(self) -> list[dict[str, Any]]:
        return read_rows(self.s3, self.bucket, self.prefix, self.fmt, ["id", "label", "amount"])

    def close(self) -> None:
        staged = [k for k in keys(self.s3, self.bucket, self.prefix) if k.startswith(STAGING_DIR)]
        uploads = self.s3.open_uploads(self.bucket, self.prefix + "/")
        for u in uploads:
            self.s3.client().abort_multipart_upload(Bucket=self.bucket, Key=u["Key"],
                                                    UploadId=u["UploadId"])
        assert not staged, f"check left prepared markers behind: {staged}"
        assert not uploads, f"check left open multipart uploads behind: {uploads}"


_DURABLE = Harness(id="durable", new_target=lambda: None)  # type: ignore[arg-type,return-value]
CASES = [
    pytest.param(fmt, check, id=f"s3-{fmt}-{check.__name__.removeprefix('check_')}")
    for fmt in ("parquet", "jsonl")
    for check in applicable_checks(_DURABLE)
]


@pytest.mark.parametrize(("fmt", "check"), CASES)
def test_conformance(
    s3: LocalS3, s3_bucket: str, fmt: str, check: Callable[[Harness], None]
) -> None:
    check(Harness(id=f"s3-{fmt}", new_target=lambda: S3Target(s3, s3_bucket, fmt)))


# -- helpers ---------------------------------------------------------------------------------


def _p(s3: LocalS3, bucket: str, prefix: str, fmt: str = "parquet",
       **kw: Any) -> S3StagedFileParticipant:
    p = StagedFileParticipant(f"s3://{bucket}/{prefix}", fmt,
                              storage_options=kw.pop("storage_options", s3.storage_options), **kw)
    assert isinstance(p, S3StagedFileParticipant)
    return p


def _branch(p: Participant, **kw: Any) -> BranchRef:
    args: dict[str, Any] = {"sink": "s", "lineage": "lin-1", "batch_id": 0, "attempt": 0,
                            "participant": p.name, "partition": 0}
    args.update(kw)
    return BranchRef(**args)


def _batch(ids: list[int], v: float = 1.0) -> pa.RecordBatch:
    return pa.record_batch({"id": ids, "v": [v] * len(ids)}, schema=SCHEMA)


def _nothing_left(s3: LocalS3, bucket: str, prefix: str) -> None:
    assert keys(s3, bucket, prefix) == []
    assert s3.open_uploads(bucket, prefix + "/") == []


# -- the object-store design -----------------------------------------------------------------


def test_same_class_names_and_handle(s3: LocalS3, s3_bucket: str) -> None:
    prefix = unique_prefix("names")
    p = _p(s3, s3_bucket, f"{prefix}/orders")
    assert isinstance(p, StagedFileParticipant) and p.kind == "files"
    assert p.name == "files-orders"
    assert p.url == f"s3://{s3_bucket}/{prefix}/orders/"
    b = _branch(p, batch_id=42, attempt=2, partition=7)
    h = p.prepare(b, SCHEMA, [_batch([1, 2])])
    staged = f"s~part-s~lin-1-{42:020d}-files-orders-00007.attempt-2.parquet"
    final = f"part-s~lin-1-{42:020d}-files-orders-00007.parquet"
    assert {k: v for k, v in h.items() if k not in ("upload", "etags")} == {
        "kind": "files", "participant": "files-orders", "staged": staged, "final": final,
        "rows": "2", "state": "prepared"}
    assert keys(s3, s3_bucket, f"{prefix}/orders") == [f"{STAGING_DIR}/{staged}"]
    [upload] = s3.open_uploads(s3_bucket, f"{prefix}/orders/")
    assert (upload["Key"], upload["UploadId"]) == (f"{prefix}/orders/{final}", h["upload"])
    parts = s3.client().list_parts(Bucket=s3_bucket, Key=upload["Key"],
                                   UploadId=h["upload"])["Parts"]
    assert h["etags"] == ",".join(x["ETag"] for x in parts)  # commit needs no ListParts
    p.commit(b, h)
    assert keys(s3, s3_bucket, f"{prefix}/orders") == [final]
    head = s3.client().head_object(Bucket=s3_bucket, Key=f"{prefix}/orders/{final}")
    assert head["Metadata"][BRANCH_META] == f"s/lin-1/42/2/{p.name}/7"
    assert s3.open_uploads(s3_bucket, prefix + "/") == []


def test_large_branch_is_several_parts_committed_by_another_process_object(
    s3: LocalS3, s3_bucket: str
) -> None:
    prefix = unique_prefix("parts")
    p = _p(s3, s3_bucket, prefix)
    p.part_size = 5 * 1024 * 1024  # S3's smallest non-last part
    b = _branch(p)
    n = 1_500_000
    big = pa.record_batch({"id": list(range(n)), "v": [float(i) * 1.1 for i in range(n)]},
                          schema=SCHEMA)
    h = p.prepare(b, SCHEMA, [big])
    [upload] = s3.open_uploads(s3_bucket, prefix + "/")
    parts = s3.client().list_parts(Bucket=s3_bucket, Key=upload["Key"],
                                   UploadId=upload["UploadId"])["Parts"]
    assert len(parts) >= 2, parts
    fresh = pickle.loads(pickle.dumps(p))  # no client, no memory of the parts: ListParts
    fresh.commit(b, None)
    assert sorted(r["id"] for r in read_rows(s3, s3_bucket, prefix, "parquet", ["id"])) \
        == list(range(n))
    assert fresh.status(b) is BranchStatus.COMMITTED and h["rows"] == str(n)
    assert s3.open_uploads(s3_bucket, prefix + "/") == []


def test_upload_killed_before_its_marker_is_litter_not_prepared(
    s3: LocalS3, s3_bucket: str
) -> None:
    """A prepare killed after CreateMultipartUpload (parts maybe sent, no marker yet) was
    never prepared: status ABSENT, not in doubt, counted as litter, aborted by the next
    prepare of the branch."""
    prefix = unique_prefix("torn")
    p = _p(s3, s3_bucket, prefix)
    b = _branch(p, sink="orders")
    c = s3.client()
    torn = c.create_multipart_upload(Bucket=s3_bucket, Key=p.final_key(b))["UploadId"]
    c.upload_part(Bucket=s3_bucket, Key=p.final_key(b), UploadId=torn, PartNumber=1,
                  Body=b"half")
    assert p.status(b) is BranchStatus.ABSENT and p.in_doubt("orders") == []
    back = p.read_back("id")
    assert (back.values, back.prepared, back.temp) == ((), 0, 1)
    h = p.prepare(b, SCHEMA, [_batch([1])])
    assert [u["UploadId"] for u in s3.open_uploads(s3_bucket, prefix + "/")] == [h["upload"]]
    p.abort(b, None)
    _nothing_left(s3, s3_bucket, prefix)


def test_crash_between_complete_and_marker_delete(s3: LocalS3, s3_bucket: str) -> None:
    """The object is complete but the marker stayed: committed, and in_doubt tidies it."""
    prefix = unique_prefix("stale")
    p = _p(s3, s3_bucket, prefix)
    b = _branch(p, sink="orders")
    h = p.prepare(b, SCHEMA, [_batch([1, 2])])
    c = s3.client()
    parts = c.list_parts(Bucket=s3_bucket, Key=p.final_key(b), UploadId=h["upload"])["Parts"]
    c.complete_multipart_upload(
        Bucket=s3_bucket, Key=p.final_key(b), UploadId=h["upload"],
        MultipartUpload={"Parts": [{"PartNumber": x["PartNumber"], "ETag": x["ETag"]}
                                   for x in parts]})
    assert p.status(b) is BranchStatus.COMMITTED
    p.commit(b, h)  # the recovery's commit is idempotent and removes the marker
    assert keys(s3, s3_bucket, prefix) == [h["final"]]
    b2 = _branch(p, sink="orders", batch_id=1)
    h2 = p.prepare(b2, SCHEMA, [_batch([3])])
    c.complete_multipart_upload(
        Bucket=s3_bucket, Key=p.final_key(b2), UploadId=h2["upload"],
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": c.list_parts(
            Bucket=s3_bucket, Key=p.final_key(b2), UploadId=h2["upload"])["Parts"][0]["ETag"]}]})
    assert p.in_doubt("orders") == []
    assert sorted(keys(s3, s3_bucket, prefix)) == sorted([h["final"], h2["final"]])


def test_foreign_object_on_the_final_key_is_refused(s3: LocalS3, s3_bucket: str) -> None:
    prefix = unique_prefix("foreign")
    p = _p(s3, s3_bucket, prefix)
    b = _branch(p)
    s3.client().put_object(Bucket=s3_bucket, Key=p.final_key(b), Body=b"someone else's")
    with pytest.raises(PrepareRefused, match=r"not written by this branch.*move it away"):
        p.prepare(b, SCHEMA, [_batch([1])])
    assert s3.open_uploads(s3_bucket, prefix + "/") == []


def test_pyarrow_dataset_on_s3_sees_exactly_the_committed_objects(
    s3: LocalS3, s3_bucket: str
) -> None:
    prefix = unique_prefix("readers")
    p = _p(s3, s3_bucket, prefix)
    p.check(SCHEMA)
    done, pending, aborted = _branch(p), _branch(p, partition=1), _branch(p, partition=2)
    p.commit(done, p.prepare(done, SCHEMA, [_batch([1, 2, 3])]))
    p.prepare(pending, SCHEMA, [_batch([10, 11])])
    p.abort(aborted, p.prepare(aborted, SCHEMA, [_batch([20])]))
    from pyarrow.fs import S3FileSystem

    fs = S3FileSystem(endpoint_override=s3.endpoint.removeprefix("http://"), scheme="http",
                      access_key=s3.access_key, secret_key=s3.secret_key, region=s3.region)
    dataset = ds.dataset(f"{s3_bucket}/{prefix}", format="parquet", filesystem=fs)
    assert dataset.files == [f"{s3_bucket}/{p.final_key(done)}"]
    assert sorted(dataset.to_table().column("id").to_pylist()) == [1, 2, 3]
    back = p.read_back("id")
    assert (sorted(back.values), back.prepared, back.temp) == ([1, 2, 3], 1, 0)
    p.abort(pending, None)
    assert len(s3.open_uploads(s3_bucket, prefix + "/")) == 0


def test_rows_refused_abort_the_upload(s3: LocalS3, s3_bucket: str) -> None:
    prefix = unique_prefix("refused")
    p = _p(s3, s3_bucket, prefix, "jsonl")
    with pytest.raises(PrepareRefused, match="batch has schema"):
        p.prepare(_branch(p), SCHEMA, [_batch([1]), pa.record_batch({"id": ["x"]})])

    def dying() -> Any:
        yield _batch([1])
        raise RuntimeError("executor lost its input")

    with pytest.raises(RuntimeError, match="executor lost"):
        p.prepare(_branch(p), SCHEMA, dying())
    _nothing_left(s3, s3_bucket, prefix)


# -- bad input: a clear error before any write, nothing left behind ---------------------------


@pytest.mark.parametrize("url", [
    "s3://twophase-tests/../etc", "s3://twophase-tests/a/../../b", "s3://twophase-tests//x",
    "s3://twophase-tests/a b", "s3://twophase-tests/x?versionId=1", "s3://twophase-tests/a/./b",
    "s3://twophase-tests/a\x00b", "s3://twophase-tests/%2e%2e/x", "s3://twophase-tests/a\\b",
    "s3://Twophase_Tests/x", "s3://ab/x", "s3:///x", "s3://twophase-tests/" + "x/" * 300,
])
def test_hostile_prefix_or_bucket_is_refused_at_construction(s3: LocalS3, url: str) -> None:
    with pytest.raises(InvalidRequest, match=r"invalid (key prefix|bucket name)|longer than"):
        StagedFileParticipant(url, storage_options=s3.storage_options)


@pytest.mark.parametrize("kw", [
    {"name": "../../etc"}, {"name": "a/b"}, {"name": ".."}, {"name": ""}, {"name": "x" * 65},
    {"format": "csv"}, {"storage_options": {"endpoint": "http://x"}},
])
def test_hostile_names_and_bad_options_are_refused(s3: LocalS3, kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest, match=r"invalid participant name|format must be|unknown "
                                             r"storage_options"):
        StagedFileParticipant("s3://twophase-tests/x", **kw)


def test_local_path_refuses_storage_options(tmp_path: Any) -> None:
    with pytest.raises(InvalidRequest, match="storage_options apply to s3:// paths only"):
        StagedFileParticipant(str(tmp_path), storage_options={"region_name": "x"})


def _refused_everywhere(p: S3StagedFileParticipant, match: str) -> None:
    with pytest.raises(ParticipantError, match=match):
        p.check(SCHEMA)
    with pytest.raises(PrepareRefused, match=match):
        p.prepare(_branch(p), SCHEMA, [_batch([1])])


def test_missing_bucket_fails_check_naming_it(s3: LocalS3, s3_bucket: str) -> None:
    p = _p(s3, "no-such-bucket-here", "x")
    _refused_everywhere(p, "bucket 'no-such-bucket-here' does not exist.*create it")
    assert "no-such-bucket-here" not in [b["Name"] for b in s3.client().list_buckets()["Buckets"]]


def test_wrong_credentials_fail_check_before_any_write(s3: LocalS3, s3_bucket: str) -> None:
    prefix = unique_prefix("creds")
    wrong = s3.storage_options | {"aws_secret_access_key": "not-the-secret"}
    p = _p(s3, s3_bucket, prefix, storage_options=wrong)
    _refused_everywhere(p, r"access denied .*check the credentials")
    _nothing_left(s3, s3_bucket, prefix)


def test_unreachable_endpoint_fails_check_naming_endpoint_url(s3: LocalS3) -> None:
    closed = s3.storage_options | {"endpoint_url": f"http://127.0.0.1:{free_port()}"}
    p = _p(s3, "twophase-tests", "x", storage_options=closed)
    _refused_everywhere(p, "cannot reach the S3 endpoint.*check storage_options endpoint_url")


def test_no_credentials_at_all_names_the_fix(s3: LocalS3, monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Any) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    p = _p(s3, "twophase-tests", "x",
           storage_options={"endpoint_url": s3.endpoint, "region_name": s3.region})
    with pytest.raises(ParticipantError, match="no AWS credentials found"):
        p.check(SCHEMA)


def test_descriptor_keeps_secrets_out_and_rebuilds(s3: LocalS3, s3_bucket: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from twophase.participant import rebuild

    prefix = unique_prefix("descr")
    p = _p(s3, s3_bucket, prefix, name="lake")
    d = p.descriptor()
    assert d["kind"] == "files" and d["target"] == p.url
    assert s3.secret_key not in str(d) and d["options"]["secrets"] == "aws_secret_access_key"
    assert d["options"]["storage.endpoint_url"] == s3.endpoint
    with pytest.raises(InvalidRequest, match="TWOPHASE_SECRET_LAKE_AWS_SECRET_ACCESS_KEY"):
        rebuild(d)
    monkeypatch.setenv("TWOPHASE_SECRET_LAKE_AWS_SECRET_ACCESS_KEY", s3.secret_key)
    again = rebuild(d)
    assert isinstance(again, S3StagedFileParticipant)
    assert again.storage_options == s3.storage_options and again.name == "lake"
    b = _branch(again)
    again.commit(b, p.prepare(b, SCHEMA, [_batch([1])]))  # the rebuilt one can sign
    assert again.status(b) is BranchStatus.COMMITTED
