"""The database underneath the decision log: engines, URLs, raw statements, errors.

Nothing here knows the protocol. SQLite gets WAL, ``synchronous=FULL``, a busy timeout,
``BEGIN IMMEDIATE`` for writes and an in-process write lock, so that this process never
spins on SQLITE_BUSY; PostgreSQL goes through psycopg 3 with a connection pool (several
coordinator replicas may share it; the store's compare-and-set makes them agree).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from twophase.errors import InvalidRequest, StoreError

__all__ = [
    "Conflict",
    "Database",
    "StoreMissing",
    "lock_sqlite",
    "normalize_url",
    "run",
    "sqlite_path",
    "transient",
]


def normalize_url(url: str) -> str:
    """Accept ``postgresql://`` / ``postgres://`` and pick psycopg 3; check SQLite URLs."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url[len("postgresql://") :]
    if url.startswith("postgresql+psycopg://"):
        return url
    if url.startswith("sqlite:///"):
        db = url[len("sqlite:///") :].split("?")[0]
        if not db or db == ":memory:":
            raise InvalidRequest(
                "an in-memory SQLite store is not a durable decision log; "
                "use sqlite:///relative/path.db or sqlite:////absolute/path.db"
            )
        return url
    raise InvalidRequest(
        f"unsupported store URL {url!r}: use sqlite:///path.db, sqlite:////abs/path.db "
        "or postgresql://user@host:port/db"
    )


def sqlite_path(url: str) -> Path | None:
    """The database file of a SQLite store URL (None for any other store)."""
    if not url.startswith("sqlite:///"):
        return None
    return Path(url[len("sqlite:///") :].split("?")[0])


class StoreMissing(InvalidRequest):
    """An existing store was asked for (``create=False``) and its SQLite file is not
    there: a typo, refused before SQLite would create the file (and the store its
    folder)."""

    @classmethod
    def at(cls, path: Path, user: str = "this command") -> StoreMissing:
        what = "it is a folder" if path.is_dir() else "the file does not exist"
        return cls(
            f"no SQLite store at {path.absolute()}: {what} (a typo in the URL?); {user} "
            "works on an existing store and never creates one: pass the file the "
            "coordinator writes (sqlite:///relative/path.db from this folder, "
            "sqlite:////absolute/path.db) or the daemon's http://host:port. Only "
            "`twophase serve` and a sink's coordinator= store URL create a new store"
        )


def _ensure_parent(path: Path) -> None:
    """Create the SQLite file's folder, or say which path cannot be used and why: sqlite3
    itself only answers 'unable to open database file'."""
    parent = path.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(
            f"cannot create the folder {parent} for the SQLite store {path.absolute()}: "
            f"{exc.strerror or exc}; create it (writable by this user) or choose another "
            "path, e.g. sqlite:////absolute/path/twophase.db"
        ) from exc
    if not os.access(parent, os.W_OK | os.X_OK):
        raise StoreError(
            f"the folder {parent} of the SQLite store {path.absolute()} is not writable by "
            "this user (SQLite writes its journal next to the file); fix its permissions "
            "or choose another path"
        )


def lock_sqlite(url: str) -> IO[str] | None:
    """Hold ``<file>.lock`` for a daemon's lifetime (released when the process dies):
    SQLite allows one daemon per file, a second one is refused here instead of
    competing for the database. Returns the open lock file (None for PostgreSQL)."""
    path = sqlite_path(normalize_url(url))
    if path is None:
        return None
    _ensure_parent(path)
    lock = Path(f"{path.absolute()}.lock")
    fh = lock.open("a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "unknown"
        fh.close()
        raise StoreError(
            f"another coordinator already serves the SQLite store {path.absolute()} "
            f"(process {holder} holds {lock}); SQLite allows one daemon per file: stop "
            "that daemon, point this one at another file, or use a PostgreSQL store to run "
            "several daemons"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


class Database:
    """A write engine, a read engine and the write lock for one store URL."""

    def __init__(self, url: str, *, pool_size: int = 8, create: bool = True,
                 read_only: bool = False) -> None:
        """``create=False``: a SQLite file that does not exist is refused
        (:class:`StoreMissing`) instead of being created empty. ``read_only``: the
        database itself refuses writes (SQLite ``mode=ro``, PostgreSQL read-only
        transactions), for the commands that only look."""
        self.url = normalize_url(url)
        self.is_sqlite = self.url.startswith("sqlite")
        self.read_only = read_only
        self.write_lock: contextlib.AbstractContextManager[Any]
        if self.is_sqlite:
            path = sqlite_path(self.url)
            assert path is not None
            if (not create or read_only) and not path.is_file():
                raise StoreMissing.at(path)
            if read_only:
                # With no -wal the file holds everything: open it immutable, so SQLite
                # creates no -wal/-shm beside it (a writer starting meanwhile writes its
                # WAL first and checkpoints only after 1000 pages). With a -wal (a
                # daemon running, or one that stopped without checkpointing) read
                # through it, mode=ro: neither the database nor the log is written.
                wal = Path(f"{path}-wal").exists()
                ro = (f"sqlite:///file:{quote(str(path.absolute()))}?mode=ro"
                      f"{'' if wal else '&immutable=1'}&uri=true")
                self.engine = self.read_engine = _sqlite_engine(ro, immediate=False,
                                                                read_only=True)
                self.write_lock = threading.Lock()
                return
            _ensure_parent(path)
            self.engine = _sqlite_engine(self.url, immediate=True)
            self.read_engine = _sqlite_engine(self.url, immediate=False)
            self.write_lock = threading.Lock()
        else:
            self.engine = create_engine(
                self.url, pool_size=pool_size, max_overflow=pool_size * 2, pool_pre_ping=False,
                connect_args={"options": "-c default_transaction_read_only=on"}
                if read_only else {},
            )
            self.read_engine = self.engine
            self.write_lock = contextlib.nullcontext()

    @property
    def pyformat(self) -> bool:
        """psycopg takes ``%(name)s`` parameters, sqlite3 ``:name``."""
        return not self.is_sqlite

    @property
    def safe_url(self) -> str:
        return make_url(self.url).render_as_string(hide_password=True)

    @contextlib.contextmanager
    def write(self) -> Iterator[Connection]:
        """One write transaction, committed on a normal exit."""
        with self.write_lock, self.engine.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only connection; whatever it started is rolled back."""
        with self.read_engine.connect() as conn:
            yield conn
            conn.rollback()

    def close(self) -> None:
        self.engine.dispose()
        if self.read_engine is not self.engine:
            self.read_engine.dispose()


def _sqlite_engine(url: str, *, immediate: bool, read_only: bool = False) -> Engine:
    eng = create_engine(url, connect_args={"timeout": 30.0, "check_same_thread": False})

    @event.listens_for(eng, "connect")
    def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        if not read_only:  # the journal mode is the writer's to set
            cur.execute("PRAGMA journal_mode=WAL")
        else:
            cur.execute("PRAGMA query_only=ON")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(eng, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return eng


def run(conn: Connection, sql: str, params: Any, *, many: bool = False) -> Any:
    """Execute on the driver's cursor (SQLAlchemy's per-statement bookkeeping costs as much
    as SQLite itself on the hot path). Driver errors become SQLAlchemy's, which the retry
    logic keys on, and a lost connection is invalidated so that the pool drops it."""
    dbapi_conn = conn.connection.dbapi_connection
    assert dbapi_conn is not None
    cur = dbapi_conn.cursor()
    try:
        if many:
            cur.executemany(sql, params)
        else:
            cur.execute(sql, params)
    except conn.dialect.loaded_dbapi.Error as exc:
        gone = conn.dialect.is_disconnect(exc, dbapi_conn, cur)
        wrapped = DBAPIError.instance(
            sql, params, exc, conn.dialect.loaded_dbapi.Error,
            connection_invalidated=gone, dialect=conn.dialect,
        )
        if gone:
            conn.invalidate(exc)
        raise wrapped from exc
    return cur


def transient(exc: DBAPIError) -> bool:
    """A dropped connection, a deadlock or a busy database: the transaction did not
    commit and running it again may succeed."""
    msg = str(exc.orig).lower() if exc.orig is not None else str(exc).lower()
    return exc.connection_invalidated or any(
        w in msg for w in ("deadlock", "database is locked", "could not serialize", "closed")
    )


class Conflict(StoreError):
    """A compare-and-set found a newer version: another writer got there first. Whoever
    runs the transaction rolls it back and runs it again."""
