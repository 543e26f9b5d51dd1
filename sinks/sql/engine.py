"""The SQL participant's engine, one per process: a small pool whose sessions are strict
(a too-long value is an error, never truncated), in UTC, and wait a bounded time for a
lock (a row held by another attempt's prepared branch would otherwise block for long)."""

from __future__ import annotations

from typing import Any, Final

import sqlalchemy as sa

__all__ = ["LOCK_WAIT_SECONDS", "make_engine"]

LOCK_WAIT_SECONDS: Final = 30


def make_engine(url: str, backend: str) -> sa.Engine:
    """An engine for ``url``; ``backend`` "mysql" (MySQL, MariaDB) or "postgresql"."""
    engine = sa.create_engine(
        url, pool_size=2, max_overflow=8, pool_pre_ping=True,
        connect_args={"connect_timeout": 10},
    )

    def on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        if backend == "mysql":
            cur.execute(
                "SET SESSION sql_mode = CONCAT_WS(',', @@sql_mode, 'STRICT_ALL_TABLES'), "
                "time_zone = '+00:00', "
                f"innodb_lock_wait_timeout = {int(LOCK_WAIT_SECONDS)}"
            )
        else:
            cur.execute(f"SET lock_timeout = '{int(LOCK_WAIT_SECONDS)}s'")
            cur.execute("SET TIME ZONE 'UTC'")
        cur.close()
        dbapi_conn.commit()

    sa.event.listen(engine, "connect", on_connect)
    return engine
