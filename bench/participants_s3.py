"""The S3 files participant against a plain boto3 upload of the same Parquet, in one run.

Reproduce (from the repository root, after `bash scripts/test.sh` made .venv)::

    .venv/bin/python bench/participants_s3.py                      # 10k, 100k, 1M rows
    .venv/bin/python bench/participants_s3.py --sizes 100000 --repeats 9
    .venv/bin/python bench/participants_s3.py --endpoint-url http://host:9000 \\
        --bucket b --access-key K --secret-key S                  # a store of yours

Without ``--endpoint-url`` a private moto server (``twophase.testing.locals3``) is started
on loopback and stopped at the end: it runs in Python on the same cores, so absolute
figures say little about S3; the ratio is what this measures (the same server, the same
rows, alternating runs, median of ``--repeats``).

- ``s3-parquet``: ``StagedFileParticipant("s3://...").prepare + commit`` (CreateMultipartUpload,
  parts of 8 MiB streamed while encoding, a marker PUT; HEAD, ListParts,
  CompleteMultipartUpload, marker DELETE) against pyarrow writing the Parquet into memory
  then ``boto3 upload_fileobj`` (one PUT up to 8 MiB, threaded multipart above): what a
  writer without two-phase commit does;
- ``s3-parquet upload only``: the same participant run against ``upload_fileobj`` of the
  Parquet bytes encoded beforehand (informative: the encoding is left out of raw).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from bench.participants import make_batch  # noqa: E402
from twophase.participant import BranchRef  # noqa: E402
from twophase.sinks.files import StagedFileParticipant  # noqa: E402
from twophase.testing.locals3 import LocalS3  # noqa: E402


def _participant_run(bucket: str, options: dict[str, Any], batch: pa.RecordBatch) -> float:
    p = StagedFileParticipant(f"s3://{bucket}/bench-{uuid.uuid4().hex[:8]}", "parquet",
                              storage_options=options)
    p.check(batch.schema)  # driver-side, once per query
    b = BranchRef("bench", "l", 0, 0, p.name, 0)
    t0 = time.perf_counter()
    p.commit(b, p.prepare(b, batch.schema, [batch]))
    return time.perf_counter() - t0


def _encode(batch: pa.RecordBatch) -> bytes:
    buf = io.BytesIO()
    with pq.ParquetWriter(buf, batch.schema) as w:
        w.write_batch(batch)
    return buf.getvalue()


def _raw_run(client: Any, bucket: str, batch: pa.RecordBatch, data: bytes | None) -> float:
    key = f"raw-{uuid.uuid4().hex[:8]}/part-0.parquet"
    t0 = time.perf_counter()
    body = data if data is not None else _encode(batch)
    client.upload_fileobj(io.BytesIO(body), bucket, key)
    return time.perf_counter() - t0


def _alternate(repeats: int, a: Callable[[], float], b: Callable[[], float]) -> tuple[
    list[float], list[float]
]:
    ta: list[float] = []
    tb: list[float] = []
    a(), b()  # warm-up: connections, imports
    for i in range(repeats):
        if i % 2 == 0:
            ta.append(a())
            tb.append(b())
        else:
            tb.append(b())
            ta.append(a())
    return ta, tb


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--endpoint-url")
    ap.add_argument("--bucket", default="twophase-bench")
    ap.add_argument("--access-key")
    ap.add_argument("--secret-key")
    ap.add_argument("--region", default="us-east-1")
    args = ap.parse_args(argv)
    server: LocalS3 | None = None
    try:
        if args.endpoint_url is None:
            server = LocalS3().start()
            options: dict[str, Any] = server.storage_options
            server.create_bucket(args.bucket)
        else:
            options = {"endpoint_url": args.endpoint_url, "region_name": args.region}
            if args.access_key:
                options |= {"aws_access_key_id": args.access_key,
                            "aws_secret_access_key": args.secret_key}
        import boto3

        client = boto3.client("s3", **options)
        print(f"{'section':<28} {'rows':>9} {'MiB':>6} {'participant r/s':>16} "
              f"{'boto3 r/s':>12} {'ratio':>6}")
        for n in args.sizes:
            batch = make_batch(n)
            data = _encode(batch)
            mib = len(data) / 2**20
            for section, pre in (("s3-parquet", None), ("s3-parquet upload only", data)):
                tp, tr = _alternate(
                    args.repeats,
                    lambda b=batch: _participant_run(args.bucket, options, b),
                    lambda b=batch, d=pre: _raw_run(client, args.bucket, b, d),
                )
                rp, rr = n / statistics.median(tp), n / statistics.median(tr)
                print(f"{section:<28} {n:>9} {mib:>6.1f} {rp:>16,.0f} {rr:>12,.0f} "
                      f"{rp / rr:>6.2f}", flush=True)
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
