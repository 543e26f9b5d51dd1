"""Any SQL database with two-phase commit through SQLAlchemy: MySQL/MariaDB XA, PostgreSQL.

Built only on twophase's public contract (:mod:`twophase.participant`, :mod:`twophase.names`,
:mod:`twophase.errors`), as another package would build one.

prepare: the marker row (sink, lineage, checkpoint, participant, partition) is read
first (there: the branch landed already, nothing is written); then
``Connection.begin_twophase(xid)`` (``XA START`` / ``BEGIN``), the rows in multi-row
INSERTs of ``chunk_rows``, the marker row, ``TwoPhaseTransaction.prepare()`` (``XA END;
XA PREPARE`` / ``PREPARE TRANSACTION``). The connection is then closed, not returned to
the pool: MySQL keeps a prepared XA branch attached to its session until that session
ends (``XA COMMIT`` from another session says "unknown XID" meanwhile), and closing a
SQLAlchemy transaction that is still open would roll the prepared branch back.

commit/abort: ``Connection.commit_prepared(xid, recover=True)`` / ``rollback_prepared``
from any session. "Unknown XID" counts as done only when the marker proves it (commit)
or disproves it (abort). status reads the marker, then the server's list of prepared
transactions (``XA RECOVER`` / ``pg_prepared_xacts``).
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from typing import Any, Final, TypeVar

import pyarrow as pa
import sqlalchemy as sa

from twophase.errors import InvalidRequest, TargetProblem, classify
from twophase.participant import (
    BranchRef,
    BranchStatus,
    Descriptor,
    Handle,
    Participant,
    ParticipantError,
    PrepareRefused,
    ReadBack,
    Rebuildable,
    Verifiable,
)
from twophase.sinks.sql import dberrors
from twophase.sinks.sql.engine import make_engine
from twophase.sinks.sql.rights import check_rights
from twophase.sinks.sql.schema import misfits
from twophase.sinks.sql.state import branches_of, marker_attempt, prepared_xids
from twophase.sinks.sql.tables import (
    chunks,
    data_table,
    duplicate_key,
    field_problems,
    has_key,
    insert_statement,
    marker_table,
    xid_table,
)
from twophase.sinks.sql.xid import xid_for

__all__ = ["SqlAlchemyParticipant"]

_IDENT_RE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,59}$")
_MODES: Final = ("append", "upsert")
_RETRIES: Final = 3
_T = TypeVar("_T")

_XID_LIMIT: Final = {"mysql": 64, "mariadb": 64, "postgresql": 199}
"""Bytes of transaction id the server takes: MySQL's gtrid, PostgreSQL's GIDSIZE - 1."""

_DRIVER_MODULES: Final = {
    "pymysql": "pymysql", "psycopg": "psycopg", "psycopg2": "psycopg2",
    "mysqldb": "MySQLdb", "mysqlconnector": "mysql.connector", "mariadbconnector": "mariadb",
}

def _identifier(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _IDENT_RE.match(value):
        raise InvalidRequest(
            f"invalid {kind} {value!r}: use a letter or _ then up to 59 of A-Z a-z 0-9 _"
        )
    return value


class SqlAlchemyParticipant(Participant, Rebuildable, Verifiable):
    """Rows of each branch go to ``table`` of the database at ``url`` (a SQLAlchemy URL:
    ``mysql+pymysql://user@host/db``, ``postgresql+psycopg://user@host/db``), through
    a two-phase transaction per branch.

    ``mode="upsert"`` needs ``key``, a primary or unique key of the table (made so when
    the table is created): ``INSERT ... ON DUPLICATE KEY UPDATE`` (MySQL) or
    ``ON CONFLICT DO UPDATE`` (PostgreSQL). Built on the driver and pickled to the
    executors: no connection is opened in ``__init__``; each process makes its own engine.
    """

    kind = "sql"

    def __init__(
        self,
        url: str,
        table: str,
        *,
        name: str | None = None,
        mode: str = "append",
        key: str | Sequence[str] | None = None,
        create: bool = True,
        marker_table: str = "twophase_markers",
        chunk_rows: int = 5000,
    ) -> None:
        self.table = _identifier("table name", table)
        self.marker_table = _identifier("marker table name", marker_table)
        if mode not in _MODES:
            raise InvalidRequest(f"mode must be one of {', '.join(_MODES)}; got {mode!r}")
        self.mode = mode
        keys = [key] if isinstance(key, str) else list(key or [])
        self.key = tuple(_identifier("key column", k) for k in keys)
        if mode == "upsert" and not self.key:
            raise InvalidRequest(
                "mode='upsert' needs key=: the column(s) that identify a row (a primary or "
                "unique key of the table), e.g. key='customer'"
            )
        if not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1:
            raise InvalidRequest(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        self.chunk_rows = chunk_rows
        self.create = bool(create)
        try:
            parsed = sa.engine.make_url(url)
        except (sa.exc.ArgumentError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"invalid SQLAlchemy url: {exc}") from None
        backend = parsed.get_backend_name()
        if backend not in _XID_LIMIT:
            raise InvalidRequest(
                f"url {parsed.render_as_string(hide_password=True)!r}: dialect {backend!r} "
                "has no two-phase commit twophase can use; use mysql+pymysql:// (MySQL, "
                "MariaDB) or postgresql+psycopg:// (PostgreSQL)"
            )
        self.url = url
        self._backend = "mysql" if backend in ("mysql", "mariadb") else "postgresql"
        self._driver = parsed.get_driver_name()
        self._where = (f"{parsed.host or 'localhost'}"
                       f"{':' + str(parsed.port) if parsed.port else ''}/{parsed.database or ''}")
        super().__init__(name if name is not None else f"sql-{table}")
        self._engine: sa.Engine | None = None

    # -- pickling, engine, retries --------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_engine"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def describe(self) -> str:
        mode = "" if self.mode == "append" else f", {self.mode}"
        return f"sql participant {self.name!r} ({self.table} at {self._where}{mode})"

    def required_modules(self) -> tuple[str, ...]:
        driver = _DRIVER_MODULES.get(self._driver)
        return ("sqlalchemy", driver) if driver else ("sqlalchemy",)

    def descriptor(self) -> Descriptor:
        """The URL without its password (``TWOPHASE_SECRET_<NAME>_PASSWORD`` supplies it
        when rebuilt)."""
        parsed = sa.engine.make_url(self.url)
        secrets = "password" if parsed.password is not None else ""
        return {
            "kind": self.kind, "name": self.name, "target": f"{self.table} at {self._where}",
            "options": {
                "url": sa.engine.URL.create(
                    parsed.drivername, parsed.username, None, parsed.host, parsed.port,
                    parsed.database, parsed.query,
                ).render_as_string(hide_password=False),
                "table": self.table, "mode": self.mode,
                "key": json.dumps(list(self.key)) if self.key else None,
                "create": self.create, "marker_table": self.marker_table,
                "chunk_rows": self.chunk_rows, "secrets": secrets,
            },
        }

    @classmethod
    def from_descriptor(
        cls, descriptor: Descriptor, secrets: Mapping[str, str]
    ) -> SqlAlchemyParticipant:
        o = descriptor["options"]
        parsed = sa.engine.make_url(str(o["url"]))
        if "password" in secrets:
            parsed = parsed.set(password=secrets["password"])
        return cls(
            parsed.render_as_string(hide_password=False), str(o["table"]),
            name=descriptor["name"], mode=str(o.get("mode", "append")),
            key=json.loads(str(o["key"])) if o.get("key") else None,
            create=bool(o.get("create", True)),
            marker_table=str(o.get("marker_table", "twophase_markers")),
            chunk_rows=int(o.get("chunk_rows", 5000)),
        )

    def _engine_ok(self) -> sa.Engine:
        if self._engine is None:
            self._engine = make_engine(self.url, self._backend)
        return self._engine

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.dispose()

    def _retry(self, what: str, fn: Callable[[sa.Connection], _T]) -> _T:
        """Run ``fn`` on an autocommit connection, again after a connection failure
        (idempotent work only)."""
        delay = 0.2
        for attempt in range(1, _RETRIES + 1):
            try:
                with self._engine_ok().connect() as conn:
                    return fn(conn.execution_options(isolation_level="AUTOCOMMIT"))
            except sa.exc.DBAPIError as exc:
                if not dberrors.transient(exc):
                    raise ParticipantError(f"{self.describe()}: cannot {what}: "
                                           f"{dberrors.message(exc)}") from exc
                if attempt == _RETRIES:
                    raise ParticipantError(
                        f"{self.describe()}: cannot {what}: server unreachable after "
                        f"{_RETRIES} tries: {dberrors.message(exc)}"
                    ) from exc
                time.sleep(delay)
                delay *= 2
            except ParticipantError:
                raise
            except Exception as exc:
                if dberrors.code(exc) is None:
                    raise
                raise ParticipantError(f"{self.describe()}: cannot {what}: "
                                       f"{dberrors.message(exc)}") from exc
        raise AssertionError("unreachable")

    # -- tables -----------------------------------------------------------------------------

    def _markers(self, md: sa.MetaData | None = None) -> sa.Table:
        return marker_table(self.marker_table, md)

    def _xids(self, md: sa.MetaData | None = None) -> sa.Table:
        return xid_table(self.marker_table, md)

    # -- driver-side check ------------------------------------------------------------------

    def partition_columns(self) -> tuple[str, ...] | None:
        """Upsert: rows of one key land in one branch (two prepared branches writing one
        key would block each other)."""
        return self.key if self.mode == "upsert" else None

    def probe(self) -> None:
        """The server answers and accepts these credentials, allows two-phase commit
        (XA, ``XA RECOVER``; PostgreSQL: ``max_prepared_transactions``) and, when a table
        is missing, lets the user create it (run on the driver and on every executor
        before the first batch); a refusal is permanent and named with its grant."""
        try:
            with self._engine_ok().connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        except Exception as exc:
            kind = classify(exc)
            raise TargetProblem(
                self.describe(),
                f"cannot connect: {kind.value}: {str(exc).strip().splitlines()[0][:300]}",
                "check the URL's host, port, database, user and password, and that the "
                "server accepts connections from this host",
                host=socket.gethostname(), kind=kind,
            ) from None
        tables = [self.table, self.marker_table, self._xids().name]
        self._retry("check the user's rights", lambda conn: check_rights(
            self.describe(), conn, self._backend, tables, self.create))

    def check(self, schema: pa.Schema) -> None:
        """Create the marker tables and the data table, or compare an existing one."""
        problems = field_problems(schema, self.key)
        if problems:
            raise ParticipantError(f"{self.describe()}: " + "; ".join(problems))
        self._retry("check the target", lambda conn: self._check(conn, schema))

    def _check(self, conn: sa.Connection, schema: pa.Schema) -> None:
        md = sa.MetaData()
        self._markers(md)
        self._xids(md)
        self._create(conn, md)
        inspector = sa.inspect(conn)
        if not inspector.has_table(self.table):
            if not self.create:
                raise ParticipantError(
                    f"{self.describe()}: table {self.table} does not exist (and create=False)"
                )
            data = sa.MetaData()
            data_table(self.table, schema, self.key).to_metadata(data)
            self._create(conn, data)
            inspector = sa.inspect(conn)
        problems = misfits(schema, [dict(c) for c in inspector.get_columns(self.table)])
        if self.mode == "upsert" and not has_key(inspector, self.table, self.key):
            problems.append(
                f"mode='upsert' needs a primary key or unique key on {list(self.key)} "
                f"(ALTER TABLE {self.table} ADD UNIQUE ({', '.join(self.key)}))"
            )
        if problems:
            raise ParticipantError(
                f"{self.describe()}: table {self.table} does not fit the data: "
                + "; ".join(problems)
            )

    def _create(self, conn: sa.Connection, md: sa.MetaData) -> None:
        """Create the missing tables of ``md``; a concurrent creator winning the race is
        fine, any other failure (no CREATE privilege) is reported with the cause."""
        try:
            md.create_all(conn)
        except sa.exc.DBAPIError as exc:
            inspector = sa.inspect(conn)
            missing = [t.name for t in md.sorted_tables if not inspector.has_table(t.name)]
            if missing:
                raise ParticipantError(
                    f"{self.describe()}: cannot create table {', '.join(missing)}: "
                    f"{dberrors.message(exc)} (grant CREATE on the database, or create the tables "
                    "beforehand)"
                ) from exc

    # -- names and system state -------------------------------------------------------------

    def _xid(self, branch: BranchRef) -> tuple[str, bool]:
        if branch.participant != self.name:
            raise InvalidRequest(
                f"branch {branch.branch_id} belongs to participant {branch.participant!r}, "
                f"not {self.name!r}"
            )
        return xid_for(branch, _XID_LIMIT[self._backend])

    def _recover(self, conn: sa.Connection) -> list[str]:
        return prepared_xids(conn, self._backend)

    def _marker_attempt(self, conn: sa.Connection, branch: BranchRef) -> int | None:
        return marker_attempt(conn, self._markers(), branch)

    def _branches(self, conn: sa.Connection, xids: list[str]) -> dict[str, BranchRef]:
        return branches_of(conn, self._xids(), xids)

    # -- the branch -------------------------------------------------------------------------

    def _handle(self, xid: str, rows: int, state: str) -> dict[str, str]:
        return {"kind": self.kind, "participant": self.name, "xid": xid, "rows": str(rows),
                "state": state}

    def prepare(
        self, branch: BranchRef, schema: pa.Schema, batches: Iterable[pa.RecordBatch]
    ) -> Handle:
        xid, hashed = self._xid(branch)

        def probe(conn: sa.Connection) -> tuple[int | None, list[str]]:
            marker = self._marker_attempt(conn, branch)
            prepared = self._recover(conn)
            if hashed and marker is None and xid not in prepared:
                with suppress(sa.exc.IntegrityError):
                    conn.execute(self._xids().insert().values(
                        xid=xid, sink=branch.sink, lineage=branch.lineage,
                        checkpoint=branch.batch_id, attempt=branch.attempt,
                        participant=branch.participant, partition=branch.partition))
            return marker, prepared

        try:
            marker, prepared = self._retry("read the branch state", probe)
        except ParticipantError as exc:
            raise PrepareRefused(str(exc)) from exc
        if marker is not None:
            return self._handle(xid, 0, "already-committed")
        if xid in prepared:
            return self._handle(xid, 0, "already-prepared")
        others = [x for x, b in self._retry("list prepared branches",
                                             lambda c: self._branches(c, prepared)).items()
                  if (b.sink, b.lineage, b.batch_id, b.participant, b.partition)
                  == (branch.sink, branch.lineage, branch.batch_id, branch.participant,
                      branch.partition) and b.attempt != branch.attempt]
        if others:
            raise PrepareRefused(
                f"{self.describe()}: branch {branch.branch_id} of batch {branch.batch_id} is "
                f"still prepared by an earlier attempt ({', '.join(others)}); resolve it "
                "first (twophase resolve)"
            )
        if self.mode == "upsert":
            batches = list(batches)
            self._refuse_duplicate_keys(branch, batches)
        return self._write(branch, xid, schema, batches)

    def _refuse_duplicate_keys(self, branch: BranchRef, batches: list[pa.RecordBatch]) -> None:
        found = duplicate_key(batches, self.key)
        if found is not None:
            raise PrepareRefused(
                f"{self.describe()}: batch {branch.batch_id} refused before writing: key "
                f"{found[0]} appears {found[1]} times. In mode='upsert' each key must "
                "appear once per batch; deduplicate before the sink (dropDuplicates(key) "
                "or a groupBy(key) aggregation)"
            )

    def _write(
        self, branch: BranchRef, xid: str, schema: pa.Schema, batches: Iterable[pa.RecordBatch]
    ) -> Handle:
        table = data_table(self.table, schema, self.key)
        stmt = insert_statement(table, self.key, self.mode, self._backend)
        markers = self._markers()
        rows = 0
        stage = "begin"
        try:
            conn = self._engine_ok().connect()
        except sa.exc.DBAPIError as exc:
            raise PrepareRefused(
                f"{self.describe()}: cannot connect: {dberrors.message(exc)}") from exc
        try:
            tx = conn.begin_twophase(xid)
            stage = "insert"
            for chunk in chunks(self.describe(), schema, batches, self.chunk_rows):
                conn.execute(stmt, chunk)
                rows += len(chunk)
            stage = "marker"
            conn.execute(markers.insert().values(
                sink=branch.sink, lineage=branch.lineage, checkpoint=branch.batch_id,
                participant=branch.participant, partition=branch.partition,
                attempt=branch.attempt))
            stage = "prepare"
            tx.prepare()
        except sa.exc.DBAPIError as exc:
            ambiguous = stage == "prepare" and dberrors.transient(exc)
            self._discard(conn, rollback=stage != "prepare")
            if stage == "marker" and dberrors.code(exc) in dberrors.DUPLICATE:
                return self._handle(xid, 0, "already-committed")  # another attempt landed
            if ambiguous:  # the PREPARE may have reached the server before the link broke
                try:
                    if xid in self._retry("read the branch state", self._recover):
                        return self._handle(xid, rows, "prepared")
                except ParticipantError:
                    pass  # voting NO is safe: a prepared leftover is found and aborted
            if dberrors.code(exc) in dberrors.MISSING_TABLE:
                raise PrepareRefused(
                    f"{self.describe()}: {dberrors.message(exc)} (run check(schema) on the driver "
                    "first: it creates the table and the marker tables)") from exc
            raise PrepareRefused(
                f"{self.describe()}: rows refused during {stage}: {dberrors.message(exc)}"
            ) from exc
        except BaseException:
            self._discard(conn, rollback=stage != "prepare")
            raise
        # Closed, never pooled: the server detaches the prepared branch from this session
        # (see the module's docstring); invalidate() rolls nothing back.
        conn.invalidate()
        conn.close()
        return self._handle(xid, rows, "prepared")

    def _discard(self, conn: sa.Connection, *, rollback: bool) -> None:
        """Undo an unprepared branch (``XA END; XA ROLLBACK`` / ``ROLLBACK``), then drop
        the session; were the rollback to fail, the server rolls back an unprepared
        transaction when its session ends."""
        with suppress(Exception):
            tx = conn.get_transaction()
            if rollback and tx is not None:
                tx.rollback()
        with suppress(Exception):
            conn.invalidate()
        with suppress(Exception):
            conn.close()

    def commit(self, branch: BranchRef, handle: Handle | None) -> None:
        xid, hashed = self._xid(branch)
        self._check_handle(xid, handle)

        def run(conn: sa.Connection) -> bool:
            try:
                conn.commit_prepared(xid, recover=True)
                return True
            except Exception as exc:  # psycopg's own error escapes SQLAlchemy here
                if dberrors.code(exc) not in dberrors.UNKNOWN_XID:
                    raise
            if self._marker_attempt(conn, branch) is not None:
                return True  # committed earlier (this attempt, or another that landed it)
            if xid in self._recover(conn):
                return False  # still attached to its closing session: try again
            raise ParticipantError(
                f"{self.describe()}: cannot commit {xid!r}: it is not prepared and no marker "
                "shows the branch committed (it was aborted or never prepared)"
            )

        self._settle(f"commit {xid!r}", run)
        if hashed:
            self._forget(xid)

    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        xid, hashed = self._xid(branch)
        self._check_handle(xid, handle)

        def run(conn: sa.Connection) -> bool:
            try:
                conn.rollback_prepared(xid, recover=True)
                return True
            except Exception as exc:  # psycopg's own error escapes SQLAlchemy here
                if dberrors.code(exc) not in dberrors.UNKNOWN_XID:
                    raise
            if xid in self._recover(conn):
                return False
            if self._marker_attempt(conn, branch) == branch.attempt:
                raise ParticipantError(
                    f"{self.describe()}: cannot abort {xid!r}: this attempt's branch is "
                    "already committed"
                )
            return True

        self._settle(f"abort {xid!r}", run)
        if hashed:
            self._forget(xid)

    def _settle(self, what: str, run: Callable[[sa.Connection], bool]) -> None:
        """``run`` until it reports done: a branch whose preparing session is still
        closing is listed but not yet committable from another session."""
        deadline = time.monotonic() + 30
        while not self._retry(what, run):
            if time.monotonic() > deadline:
                raise ParticipantError(
                    f"{self.describe()}: cannot {what}: the branch stays attached to the "
                    "session that prepared it (is that process still alive?)"
                )
            time.sleep(0.1)

    def _forget(self, xid: str) -> None:
        t = self._xids()
        with suppress(ParticipantError):
            self._retry("forget a settled xid",
                        lambda c: c.execute(t.delete().where(t.c.xid == xid)))

    def _check_handle(self, xid: str, handle: Handle | None) -> None:
        if handle is not None and handle.get("xid", xid) != xid:
            raise ParticipantError(
                f"{self.describe()}: handle names {handle.get('xid')!r} but the branch is {xid!r}"
            )

    def prune_markers(self, sink: str, lineage: str, below: int) -> int:
        """Delete the marker rows (and hashed-xid rows) of (sink, lineage) below batch
        ``below`` (needs DELETE on both tables; the driver logs a refusal and goes on)."""
        def run(conn: sa.Connection) -> int:
            n = 0
            for t in (self._markers(), self._xids()):
                try:
                    res = conn.execute(sa.delete(t).where(
                        t.c.sink == sink, t.c.lineage == lineage, t.c.checkpoint < below))
                except sa.exc.ProgrammingError:
                    continue  # no such table yet: nothing to prune
                n += max(0, res.rowcount) if t.name == self.marker_table else 0
            return n

        return self._retry("prune markers", run)

    def status(self, branch: BranchRef) -> BranchStatus:
        xid, _ = self._xid(branch)

        def run(conn: sa.Connection) -> BranchStatus:
            if self._marker_attempt(conn, branch) is not None:
                return BranchStatus.COMMITTED
            if xid in self._recover(conn):
                return BranchStatus.PREPARED
            return BranchStatus.ABSENT

        return self._retry(f"read the status of {xid!r}", run)

    def in_doubt(self, sink: str) -> list[BranchRef]:
        def run(conn: sa.Connection) -> list[BranchRef]:
            found = self._branches(conn, self._recover(conn)).values()
            return sorted(b for b in found if b.sink == sink and b.participant == self.name)

        return self._retry(f"list prepared branches of sink {sink!r}", run)

    def read_back(self, column: str) -> ReadBack:
        """``column`` of the table, and every twophase prepared transaction in the server
        (a leftover of any sink holds its locks)."""
        col = _identifier("column name", column)

        def run(conn: sa.Connection) -> ReadBack:
            t = sa.table(self.table, sa.column(col))
            values = conn.execute(sa.select(t.c[col])).scalars().all()
            return ReadBack(tuple(values), prepared=len(self._recover(conn)))

        try:
            return self._retry("read the table back", run)
        finally:
            self.close()

