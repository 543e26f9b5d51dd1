"""The SQL section of bench/participants.py: SqlAlchemyParticipant on MariaDB (XA) against
plain SQLAlchemy bulk inserts of the same rows.

- participant: ``SqlAlchemyParticipant.prepare + commit`` (marker read, XA START, the rows
  in multi-row INSERTs of ``chunk_rows``, marker INSERT, XA END, XA PREPARE, session
  closed, XA COMMIT from a pooled session);
- raw: one ordinary transaction per batch on a pooled connection, the same Arrow ->
  Python conversion (column-wise ``to_pylist``), the same chunking and the same
  ``Connection.execute(insert, rows)`` (PyMySQL rewrites it into multi-row INSERTs), COMMIT.

Fresh table per run, A/B alternating, median. Without ``url`` a private MariaDB server
(``twophase.testing.localmariadb``: redo log written at every commit, not fsynced) is
started and stopped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa
import sqlalchemy as sa

from twophase.participant import BranchRef
from twophase.sinks.sql import SqlAlchemyParticipant
from twophase.sinks.sql.schema import sql_type_for
from twophase.testing.localmariadb import LocalMariaDB

CHUNK = 5000


def _participant_run(url: str, batch: pa.RecordBatch) -> float:
    p = SqlAlchemyParticipant(url, f"bench_{uuid.uuid4().hex[:8]}", chunk_rows=CHUNK,
                              marker_table="bench_markers")
    p.check(batch.schema)  # once per query on the driver: not part of the timed write
    b = BranchRef("bench", uuid.uuid4().hex[:16], 0, 0, p.name, 0)
    p.status(b)  # an executor's engine and pool exist after its first batch
    t0 = time.perf_counter()
    p.commit(b, p.prepare(b, batch.schema, [batch]))
    dt = time.perf_counter() - t0
    p.close()
    return dt


def _raw_run(engine: sa.Engine, batch: pa.RecordBatch) -> float:
    table = sa.Table(f"raw_{uuid.uuid4().hex[:8]}", sa.MetaData(),
                     *[sa.Column(f.name, sql_type_for(f)) for f in batch.schema])
    with engine.begin() as conn:
        table.create(conn)
    names = batch.schema.names
    stmt = table.insert()
    t0 = time.perf_counter()
    with engine.begin() as conn:
        for start in range(0, batch.num_rows, CHUNK):
            part = batch.slice(start, CHUNK)
            cols = [part.column(i).to_pylist() for i in range(part.num_columns)]
            conn.execute(stmt, [dict(zip(names, v, strict=True))
                                for v in zip(*cols, strict=True)])
    return time.perf_counter() - t0


def bench_sql(
    sizes: Iterable[int], repeats: int, make_batch: Callable[[int], pa.RecordBatch],
    alternate: Callable[..., tuple[list[float], list[float]]],
    median_rps: Callable[[int, list[float]], float], url: str | None = None,
) -> list[tuple[str, int, float, float]]:
    server = None
    if url is None:
        server = LocalMariaDB().start()
        url = server.url
    engine = sa.create_engine(url, pool_size=2)
    sa.event.listen(engine, "connect", _utc)
    out = []
    try:
        for n in sizes:
            batch = make_batch(n)
            ta, tb = alternate(repeats, lambda b=batch: _participant_run(url, b),
                               lambda b=batch: _raw_run(engine, b))
            out.append(("sql: mariadb XA vs SQLAlchemy insert", n, median_rps(n, ta),
                        median_rps(n, tb)))
    finally:
        engine.dispose()
        if server is not None:
            server.stop()
    return out


def _utc(dbapi_conn: Any, _record: Any) -> None:
    with dbapi_conn.cursor() as cur:
        cur.execute("SET time_zone = '+00:00'")
