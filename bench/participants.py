"""Participant throughput against the raw library doing the same writes, in one run.

Reproduce (from the repository root, after `bash scripts/test.sh` made .venv)::

    .venv/bin/python bench/participants.py                 # 10k and 100k rows
    .venv/bin/python bench/participants.py --sizes 10000 --repeats 9
    .venv/bin/python bench/participants.py --dsn postgresql://u@host/db

Without ``--dsn`` a private PostgreSQL server (``twophase.testing.localpg``, fsync on unless
``--no-fsync``) is started in a temporary folder and stopped at the end; files go to a
temporary folder (``--dir`` to choose the disk).

What is compared (median of ``--repeats`` runs, alternating, fresh table/folder each):

- postgres: ``PostgresParticipant.prepare + commit`` (BEGIN, COPY, marker INSERT,
  PREPARE TRANSACTION, COMMIT PREPARED) against raw psycopg ``BEGIN; COPY ... FROM STDIN
  (FORMAT csv) with pyarrow-built CSV; COMMIT`` on an open connection;
- upsert: ``PostgresParticipant(mode="upsert")`` prepare + commit (COPY into a staging
  table, ``INSERT ... ON CONFLICT DO UPDATE``, marker, PREPARE, COMMIT PREPARED) against a
  plain psycopg ``executemany`` of ``INSERT ... ON CONFLICT DO UPDATE`` of the same rows in
  one transaction (``--only upsert``); half the keys already exist;
- copy methods (why the participant uses CSV): psycopg ``Copy.write_row`` per row against
  pyarrow CSV chunks, both raw, same transaction shape;
- sql: ``SqlAlchemyParticipant`` on a private MariaDB (XA) against plain SQLAlchemy bulk
  inserts, same chunking, one transaction per batch (``bench/participants_sql.py``;
  ``--sql-url`` for another server);
- iceberg: ``IcebergParticipant`` (P=1 and ``--iceberg-partitions`` branch prepares +
  one ``commit_batch``) against a plain pyiceberg ``table.append`` of the batch, on a SQL
  catalog in a temporary folder;
- delta: ``DeltaParticipant`` (P=2 branch prepares + one ``commit_batch``) against plain
  ``write_deltalake(mode="append")`` of the same batch (at-least-once), as one commit per
  batch and as P commits (``bench/participants_delta.py``);
- files (parquet, jsonl): ``StagedFileParticipant.prepare + commit`` against raw pyarrow
  write of the same file + fsync + ``os.replace`` + directory fsync (the least a durable
  atomic writer does); the no-fsync raw figure is printed too for reference.

The goal is participant/raw >= 0.90 for every row. Sections are functions; a Kafka section
is added when ``bench/participants_kafka.py`` defines ``bench_kafka(sizes, repeats)``,
which returns an iterable of ``(section, rows, participant_rows_per_s, raw_rows_per_s)``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from psycopg import sql  # noqa: E402

from twophase.jsoncodec import json_rows  # noqa: E402
from twophase.participant import BranchRef  # noqa: E402
from twophase.sinks.files import StagedFileParticipant  # noqa: E402
from twophase.sinks.postgres import PostgresParticipant  # noqa: E402
from twophase.sinks.postgres.arrow import csv_chunks  # noqa: E402
from twophase.testing.localpg import LocalPostgres  # noqa: E402


class Result(NamedTuple):
    section: str
    rows: int
    participant_rps: float
    raw_rps: float


def make_batch(n: int) -> pa.RecordBatch:
    """Orders-like rows: ints, text with awkward characters, floats, timestamps, NULLs."""
    ids = pa.array(range(n), pa.int64())
    labels = pc.binary_join_element_wise(
        pa.array(["customer \"", "a,b", "line\nbreak", "plain"] * (n // 4 + 1))[:n],
        pc.cast(ids, pa.string()), "-",
    )
    amount = pc.multiply(pc.cast(ids, pa.float64()), 0.25)
    qty = pa.array([None if i % 10 == 0 else i % 100 for i in range(n)], pa.int32())
    ts = pc.cast(pc.add(ids, 1_700_000_000_000_000), pa.timestamp("us", tz="UTC"))
    return pa.RecordBatch.from_arrays(
        [ids, labels, amount, qty, ts], names=["id", "label", "amount", "qty", "ts"]
    )


def _median_rps(n: int, timings: list[float]) -> float:
    return n / statistics.median(timings)


def _alternate(repeats: int, a: Callable[[], float], b: Callable[[], float]) -> tuple[
    list[float], list[float]
]:
    ta: list[float] = []
    tb: list[float] = []
    a(), b()  # warm-up: connections, imports, page cache
    for i in range(repeats):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        x, y = first(), second()
        if i % 2 == 0:
            ta.append(x)
            tb.append(y)
        else:
            ta.append(y)
            tb.append(x)
    return ta, tb


# -- postgres ------------------------------------------------------------------------------


def _pg_participant_run(dsn: str, batch: pa.RecordBatch) -> float:
    p = PostgresParticipant(dsn, f"bench_{uuid.uuid4().hex[:8]}", marker_table="bench_markers")
    p.check(batch.schema)  # once per query on the driver: not part of the timed write
    b = BranchRef("bench", uuid.uuid4().hex[:16], 0, 0, p.name, 0)
    p._conn_ok()  # an executor's connection is open after its first batch
    t0 = time.perf_counter()
    p.commit(b, p.prepare(b, batch.schema, [batch]))
    dt = time.perf_counter() - t0
    p.close()
    return dt


def _new_table(conn: psycopg.Connection[Any], prefix: str) -> sql.Identifier:
    name = sql.Identifier(f"{prefix}_{uuid.uuid4().hex[:8]}")
    conn.execute(sql.SQL(
        "CREATE TABLE {} (id bigint, label text, amount double precision, "
        "qty integer, ts timestamptz)").format(name))
    return name


def _pg_csv_run(conn: psycopg.Connection[Any], batch: pa.RecordBatch) -> float:
    """Raw psycopg: BEGIN; COPY (FORMAT csv) of pyarrow-built CSV; COMMIT."""
    cols = sql.SQL(", ").join(map(sql.Identifier, batch.schema.names))
    stmt = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(_new_table(conn, "bench"), cols)
    t0 = time.perf_counter()
    with conn.transaction(), conn.cursor() as cur, cur.copy(stmt) as copy:
        for chunk in csv_chunks(batch):
            copy.write(memoryview(chunk))
    return time.perf_counter() - t0


def _pg_write_row_run(conn: psycopg.Connection[Any], batch: pa.RecordBatch) -> float:
    """Raw psycopg: BEGIN; COPY (text) with Copy.write_row per row; COMMIT."""
    cols = sql.SQL(", ").join(map(sql.Identifier, batch.schema.names))
    stmt = sql.SQL("COPY {} ({}) FROM STDIN").format(_new_table(conn, "bench"), cols)
    t0 = time.perf_counter()
    columns = [c.to_pylist() for c in batch.columns]
    with conn.transaction(), conn.cursor() as cur, cur.copy(stmt) as copy:
        for row in zip(*columns, strict=True):
            copy.write_row(row)
    return time.perf_counter() - t0


def bench_postgres(dsn: str, sizes: Iterable[int], repeats: int) -> list[Result]:
    out: list[Result] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET TIME ZONE 'UTC'")
        for n in sizes:
            batch = make_batch(n)
            tp, tr = _alternate(
                repeats, partial(_pg_participant_run, dsn, batch), partial(_pg_csv_run, conn, batch)
            )
            out.append(Result("postgres", n, _median_rps(n, tp), _median_rps(n, tr)))
            _drop_bench_tables(conn)
    return out


def bench_copy_methods(dsn: str, sizes: Iterable[int], repeats: int) -> list[Result]:
    """pyarrow CSV (what the participant uses) against psycopg write_row per row."""
    out: list[Result] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET TIME ZONE 'UTC'")
        for n in sizes:
            batch = make_batch(n)
            tc, tw = _alternate(
                max(1, repeats // 2), partial(_pg_csv_run, conn, batch),
                partial(_pg_write_row_run, conn, batch),
            )
            out.append(Result("copy: csv vs write_row", n, _median_rps(n, tc), _median_rps(n, tw)))
            _drop_bench_tables(conn)
    return out


def _prefilled(conn: psycopg.Connection[Any], batch: pa.RecordBatch) -> str:
    """A keyed table already holding the first half of the batch's ids (old values), so
    the upsert updates half the rows and inserts the other half."""
    name = f"bench_up_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL(
        "CREATE TABLE {} (id bigint PRIMARY KEY, label text, amount double precision, "
        "qty integer, ts timestamptz)").format(sql.Identifier(name)))
    conn.execute(sql.SQL(
        "INSERT INTO {} (id, label, amount, qty, ts) SELECT i, 'old', 0, 0, now() "
        "FROM generate_series(0, %s) AS i").format(sql.Identifier(name)),
        (batch.num_rows // 2 - 1,))
    return name


def _pg_upsert_participant_run(dsn: str, conn: psycopg.Connection[Any],
                               batch: pa.RecordBatch) -> float:
    """PostgresParticipant(mode='upsert'): COPY into a staging table, INSERT ... ON
    CONFLICT DO UPDATE, marker, PREPARE TRANSACTION, COMMIT PREPARED."""
    p = PostgresParticipant(dsn, _prefilled(conn, batch), marker_table="bench_markers",
                            mode="upsert", key="id")
    p.check(batch.schema)
    b = BranchRef("bench", uuid.uuid4().hex[:16], 0, 0, p.name, 0)
    p._conn_ok()
    t0 = time.perf_counter()
    p.commit(b, p.prepare(b, batch.schema, [batch]))
    dt = time.perf_counter() - t0
    p.close()
    return dt


def _pg_upsert_executemany_run(conn: psycopg.Connection[Any], batch: pa.RecordBatch) -> float:
    """Plain psycopg: BEGIN; executemany(INSERT ... VALUES ... ON CONFLICT (id) DO UPDATE)
    over the rows as Python tuples (psycopg pipelines it); COMMIT."""
    table = sql.Identifier(_prefilled(conn, batch))
    names = batch.schema.names
    stmt = sql.SQL("INSERT INTO {} ({}) VALUES ({}) ON CONFLICT (id) DO UPDATE SET {}").format(
        table, sql.SQL(", ").join(map(sql.Identifier, names)),
        sql.SQL(", ").join(sql.Placeholder() * len(names)),
        sql.SQL(", ").join(sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c))
                           for c in names if c != "id"),
    )
    t0 = time.perf_counter()
    columns = [c.to_pylist() for c in batch.columns]
    with conn.transaction(), conn.cursor() as cur:
        cur.executemany(stmt, list(zip(*columns, strict=True)))
    return time.perf_counter() - t0


def bench_upsert(dsn: str, sizes: Iterable[int], repeats: int) -> list[Result]:
    """The upsert mode (COPY-based, prepared) against plain executemany, same rows."""
    out: list[Result] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET TIME ZONE 'UTC'")
        for n in sizes:
            batch = make_batch(n)
            tp, tr = _alternate(
                max(1, repeats // 2), partial(_pg_upsert_participant_run, dsn, conn, batch),
                partial(_pg_upsert_executemany_run, conn, batch),
            )
            out.append(Result("upsert: copy+on conflict vs executemany", n,
                              _median_rps(n, tp), _median_rps(n, tr)))
            _drop_bench_tables(conn)
    return out


def _drop_bench_tables(conn: psycopg.Connection[Any]) -> None:
    for (name,) in conn.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
        " AND tablename LIKE 'bench%%'"
    ).fetchall():
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))


# -- files ---------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_file_run(root: Path, fmt: str, batch: pa.RecordBatch, durable: bool) -> float:
    """Raw pyarrow: write the file, (fsync), rename into place, (fsync the folder)."""
    path = root / uuid.uuid4().hex
    path.mkdir(parents=True)
    tmp, final = path / "_tmp.part", path / f"part-0.{fmt}"
    t0 = time.perf_counter()
    with open(tmp, "wb") as f:
        if fmt == "parquet":
            with pq.ParquetWriter(f, batch.schema) as w:
                w.write_batch(batch)
        else:
            f.write(b"".join(line + b"\n" for line in json_rows(batch)))
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, final)
    if durable:
        _fsync_dir(path)
    dt = time.perf_counter() - t0
    shutil.rmtree(path)
    return dt


def _file_participant_run(root: Path, fmt: str, batch: pa.RecordBatch) -> float:
    path = root / uuid.uuid4().hex
    p = StagedFileParticipant(str(path), fmt)
    p.check(batch.schema)  # driver-side, once per query
    b = BranchRef("bench", "l", 0, 0, p.name, 0)
    t0 = time.perf_counter()
    p.commit(b, p.prepare(b, batch.schema, [batch]))
    dt = time.perf_counter() - t0
    shutil.rmtree(path)
    return dt


def bench_files(root: Path, sizes: Iterable[int], repeats: int) -> list[Result]:
    out: list[Result] = []
    for fmt in ("parquet", "jsonl"):
        for n in sizes:
            batch = make_batch(n)
            tp, tr = _alternate(
                repeats, partial(_file_participant_run, root, fmt, batch),
                partial(_raw_file_run, root, fmt, batch, True),
            )
            out.append(Result(f"files-{fmt}", n, _median_rps(n, tp), _median_rps(n, tr)))
            tn = [_raw_file_run(root, fmt, batch, False) for _ in range(repeats)]
            out.append(Result(f"files-{fmt} vs raw without fsync", n, _median_rps(n, tp),
                              _median_rps(n, tn)))
    return out


# -- iceberg --------------------------------------------------------------------------------


def _ice_catalog(root: Path) -> dict[str, str]:
    return {"type": "sql", "uri": f"sqlite:///{root}/catalog.db", "warehouse": f"file://{root}/wh"}


def _ice_table(root: Path, batch: pa.RecordBatch) -> tuple[dict[str, str], str]:
    """A fresh table of the batch's schema (created outside the timing)."""
    from twophase.sinks.iceberg import IcebergParticipant

    (root / "wh").mkdir(parents=True, exist_ok=True)
    cat = _ice_catalog(root)
    name = f"bench.t_{uuid.uuid4().hex[:8]}"
    IcebergParticipant(name, cat).check(batch.schema)
    return cat, name


def _ice_slices(batch: pa.RecordBatch, parts: int) -> list[pa.RecordBatch]:
    step = -(-batch.num_rows // parts)
    return [batch.slice(i * step, step) for i in range(parts)]


def _ice_participant_run(root: Path, batch: pa.RecordBatch, parts: int) -> float:
    """P branches prepared (as P tasks would, here one after another) + one commit_batch."""
    from twophase.protocol import TxnKey
    from twophase.sinks.iceberg import IcebergParticipant

    cat, name = _ice_table(root, batch)
    p = IcebergParticipant(name, cat, name="ice")
    lineage = uuid.uuid4().hex[:16]
    t = time.perf_counter()
    handles = {i: p.prepare(BranchRef("bench", lineage, 0, 0, "ice", i), batch.schema, [s])
               for i, s in enumerate(_ice_slices(batch, parts))}
    p.commit_batch(TxnKey("bench", lineage, 0, 0), handles)
    return time.perf_counter() - t


def _ice_raw_run(root: Path, batch: pa.RecordBatch, appends: int) -> float:
    """Plain pyiceberg: ``table.append`` of the batch (at-least-once), in ``appends``
    commits (1: the whole batch at once; P: one per branch, as per-task commits would)."""
    from pyiceberg.catalog import load_catalog

    cat, name = _ice_table(root, batch)
    t = time.perf_counter()
    tbl = load_catalog("default", **cat).load_table(name)
    for s in _ice_slices(batch, appends):
        tbl.append(pa.Table.from_batches([s]))
    return time.perf_counter() - t


def bench_iceberg(root: Path, sizes: Iterable[int], repeats: int, parts: int = 4
                  ) -> list[Result]:
    out = []
    for n in sizes:
        batch = make_batch(n)
        for p in sorted({1, parts}):  # P=1 isolates what twophase adds from P files
            a, b = _alternate(repeats, partial(_ice_participant_run, root, batch, p),
                              partial(_ice_raw_run, root, batch, 1))
            out.append(Result(f"iceberg P={p} prepare+commit_batch", n,
                              _median_rps(n, a), _median_rps(n, b)))
        one, many = _alternate(repeats, partial(_ice_raw_run, root, batch, 1),
                               partial(_ice_raw_run, root, batch, parts))
        out.append(Result(f"iceberg 1 append vs {parts} appends (without)", n,
                          _median_rps(n, one), _median_rps(n, many)))
    return out


# -- kafka (optional, from the Kafka helper's module) --------------------------------------


def bench_kafka_if_present(sizes: list[int], repeats: int) -> list[Result]:
    path = Path(__file__).with_name("participants_kafka.py")
    if not path.exists():
        return []
    spec = importlib.util.spec_from_file_location("participants_kafka", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [Result(*r) for r in module.bench_kafka(sizes=sizes, repeats=repeats)]


# -- sql (SqlAlchemyParticipant on MariaDB) ------------------------------------------------


def bench_sql_section(sizes: list[int], repeats: int, url: str | None) -> list[Result]:
    path = Path(__file__).with_name("participants_sql.py")
    spec = importlib.util.spec_from_file_location("participants_sql", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [Result(*r) for r in module.bench_sql(sizes, repeats, make_batch, _alternate,
                                                  _median_rps, url)]


# -- delta (DeltaParticipant vs write_deltalake) ---------------------------------------------


def bench_delta_section(root: Path, sizes: list[int], repeats: int) -> list[Result]:
    path = Path(__file__).with_name("participants_delta.py")
    spec = importlib.util.spec_from_file_location("participants_delta", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [Result(*r) for r in module.bench_delta(root, sizes, repeats, make_batch,
                                                   _alternate, _median_rps)]


# -- report --------------------------------------------------------------------------------


def print_results(results: list[Result]) -> None:
    print(f"{'section':<40} {'rows':>8} {'participant r/s':>16} {'raw r/s':>12} {'ratio':>7}")
    for r in results:
        ratio = r.participant_rps / r.raw_rps
        informative = any(w in r.section for w in ("write_row", "without", "executemany"))
        flag = "" if ratio >= 0.90 or informative else "  < 0.90"
        print(f"{r.section:<40} {r.rows:>8} {r.participant_rps:>16,.0f} {r.raw_rps:>12,.0f} "
              f"{ratio:>7.2f}{flag}")
    print("(copy row: 'participant' = pyarrow CSV COPY, 'raw' = psycopg write_row per row)")
    print("(upsert row: 'participant' = mode='upsert' prepare+commit, 'raw' = psycopg "
          "executemany INSERT ... ON CONFLICT in one transaction; half the keys exist)")
    print("(iceberg rows: 'raw' = pyiceberg table.append of the batch in one commit; the "
          "'appends' row: 'participant' = 1 append, 'raw' = P appends, one per branch)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dsn", help="an existing server (needs max_prepared_transactions > 0)")
    ap.add_argument("--dir", help="folder for the file benchmarks (default: a temp folder)")
    ap.add_argument("--no-fsync", action="store_true", help="private server with fsync=off")
    ap.add_argument("--sql-url", help="a MySQL/MariaDB SQLAlchemy URL for the sql section "
                    "(default: a private MariaDB server)")
    sections = ["postgres", "copy", "upsert", "files", "kafka", "sql", "iceberg", "delta"]
    ap.add_argument("--only", choices=sections, nargs="*")
    ap.add_argument("--iceberg-partitions", type=int, default=4,
                    help="branches (P) per batch in the Iceberg section")
    args = ap.parse_args(argv)
    want = set(args.only or sections)
    server: LocalPostgres | None = None
    results: list[Result] = []
    try:
        dsn = args.dsn
        if dsn is None and want & {"postgres", "copy", "upsert"}:
            server = LocalPostgres(max_prepared_transactions=20, fsync=not args.no_fsync).start()
            dsn = server.dsn
        if "postgres" in want:
            results += bench_postgres(dsn, args.sizes, args.repeats)
        if "copy" in want:
            results += bench_copy_methods(dsn, args.sizes, args.repeats)
        if "upsert" in want:
            results += bench_upsert(dsn, args.sizes, args.repeats)
        if "files" in want:
            with tempfile.TemporaryDirectory(prefix="twophase-bench-", dir=args.dir) as tmp:
                results += bench_files(Path(tmp), args.sizes, args.repeats)
        if "kafka" in want:
            results += bench_kafka_if_present(args.sizes, args.repeats)
        if "sql" in want:
            results += bench_sql_section(args.sizes, args.repeats, args.sql_url)
        if "iceberg" in want:
            with tempfile.TemporaryDirectory(prefix="twophase-bench-", dir=args.dir) as tmp:
                results += bench_iceberg(Path(tmp), args.sizes, args.repeats,
                                         args.iceberg_partitions)
        if "delta" in want:
            with tempfile.TemporaryDirectory(prefix="twophase-bench-", dir=args.dir) as tmp:
                results += bench_delta_section(Path(tmp), args.sizes, args.repeats)
    finally:
        if server is not None:
            server.stop()
    print_results(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
