"""Staged files on object storage (S3 API): prepare is a multipart upload left open.

``StagedFileParticipant(path="s3://bucket/prefix")`` builds this subclass; names, handles
and encodings are the local participant's. There is no rename on S3, so a branch is:

- **prepare**: ``CreateMultipartUpload`` on the branch's *final* key (with the branch in
  the object's metadata), the encoded rows streamed as parts (8 MiB each; S3 wants
  >= 5 MiB but for the last), then a zero-byte *marker* object
  ``prefix/_twophase_staging/<staged name>`` whose metadata names the upload. The marker
  is the prepare point: an upload without one is a prepare killed midway (never
  prepared, aborted by the next prepare or abort of the branch, or by a lifecycle rule).
  An open upload is invisible to every reader and survives the process that made it.
- **commit**: ``ListParts`` (the ETags, so any process can commit) then
  ``CompleteMultipartUpload``: the object appears whole, at once; then the marker is
  deleted. A final object whose metadata names the branch is "already committed".
- **abort**: ``AbortMultipartUpload``, then the marker is deleted.

``status`` and ``in_doubt`` read the bucket: the final object's metadata, the markers.
On the Python path the data crosses the network once (parts are never copied). The native
path (:mod:`twophase.sinks.s3native`, when Spark loads Hadoop's S3A) has Spark write the
objects and copies them into the upload server-side (``UploadPartCopy``): no row through
Python, and the same prepared state. See docs/participants.md.
"""

from __future__ import annotations

import re
import socket
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import suppress
from typing import Any, Final

import pyarrow as pa

from twophase.errors import Failure, InvalidRequest, TargetProblem, classify
from twophase.participant import (
    BranchRef,
    BranchStatus,
    Descriptor,
    Handle,
    ParticipantError,
    PrepareRefused,
    ReadBack,
    required_secret,
)
from twophase.protocol import TxnKey
from twophase.sinks.files import (
    STAGED_NAME,
    STAGING_DIR,
    StagedFileParticipant,
    checked_native,
)
from twophase.sinks.s3native import (
    adopt,
    choose,
    hadoop_options,
    native_keys,
    native_ref,
    remove_folder,
)
from twophase.sinks.s3parts import PART_SIZE, PartWriter

__all__ = ["BRANCH_META", "PART_SIZE", "S3StagedFileParticipant", "parse_s3_url"]

BRANCH_META: Final = "twophase-branch"
"""User metadata of a final object: ``sink/lineage/checkpoint/attempt/participant/partition``."""
UPLOAD_META: Final = "twophase-upload"
ROWS_META: Final = "twophase-rows"
_HANDLE_PARTS: Final = 32  # up to this many ETags ride in the vote; more: ListParts
_BUCKET_RE: Final = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SEGMENT_RE: Final = re.compile(r"^[A-Za-z0-9_.=-]{1,255}$")
_MAX_PREFIX: Final = 512  # S3 keys are <= 1024 bytes; the names below take up to ~300
_CLIENT_OPTIONS: Final = frozenset({
    "endpoint_url", "aws_access_key_id", "aws_secret_access_key", "aws_session_token",
    "region_name", "verify", "use_ssl", "config",
})
_SECRET_OPTIONS: Final = ("aws_secret_access_key", "aws_session_token")
_CONTENT_TYPES: Final = {"parquet": "application/vnd.apache.parquet",
                         "jsonl": "application/x-ndjson"}


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b/")``; refuse what is not a plain key prefix."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise InvalidRequest(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise InvalidRequest(
            f"invalid bucket name {bucket!r} in {url!r}: use 3-63 characters from a-z 0-9 . - "
            "starting and ending with a letter or digit (S3's bucket rules)"
        )
    prefix = prefix.rstrip("/")
    segments = prefix.split("/") if prefix else []
    for seg in segments:
        if not _SEGMENT_RE.match(seg) or seg in (".", ".."):
            raise InvalidRequest(
                f"invalid key prefix {prefix!r} in {url!r}: segment {seg!r} is not allowed; "
                "use non-empty segments of A-Z a-z 0-9 _ . = - (no '..', no '//')"
            )
    if len(prefix) > _MAX_PREFIX:
        raise InvalidRequest(f"key prefix of {url!r} is longer than {_MAX_PREFIX} characters")
    return bucket, (prefix + "/" if prefix else "")


def _branch_tag(branch: BranchRef) -> str:
    return (f"{branch.sink}/{branch.lineage}/{branch.batch_id}/{branch.attempt}/"
            f"{branch.participant}/{branch.partition}")


def _same_branch(tag: str | None, branch: BranchRef) -> bool:
    """``tag`` names ``branch`` in any attempt (the data lands once per checkpoint)."""
    if not tag:
        return False
    parts = tag.split("/")
    mine = _branch_tag(branch).split("/")
    return len(parts) == 6 and parts[:3] + parts[4:] == mine[:3] + mine[4:]


def _error_code(exc: BaseException) -> str:
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        return str(err.get("Code") or exc.response.get("ResponseMetadata", {})
                   .get("HTTPStatusCode", ""))
    return ""


class S3StagedFileParticipant(StagedFileParticipant):
    """Rows of each branch become one Parquet or JSON-lines object under ``s3://bucket/prefix``."""

    part_size: int = PART_SIZE

    def __init__(
        self,
        path: str,
        format: str = "parquet",
        *,
        name: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        mode: str = "append",
        on_schema_change: str = "fail",
        native: bool | None = None,
    ) -> None:
        self.native = checked_native(native, format)
        self._chosen: tuple[str | None] | None = None  # native_format, once asked
        if on_schema_change == "add_columns":
            raise InvalidRequest(
                f"on_schema_change={on_schema_change!r} is not supported on object storage "
                "yet (the committed objects' schemas are not read back): keep the default "
                "'fail' and write a changed schema under a new prefix"
            )
        self.bucket, self.prefix = parse_s3_url(path)
        options = dict(storage_options or {})
        unknown = sorted(set(options) - _CLIENT_OPTIONS)
        if unknown:
            raise InvalidRequest(
                f"unknown storage_options {unknown}: use boto3 S3 client arguments "
                f"({', '.join(sorted(_CLIENT_OPTIONS))})"
            )
        self.url = f"s3://{self.bucket}/{self.prefix}"
        self.storage_options = options
        self._client: Any = None
        default = self.prefix.rstrip("/").rsplit("/", 1)[-1] or self.bucket
        self._init_common(format, mode, on_schema_change, name, default)

    def describe(self) -> str:
        return f"files participant {self.name!r} ({self.format} in {self.url})"

    def descriptor(self) -> Descriptor:
        """Path, format and storage options; the secret key and session token are left
        out and named in ``secrets`` (rebuilt from ``TWOPHASE_SECRET_<NAME>_<KEY>``); a
        botocore ``config`` object is not recorded (the rebuilt client uses defaults)."""
        options: dict[str, Any] = {"path": self.url, "format": self.format}
        secrets = []
        for k, v in sorted(self.storage_options.items()):
            if k in _SECRET_OPTIONS:
                secrets.append(k)
            elif k != "config":
                options[f"storage.{k}"] = v if isinstance(v, (str, int, float, bool)) else str(v)
        options["secrets"] = ",".join(secrets)
        return {"kind": self.kind, "name": self.name, "target": self.url, "options": options}

    @classmethod
    def from_descriptor(
        cls, descriptor: Descriptor, secrets: Mapping[str, str]
    ) -> S3StagedFileParticipant:
        o, name = descriptor["options"], descriptor["name"]
        storage = {k.removeprefix("storage."): v for k, v in o.items()
                   if k.startswith("storage.")}
        for k in str(o.get("secrets") or "").split(","):
            if k:
                storage[k] = required_secret(name, secrets, k)
        return cls(str(o["path"]), str(o.get("format", "parquet")), name=name,
                   storage_options=storage, native=False)  # it commits, aborts, reads

    # -- the native data path (SparkWritten; twophase.sinks.s3native) ---------------------

    def native_format(self) -> str | None:
        """Parquet when Spark loads Hadoop's S3A file system (``s3native.choose``), asked
        of the JVM once: the sink chooses its path when it is made, and each batch's
        write asks again."""
        if self._chosen is None:
            self._chosen = (choose(self),)
        return self._chosen[0]

    def native_options(self) -> Mapping[str, str]:
        return hadoop_options(self.storage_options)

    def native_location(self, key: TxnKey) -> str:
        return f"s3a://{self.bucket}/{self.staging_prefix}{self.native_name(key)}"

    def adopt(self, key: TxnKey, partitions: int) -> dict[int, Handle]:
        return adopt(self, key, partitions)

    # -- keys -------------------------------------------------------------------------------

    @property
    def staging_prefix(self) -> str:
        return f"{self.prefix}{STAGING_DIR}/"

    def final_key(self, branch: BranchRef) -> str:
        return self.prefix + self.final_name(branch)

    def staged_key(self, branch: BranchRef) -> str:
        return self.staging_prefix + self.staged_name(branch)

    # -- the store --------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            options = dict(self.storage_options)
            options.setdefault("config", Config(
                connect_timeout=5, read_timeout=60,
                retries={"max_attempts": 3, "mode": "standard"},
            ))
            self._client = boto3.client("s3", **options)
        return self._client

    def _explain(self, exc: BaseException, doing: str) -> str:
        """A message naming the cause and the fix of a store error."""
        from botocore.exceptions import (
            ClientError,
            EndpointConnectionError,
            NoCredentialsError,
        )

        where = f"{self.describe()}: {doing}"
        code = _error_code(exc)
        if isinstance(exc, NoCredentialsError):
            return (f"{where}: no AWS credentials found; pass storage_options "
                    "aws_access_key_id/aws_secret_access_key or set the AWS environment "
                    "variables or a profile")
        if isinstance(exc, EndpointConnectionError) or type(exc).__name__ in (
            "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError"
        ):
            return (f"{where}: cannot reach the S3 endpoint ({exc}); check storage_options "
                    "endpoint_url and the network")
        if code == "NoSuchBucket" or (code == "404" and doing.startswith("checking bucket")):
            return (f"{where}: bucket {self.bucket!r} does not exist; create it or fix the "
                    "path")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403",
                    "InvalidToken", "ExpiredToken"):
            return (f"{where}: access denied ({code}); check the credentials "
                    "(storage_options aws_access_key_id/aws_secret_access_key, or the AWS "
                    "environment/profile) and that they may list, read and write "
                    f"s3://{self.bucket}/{self.prefix} (without s3:ListBucket, S3 answers "
                    "403 for a key that does not exist)")
        if isinstance(exc, ClientError):
            return f"{where}: {code}: {exc}"
        return f"{where}: {exc}"

    def _head(self, key: str) -> dict[str, str] | None:
        """An object's user metadata, or None if there is no such object."""
        try:
            found = self.client.head_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            if _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return dict(found.get("Metadata", {}))

    def _list(self, prefix: str, delimiter: str = "") -> Iterator[dict[str, Any]]:
        pages = self.client.get_paginator("list_objects_v2")
        extra = {"Delimiter": delimiter} if delimiter else {}
        for page in pages.paginate(Bucket=self.bucket, Prefix=prefix, **extra):
            yield from page.get("Contents", [])

    def _uploads(self, prefix: str) -> Iterator[dict[str, Any]]:
        pages = self.client.get_paginator("list_multipart_uploads")
        for page in pages.paginate(Bucket=self.bucket, Prefix=prefix):
            yield from page.get("Uploads", [])

    def _committed(self, branch: BranchRef) -> bool:
        meta = self._head(self.final_key(branch))
        if meta is None:
            return False
        if not _same_branch(meta.get(BRANCH_META), branch):
            raise ParticipantError(
                f"{self.describe()}: s3://{self.bucket}/{self.final_key(branch)} exists but "
                "was not written by this branch (no matching twophase metadata); move it "
                "away or write to another prefix"
            )
        return True

    # -- driver-side check ------------------------------------------------------------------

    def check(self, schema: pa.Schema) -> None:
        """Prove the bucket exists and the key may start (and abort) uploads there, before
        any write; leaves nothing behind."""
        self._check_format(schema)
        self.probe()

    def probe(self) -> None:
        """The bucket exists and these credentials may start (and abort) an upload in the
        staging area (run on the driver and on every executor); leaves nothing behind."""
        doing = f"checking bucket {self.bucket!r}"
        try:
            self.client.head_bucket(Bucket=self.bucket)
            probe = f"{self.staging_prefix}.probe-{uuid.uuid4().hex}"
            doing = f"starting a probe upload in bucket {self.bucket!r}"
            upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=probe)
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=probe,
                                               UploadId=upload["UploadId"])
        except Exception as exc:
            if isinstance(exc, ParticipantError):
                raise
            raise self._problem(exc, doing) from None

    def _problem(self, exc: BaseException, doing: str) -> ParticipantError:
        """A store error as a permanent :class:`TargetProblem` (credentials, permissions,
        no bucket) or a plain, retried :class:`ParticipantError` (the endpoint down)."""
        text = self._explain(exc, doing)
        kind = classify(exc)
        if type(exc).__name__ == "NoCredentialsError":
            kind = Failure.AUTHENTICATION
        if not kind.permanent:
            return ParticipantError(text)
        cause, _, fix = text.removeprefix(f"{self.describe()}: ").partition("; ")
        return TargetProblem(self.describe(), cause, fix or "check the path and credentials",
                             host=socket.gethostname(), kind=kind)

    # -- the branch -------------------------------------------------------------------------

    def _handle(self, branch: BranchRef, rows: int, state: str,
                upload: str = "") -> dict[str, str]:
        handle = super()._handle(branch, rows, state)
        if upload:
            handle["upload"] = upload
        return handle

    def prepare(
        self, branch: BranchRef, schema: pa.Schema, batches: Iterable[pa.RecordBatch]
    ) -> Handle:
        key = self.final_key(branch)
        try:
            committed = self._committed(branch)
            self._abort_torn(branch)  # left by a prepare killed midway
            if committed:
                return self._handle(branch, 0, "already-committed")
            upload = self.client.create_multipart_upload(
                Bucket=self.bucket, Key=key, ContentType=_CONTENT_TYPES[self.format],
                Metadata={BRANCH_META: _branch_tag(branch)},
            )["UploadId"]
        except ParticipantError as exc:
            raise PrepareRefused(str(exc)) from exc
        except Exception as exc:
            raise PrepareRefused(self._explain(exc, f"cannot start upload {key}")) from exc
        writer = PartWriter(self.client, self.bucket, key, upload, self.part_size)
        try:
            rows = self._encode(writer, schema, batches)
            etags = writer.finish()
            self.client.put_object(
                Bucket=self.bucket, Key=self.staged_key(branch), Body=b"",
                Metadata={UPLOAD_META: upload, ROWS_META: str(rows),
                          "twophase-parts": str(len(etags))},
            )
        except BaseException as exc:
            writer.shutdown()
            with suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            if isinstance(exc, (ValueError, pa.ArrowException, OSError)) or \
                    type(exc).__module__.startswith("botocore"):
                raise PrepareRefused(self._explain(exc, "rows refused")) from exc
            raise
        handle = self._handle(branch, rows, "prepared", upload)
        if len(etags) <= _HANDLE_PARTS:
            handle["etags"] = ",".join(etags)  # commit needs no ListParts
        return handle

    def _marker_upload(self, branch: BranchRef) -> str | None:
        meta = self._head(self.staged_key(branch))
        return None if meta is None else meta.get(UPLOAD_META, "")

    def commit(self, branch: BranchRef, handle: Handle | None) -> None:
        key, marker = self.final_key(branch), self.staged_key(branch)
        try:
            upload, etags = self._from_handle(branch, handle)
            if upload is None:
                upload = self._marker_upload(branch)
            if upload is None:
                if self._committed(branch):
                    return  # committed before (this attempt, or a redo found it there)
                raise ParticipantError(
                    f"{self.describe()}: cannot commit {self.staged_name(branch)}: neither a "
                    "prepared upload nor the final object exists (the branch was aborted or "
                    "never prepared)"
                )
            try:
                if etags is None:  # another process, or a vote without them: ask the store
                    etags = [
                        p["ETag"]
                        for page in self.client.get_paginator("list_parts").paginate(
                            Bucket=self.bucket, Key=key, UploadId=upload)
                        for p in page.get("Parts", [])
                    ]
                self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload,
                    MultipartUpload={"Parts": [{"PartNumber": i, "ETag": e}
                                               for i, e in enumerate(etags, 1)]},
                )
            except Exception as exc:
                if _error_code(exc) != "NoSuchUpload":
                    raise
                if not self._committed(branch):
                    raise ParticipantError(
                        f"{self.describe()}: cannot commit {self.staged_name(branch)}: its "
                        f"upload {upload} is gone (aborted, or expired by a lifecycle rule "
                        "shorter than the time the branch stayed prepared)"
                    ) from exc
            # The object is whole and visible; the marker going is housekeeping (a marker
            # left by a crash here is found stale by in_doubt and commit).
            self.client.delete_object(Bucket=self.bucket, Key=marker)
        except ParticipantError:
            raise
        except Exception as exc:
            raise ParticipantError(
                self._explain(exc, f"cannot commit {self.staged_name(branch)}")
            ) from exc

    def _from_handle(self, branch: BranchRef,
                     handle: Handle | None) -> tuple[str | None, list[str] | None]:
        """The upload and its ETags from this branch's own YES vote, when it carries them."""
        if not handle or handle.get("state") != "prepared" or \
                handle.get("staged") != self.staged_name(branch) or not handle.get("upload"):
            return None, None
        etags = handle.get("etags")
        return handle["upload"], (etags.split(",") if etags else None)

    def _abort_torn(self, branch: BranchRef) -> None:
        """Abort uploads on the branch's key that no marker names: prepares killed before
        their marker was written. Never prepared, so nothing may commit them."""
        key = self.final_key(branch)
        open_ = [u["UploadId"] for u in self._uploads(key) if u["Key"] == key]
        if not open_:
            return
        stem = self.staged_key(branch)
        stem = stem[: stem.rindex(".attempt-")] + ".attempt-"
        named = set()
        for marker in self._list(stem):
            meta = self._head(marker["Key"])
            if meta is not None:
                named.add(meta.get(UPLOAD_META))
        for upload in open_:
            if upload not in named:
                with suppress(Exception):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=key,
                                                       UploadId=upload)

    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        key = self.final_key(branch)
        try:
            upload = self._marker_upload(branch)
            if upload is not None:
                if upload:
                    try:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=key,
                                                           UploadId=upload)
                    except Exception as exc:
                        if _error_code(exc) != "NoSuchUpload":
                            raise
                self.client.delete_object(Bucket=self.bucket, Key=self.staged_key(branch))
            self._abort_torn(branch)
            remove_folder(self, branch.key)  # a native write of its attempt, not adopted
        except Exception as exc:
            raise ParticipantError(
                self._explain(exc, f"cannot abort {self.staged_name(branch)}")
            ) from exc

    def status(self, branch: BranchRef) -> BranchStatus:
        try:
            if self._committed(branch):
                return BranchStatus.COMMITTED
            if self._marker_upload(branch) is not None:
                return BranchStatus.PREPARED
            if native_keys(self, branch.key):
                return BranchStatus.PREPARED  # a native write of its attempt, not adopted
        except ParticipantError:
            raise
        except Exception as exc:
            raise ParticipantError(self._explain(exc, "reading the branch status")) from exc
        return BranchStatus.ABSENT

    def in_doubt(self, sink: str) -> list[BranchRef]:
        found: list[BranchRef] = []
        try:
            for obj in self._list(f"{self.staging_prefix}{sink}~"):
                n = obj["Key"].removeprefix(self.staging_prefix)
                if "/" in n:  # in a native write's folder: its attempt's partition 0
                    w = native_ref(self, sink, n.split("/", 1)[0])
                    if w is not None and w not in found:
                        found.append(w)
                    continue
                m = STAGED_NAME.match(n)
                if not m or m["sink"] != sink or m["participant"] != self.name \
                        or m["ext"] != self.ext:
                    continue
                try:
                    ref = BranchRef(sink=sink, lineage=m["lineage"],
                                    batch_id=int(m["checkpoint"]), attempt=int(m["attempt"]),
                                    participant=m["participant"],
                                    partition=int(m["partition"]))
                except ValueError:
                    continue
                if self.staged_name(ref) != n:
                    continue
                meta = self._head(self.final_key(ref))
                if meta is not None and meta.get(BRANCH_META) == _branch_tag(ref):
                    # committed, then the committer died before deleting the marker
                    self.client.delete_object(Bucket=self.bucket, Key=obj["Key"])
                    continue
                found.append(ref)
        except Exception as exc:
            raise ParticipantError(self._explain(exc, "listing prepared branches")) from exc
        return sorted(found)

    # -- readers ----------------------------------------------------------------------------

    def arrow_filesystem(self) -> Any:
        """A ``pyarrow.fs.S3FileSystem`` for the same store (what a consumer would read with)."""
        from pyarrow.fs import S3FileSystem

        o = self.storage_options
        kw: dict[str, Any] = {}
        endpoint = o.get("endpoint_url")
        if endpoint:
            scheme, _, host = str(endpoint).partition("://")
            kw["endpoint_override"], kw["scheme"] = host.rstrip("/"), scheme
        for ours, theirs in (("aws_access_key_id", "access_key"),
                             ("aws_secret_access_key", "secret_key"),
                             ("aws_session_token", "session_token"),
                             ("region_name", "region")):
            if o.get(ours):
                kw[theirs] = o[ours]
        return S3FileSystem(**kw)

    def read_back(self, column: str) -> ReadBack:
        """``column`` of the visible objects read through a pyarrow dataset over S3; markers
        under the staging prefix are the prepared leftovers, uploads no marker names are
        the litter of prepares killed midway."""
        import pyarrow.dataset as ds

        visible = sorted(
            o["Key"] for o in self._list(self.prefix, delimiter="/")
            if not o["Key"].removeprefix(self.prefix).startswith(("_", "."))
        )
        values: list[Any] = []
        if visible:
            fmt = "parquet" if self.format == "parquet" else "json"
            paths = [f"{self.bucket}/{k}" for k in visible]
            values = ds.dataset(paths, format=fmt, filesystem=self.arrow_filesystem()) \
                .to_table(columns=[column]).column(column).to_pylist()
        staged = [o["Key"].removeprefix(self.staging_prefix)
                  for o in self._list(self.staging_prefix)]
        # a native write not adopted counts once, as a prepared branch (local folders too)
        prepared = len({n.split("/", 1)[0] for n in staged})
        uploads = sum(1 for u in self._uploads(self.prefix)
                      if "/" not in u["Key"].removeprefix(self.prefix))
        return ReadBack(tuple(values), prepared=prepared, temp=max(0, uploads - prepared))

    def close(self) -> None:
        self._client = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None  # a boto3 client does not pickle; each process makes its own
        return state
