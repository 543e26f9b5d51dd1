"""A smoke job per extra, run by tests/system/test_wheel.py inside a clean venv that holds
only the built wheel and its dependencies (never this repository: it is passed to
``python -I -c`` from a temporary folder, so nothing here may import from ``tests``).

Each extra's participant prepares one branch through the installed conformance kit,
which checks the prepared rows are invisible, commits it, and checks a plain reader of
that system sees exactly the branch's rows: Delta and Iceberg on local files, the SQL
participant on the suite's MariaDB, the S3 files participant on the suite's S3-API
server. The connect extra: Spark Connect's client and its gRPC channel (no server).
(spark, postgres, kafka and the files participant run in ``twophase demo``.)
Argument: a JSON object with ``mariadb``, ``s3`` (storage options), ``bucket`` and
``workdir``. Prints ``ok <extra>`` per extra.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any


def _delta(work: Path, _: dict[str, Any]) -> tuple[Any, Any]:
    from deltalake import DeltaTable

    from twophase.sinks.delta import DeltaParticipant

    path = str(work / "delta")

    def rows() -> list[dict[str, Any]]:
        if not DeltaTable.is_deltatable(path):
            return []
        return list(DeltaTable(path).to_pyarrow_table().to_pylist())

    return (lambda: DeltaParticipant(path, name="dl")), rows


def _iceberg(work: Path, _: dict[str, Any]) -> tuple[Any, Any]:
    from pyiceberg.catalog import load_catalog

    from twophase.sinks.iceberg import IcebergParticipant

    (work / "wh").mkdir()
    catalog = {"type": "sql", "uri": f"sqlite:///{work}/catalog.db",
               "warehouse": f"file://{work}/wh"}

    def rows() -> list[dict[str, Any]]:
        tbl = load_catalog("default", **catalog).load_table("smoke.t")
        return [] if tbl.current_snapshot() is None else list(tbl.scan().to_arrow().to_pylist())

    return (lambda: IcebergParticipant("smoke.t", catalog, name="ice")), rows


def _sql(_: Path, args: dict[str, Any]) -> tuple[Any, Any]:
    import sqlalchemy as sa

    from twophase.sinks.sql import SqlAlchemyParticipant

    table = f"smoke_{uuid.uuid4().hex[:10]}"
    engine = sa.create_engine(args["mariadb"], poolclass=sa.NullPool)

    def rows() -> list[dict[str, Any]]:
        with engine.connect() as conn:
            t = sa.Table(table, sa.MetaData(), autoload_with=conn)
            for c in t.columns:  # MySQL's DOUBLE reflects as Decimal by default
                if isinstance(c.type, sa.Float):
                    c.type.asdecimal = False
            return [dict(r) for r in conn.execute(sa.select(t)).mappings()]

    return (lambda: SqlAlchemyParticipant(args["mariadb"], table, name="sql")), rows


def _s3(_: Path, args: dict[str, Any]) -> tuple[Any, Any]:
    import boto3

    from twophase.sinks.files import StagedFileParticipant

    bucket, prefix = args["bucket"], f"wheel-{uuid.uuid4().hex[:10]}"
    client = boto3.client("s3", **args["s3"])

    def rows() -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
        for obj in listed.get("Contents", []):
            name = obj["Key"].removeprefix(prefix + "/")
            if "/" not in name and name.startswith("part-"):  # committed files only
                body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
                out += [json.loads(line) for line in body.splitlines()]
        return out

    return (lambda: StagedFileParticipant(f"s3://{bucket}/{prefix}", "jsonl", name="s3",
                                          storage_options=args["s3"])), rows


class _Target:
    def __init__(self, make: Any, rows: Any) -> None:
        self.participant, self.rows = make, rows

    def close(self) -> None:
        """Each target lives in the smoke job's own folder, table or prefix."""


def main() -> None:
    args = json.loads(sys.argv[1])
    work = Path(args["workdir"])
    from twophase.testing.conformance import Harness, check_prepared_data_invisible_until_commit

    for extra, build in (("delta", _delta), ("iceberg", _iceberg), ("sql", _sql), ("s3", _s3)):
        folder = work / extra
        folder.mkdir(parents=True)
        make, rows = build(folder, args)
        check_prepared_data_invisible_until_commit(
            Harness(id=extra, new_target=lambda m=make, r=rows: _Target(m, r)))
        print("ok", extra, flush=True)
    import pyspark.sql.connect.session  # noqa: F401  (checks its packages at import)
    from pyspark.sql.connect.client import SparkConnectClient

    SparkConnectClient("sc://127.0.0.1:15002").close()  # a gRPC channel, not yet dialled
    print("ok connect", flush=True)


if __name__ == "__main__":
    main()
