"""The native data path of an ``s3://`` files participant: Spark's own Parquet writer
writes the attempt's objects through Hadoop's S3A file system, and ``adopt`` makes each
the branch's prepared state server-side; no row crosses into Python
(docs/decisions.md, 2026-11-26, "S3 files native").

- **write** (``twophase.engine.native``): ``s3a://bucket/P/_twophase_staging/<native name>/``,
  one ``part-NNNNN-*.parquet`` object per task; the participant's ``storage_options``
  ride as per-write Hadoop options (``fs.s3a.endpoint``, keys, path-style access,
  region). The folder starts with ``_``: readers of the prefix skip it.
- **adopt**: per written object with rows, ``CreateMultipartUpload`` on the branch's
  final key, ``UploadPartCopy`` of the written object as the upload's parts (one part up
  to 5 GiB, else ranged parts), then the marker object: the branch is exactly what the
  Python path's prepare leaves. Then every object of the write folder is deleted.
- A driver killed between the write and the end of adopt leaves the write folder:
  ``status`` reads any branch of its attempt as PREPARED, ``in_doubt`` lists it as
  partition 0, ``abort`` deletes its objects by name (as the local folder's native path).

Chosen automatically only when ``org.apache.hadoop.fs.s3a.S3AFileSystem`` loads in the
session's JVM (:func:`s3a_loads`); else the Python path, and the fix is logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Final

import pyarrow.parquet as pq

from twophase.errors import InvalidRequest
from twophase.participant import BranchRef, Handle, ParticipantError
from twophase.protocol import TxnKey
from twophase.sinks.batchfiles import spark_parts
from twophase.sinks.files import NATIVE_NAME

if TYPE_CHECKING:
    from twophase.sinks.s3 import S3StagedFileParticipant

__all__ = ["HADOOP_AWS_HINT", "S3A_CLASS", "adopt", "choose", "hadoop_options",
           "native_keys", "native_ref", "remove_folder", "s3a_loads"]

log = logging.getLogger("twophase.sink")

S3A_CLASS: Final = "org.apache.hadoop.fs.s3a.S3AFileSystem"
HADOOP_AWS_HINT: Final = (
    "add org.apache.hadoop:hadoop-aws:<the Hadoop version of your Spark, e.g. 3.5.0 for "
    "pyspark 4.3> to spark.jars.packages (or its jars to spark.jars) when building the "
    "session, or pass native=False to silence this")
COPY_PART: Final = 1 << 30  # ranged copies of an object over MAX_COPY: 1 GiB parts
MAX_COPY: Final = 5 << 30  # S3's limit on one UploadPartCopy
_told: set[str] = set()


def _tell_once(message: str) -> None:
    if message not in _told:
        _told.add(message)
        log.warning(message)


def s3a_loads(what: str) -> bool:
    """True when the process's Spark session (classic, on this driver) loads Hadoop's S3A
    file system; else False, and the reason and the fix are logged once (``what``: the
    participant). Read when the sink is made: a sink made before any Spark session takes
    the Python path."""
    try:
        from pyspark import SparkContext

        sc = SparkContext._active_spark_context
    except ImportError:
        sc = None
    if sc is None:
        _tell_once(f"{what}: the Python path (no classic Spark session on this driver when "
                   "the sink was made: Spark Connect, or the sink made first); the native "
                   "path needs Hadoop's S3A in the session's JVM")
        return False
    jvm: Any = sc._jvm
    try:
        loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
        jvm.java.lang.Class.forName(S3A_CLASS, False, loader)
    except Exception:  # py4j's error for ClassNotFoundException
        _tell_once(f"{what}: the Python path (every row through Python and boto3): "
                   f"Spark cannot load {S3A_CLASS}; for Spark's own writer, "
                   f"{HADOOP_AWS_HINT}")
        return False
    return True


def choose(part: S3StagedFileParticipant) -> str | None:
    """``native_format``: Parquet, unless ``native=False``, when Spark loads Hadoop's S3A
    file system; without it the Python path (logged once with the fix), and
    ``native=True`` is refused naming the fix."""
    if part.native is False or part.format != "parquet":
        return None
    if not s3a_loads(part.describe()):
        if part.native:
            raise InvalidRequest(f"{part.describe()}: native=True, but Spark cannot load "
                                 f"Hadoop's S3A file system: {HADOOP_AWS_HINT}")
        return None
    return "parquet"


def hadoop_options(storage_options: dict[str, Any]) -> dict[str, str]:
    """The participant's boto3 ``storage_options`` as S3A's Hadoop options, passed with
    the native write (so they reach the write's Hadoop configuration on every executor).
    Spark redacts the keys and token in plans and the UI (``spark.redaction.regex``
    matches ``secret``, ``token`` and ``access.key``). Without keys, S3A's own credential
    chain applies (environment, profile, instance role), as boto3's does."""
    o = storage_options
    out: dict[str, str] = {}
    endpoint = o.get("endpoint_url")
    if endpoint:
        out["fs.s3a.endpoint"] = str(endpoint)
        out["fs.s3a.path.style.access"] = "true"  # a custom endpoint: no bucket DNS names
        out["fs.s3a.connection.ssl.enabled"] = str(str(endpoint).startswith("https:")).lower()
    if o.get("use_ssl") is False:
        out["fs.s3a.connection.ssl.enabled"] = "false"
    if o.get("region_name"):
        out["fs.s3a.endpoint.region"] = str(o["region_name"])
    if o.get("aws_access_key_id"):
        out["fs.s3a.access.key"] = str(o["aws_access_key_id"])
        out["fs.s3a.secret.key"] = str(o.get("aws_secret_access_key", ""))
        provider = "SimpleAWSCredentialsProvider"
        if o.get("aws_session_token"):
            out["fs.s3a.session.token"] = str(o["aws_session_token"])
            provider = "TemporaryAWSCredentialsProvider"
        out["fs.s3a.aws.credentials.provider"] = f"org.apache.hadoop.fs.s3a.{provider}"
    return out


def folder_prefix(part: S3StagedFileParticipant, key: TxnKey) -> str:
    """The key prefix of attempt ``key``'s write folder (ends in ``/``)."""
    return f"{part.staging_prefix}{part.native_name(key)}/"


def native_ref(part: S3StagedFileParticipant, sink: str, folder: str) -> BranchRef | None:
    """The branch ``in_doubt`` reports for a write folder of ``sink``: its attempt's
    partition 0 (None for another sink's or participant's, or a foreign name)."""
    w = NATIVE_NAME.match(folder)
    if not w or w["sink"] != sink or w["participant"] != part.name:
        return None
    try:
        ref = BranchRef(sink, w["lineage"], int(w["checkpoint"]), int(w["attempt"]),
                        part.name, 0)
    except ValueError:
        return None
    return ref if part.native_name(ref.key) == folder else None


def native_keys(part: S3StagedFileParticipant, key: TxnKey) -> list[dict[str, Any]]:
    """Every object of attempt ``key``'s write folder (Spark's files, its temporary
    ones, S3A's directory markers)."""
    return list(part._list(folder_prefix(part, key)))


def remove_folder(part: S3StagedFileParticipant, key: TxnKey) -> None:
    """Delete every object of attempt ``key``'s write folder (a write or an adopt killed
    midway, or adopt's end): nothing in it was ever voted on."""
    for chunk in _chunks([o["Key"] for o in native_keys(part, key)], 1000):
        part.client.delete_objects(Bucket=part.bucket, Delete={
            "Objects": [{"Key": k} for k in chunk], "Quiet": True})


def _chunks(items: list[str], n: int) -> Iterator[list[str]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


def _rows(part: S3StagedFileParticipant, key: str) -> int:
    """The row count in a written object's Parquet footer (the footer alone is read)."""
    with part.arrow_filesystem().open_input_file(f"{part.bucket}/{key}") as f:
        return int(pq.ParquetFile(f).metadata.num_rows)


def _copy_parts(part: S3StagedFileParticipant, final: str, upload: str, source: str,
                size: int) -> list[str]:
    """``UploadPartCopy`` of ``source`` into ``upload``: one part when S3 allows it (a
    sole part may be any size up to 5 GiB), else 1 GiB ranges. The ETags, in order."""
    ranges = [None] if size <= MAX_COPY else [
        f"bytes={lo}-{min(lo + COPY_PART, size) - 1}" for lo in range(0, size, COPY_PART)]
    etags = []
    for number, byte_range in enumerate(ranges, 1):
        extra = {"CopySourceRange": byte_range} if byte_range else {}
        done = part.client.upload_part_copy(
            Bucket=part.bucket, Key=final, UploadId=upload, PartNumber=number,
            CopySource={"Bucket": part.bucket, "Key": source}, **extra)
        etags.append(str(done["CopyPartResult"]["ETag"]))
    return etags


def adopt(part: S3StagedFileParticipant, key: TxnKey, partitions: int) -> dict[int, Handle]:
    """The objects Spark wrote for attempt ``key`` become its prepared branches, copied
    server-side (no data through this process); the write folder goes last, after every
    marker: until then ``status`` reads the attempt as PREPARED and an abort sweeps it."""
    from twophase.sinks.s3 import (
        _CONTENT_TYPES,
        _HANDLE_PARTS,
        BRANCH_META,
        ROWS_META,
        UPLOAD_META,
        _branch_tag,
    )

    prefix = folder_prefix(part, key)
    try:
        written = {o["Key"].removeprefix(prefix): o for o in native_keys(part, key)}
    except Exception as exc:
        raise ParticipantError(part._explain(exc, f"listing Spark's write {prefix}")) from exc
    # no object at all is no row at all: S3 has no folder a successful write must leave
    names = [n for n in written if "/" not in n]  # not the committer's _temporary/
    handles: dict[int, Handle] = {}
    for partition, n in spark_parts(names, partitions, part.describe()):
        ref = BranchRef(*key, participant=part.name, partition=partition)
        source, final, upload = prefix + n, part.final_key(ref), ""
        try:
            rows = _rows(part, source)
            if not rows:
                continue
            if part._committed(ref):  # a redo: the final object names this branch
                handles[partition] = part._handle(ref, 0, "already-committed")
                continue
            part._abort_torn(ref)
            upload = part.client.create_multipart_upload(
                Bucket=part.bucket, Key=final, ContentType=_CONTENT_TYPES[part.format],
                Metadata={BRANCH_META: _branch_tag(ref)})["UploadId"]
            etags = _copy_parts(part, final, upload, source, int(written[n]["Size"]))
            part.client.put_object(
                Bucket=part.bucket, Key=part.staged_key(ref), Body=b"",
                Metadata={UPLOAD_META: upload, ROWS_META: str(rows),
                          "twophase-parts": str(len(etags))})
        except Exception as exc:
            if upload:  # no marker names it: never prepared
                with suppress(Exception):
                    part.client.abort_multipart_upload(Bucket=part.bucket, Key=final,
                                                       UploadId=upload)
            if isinstance(exc, ParticipantError):
                raise
            raise ParticipantError(part._explain(exc, f"adopting {source}")) from exc
        handle = part._handle(ref, rows, "prepared", upload)
        if len(etags) <= _HANDLE_PARTS:
            handle["etags"] = ",".join(etags)  # commit needs no ListParts
        handles[partition] = handle
    try:
        remove_folder(part, key)
    except Exception as exc:
        raise ParticipantError(part._explain(exc, f"deleting Spark's write {prefix}")) from exc
    return handles
