"""PostgreSQL participant: COPY + marker row + ``PREPARE TRANSACTION``.

Prepare runs ``BEGIN; COPY rows; INSERT marker; PREPARE TRANSACTION gid`` on one
connection. A prepared transaction is durable in the server (it survives the client's
death and a server restart) and is invisible to readers until ``COMMIT PREPARED gid``,
which any session of the same database may run: that is what lets recovery finish a
branch whose executor is gone. The marker row (sink, lineage, checkpoint, participant,
partition) commits atomically with the rows, so "is the marker there?" answers "did this
branch's data land?" whatever attempt wrote it; its primary key makes a second landing
impossible.

Each prepared transaction is named by a gid built from the branch (see :mod:`.gid`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import suppress
from typing import Any, Final, TypeVar

import psycopg
import pyarrow as pa
from psycopg import errors as pgerr
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from twophase.errors import Failure, InvalidRequest, TargetProblem, classify
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
from twophase.sinks.postgres import table as target
from twophase.sinks.postgres.arrow import (
    Nested,
    UnsupportedType,
    csv_chunks,
    pg_type_for,
)
from twophase.sinks.postgres.errors import describe_error, identifier, refused, transient
from twophase.sinks.postgres.gid import GID_ROOT, gid_for, gid_prefix, parse_gid
from twophase.sinks.postgres.modes import (
    batch_key_problems,
    check_options,
    delete_sql,
    is_bool,
    stage_name,
    stage_sql,
    upsert_sql,
)

__all__ = ["PostgresParticipant"]

_RETRIES: Final = 3
_T = TypeVar("_T")


class PostgresParticipant(Participant, Rebuildable, Verifiable):
    """Rows of each branch go to ``schema.table``; prepared with a two-phase commit.

    Built on the driver and pickled to executors: no connection is opened in ``__init__``
    and pickling drops live connections (each process opens its own when needed).
    """

    kind = "postgres"
    LOCK_TIMEOUT_MS: Final = 30_000
    """A marker row held by another attempt's prepared transaction would block forever."""

    def __init__(
        self,
        dsn: str,
        table: str,
        *,
        name: str | None = None,
        schema: str = "public",
        create: bool = True,
        marker_table: str = "twophase_markers",
        connect_timeout: float = 10,
        mode: str = "append",
        key: str | Sequence[str] | None = None,
        delete_when: str | None = None,
        on_schema_change: str = "fail",
        nested: Nested = "json",
    ) -> None:
        self.table = identifier("table name", table)
        self.key = check_options(mode, key, delete_when, on_schema_change, nested)
        self.nested: Nested = nested
        self.mode = mode
        self.on_schema_change = on_schema_change
        self.delete_when = delete_when
        self.schema = identifier("schema name", schema)
        self.marker_table = identifier("marker table name", marker_table)
        super().__init__(name if name is not None else f"postgres-{table}")
        if not isinstance(dsn, str) or not dsn:
            raise InvalidRequest("dsn must be a non-empty PostgreSQL connection string")
        try:
            params = conninfo_to_dict(dsn)
        except psycopg.ProgrammingError as exc:
            raise InvalidRequest(f"invalid dsn: {exc}") from None
        self.dsn = dsn
        self.create = create
        if not connect_timeout > 0:
            raise InvalidRequest("connect_timeout must be > 0 seconds")
        self.connect_timeout = float(connect_timeout)
        self._where = (
            f"{params.get('host', 'localhost')}:{params.get('port', 5432)}"
            f"/{params.get('dbname', '')}"
        )
        self._conn: psycopg.Connection[Any] | None = None

    # -- pickling and connections -----------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_conn"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def describe(self) -> str:
        mode = "" if self.mode == "append" else f", {self.mode}"
        return (f"postgres participant {self.name!r} ({self.schema}.{self.table} at "
                f"{self._where}{mode})")

    _SECRET_PARAMS: Final = ("password", "sslpassword")

    def descriptor(self) -> Descriptor:
        """The DSN without its password (libpq's PGPASSWORD or ~/.pgpass, or
        ``TWOPHASE_SECRET_<NAME>_PASSWORD``, supply it when rebuilt)."""
        params = conninfo_to_dict(self.dsn)
        secrets = [k for k in self._SECRET_PARAMS if params.pop(k, None) is not None]
        return {
            "kind": self.kind, "name": self.name,
            "target": f"{self.schema}.{self.table} at {self._where}",
            "options": {
                "dsn": make_conninfo(**{k: str(v) for k, v in params.items()}),
                "schema": self.schema, "table": self.table,
                "marker_table": self.marker_table, "create": self.create,
                "connect_timeout": self.connect_timeout, "secrets": ",".join(secrets),
                "mode": self.mode, "key": json.dumps(list(self.key)) if self.key else None,
                "delete_when": self.delete_when, "on_schema_change": self.on_schema_change,
                "nested": self.nested,
            },
        }

    @classmethod
    def from_descriptor(
        cls, descriptor: Descriptor, secrets: Mapping[str, str]
    ) -> PostgresParticipant:
        o = descriptor["options"]
        params = conninfo_to_dict(str(o["dsn"]))
        for k in cls._SECRET_PARAMS:
            if k in secrets:  # else libpq's own PGPASSWORD / ~/.pgpass apply
                params[k] = secrets[k]
        return cls(
            make_conninfo(**{k: str(v) for k, v in params.items()}), str(o["table"]),
            name=descriptor["name"], schema=str(o["schema"]),
            create=bool(o.get("create", True)),
            marker_table=str(o.get("marker_table", "twophase_markers")),
            connect_timeout=float(o.get("connect_timeout", 10)),
            mode=str(o.get("mode", "append")),
            key=json.loads(str(o["key"])) if o.get("key") else None,
            delete_when=str(o["delete_when"]) if o.get("delete_when") else None,
            on_schema_change=str(o.get("on_schema_change", "fail")),
            nested="refuse" if o.get("nested") == "refuse" else "json",
        )

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(
            self.dsn,
            autocommit=True,
            connect_timeout=max(1, math.ceil(self.connect_timeout)),
            application_name=f"twophase-{self.name}"[:63],
        )
        conn.execute("SET TIME ZONE 'UTC'")
        return conn

    def _conn_ok(self) -> psycopg.Connection[Any]:
        """This process's connection, (re)opened with retries on connection errors."""
        conn = self._conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        self._conn = None
        self._conn = self._retry("connect", self._connect)
        return self._conn

    def _drop_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with suppress(Exception):
                conn.close()

    def _retry(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` again after a connection failure: only for idempotent work."""
        delay = 0.2
        for attempt in range(1, _RETRIES + 1):
            try:
                return fn()
            except psycopg.Error as exc:
                kind = classify(exc)
                if kind.permanent:  # a retry meets the same refusal: say so at once
                    raise refused(self.describe(), exc, kind, what) from None
                if not transient(exc) or attempt == _RETRIES:
                    if transient(exc):
                        raise ParticipantError(
                            f"{self.describe()}: cannot {what}: server unreachable after "
                            f"{_RETRIES} tries: {exc}"
                        ) from exc
                    raise
                self._drop_conn()
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def probe(self) -> None:
        """The server accepts the credentials, allows PREPARE TRANSACTION
        (``max_prepared_transactions > 0``) and lets the role create or write the table
        and the marker table (run on the driver and on every executor)."""
        self._idempotent("log in", lambda conn: target.probe_role(self, conn))

    def close(self) -> None:
        self._drop_conn()

    def _idempotent(self, what: str, fn: Callable[[psycopg.Connection[Any]], _T]) -> _T:
        return self._retry(what, lambda: fn(self._conn_ok()))

    # -- names ------------------------------------------------------------------------------

    def _table_sql(self) -> sql.Composed:
        return sql.SQL("{}.{}").format(sql.Identifier(self.schema), sql.Identifier(self.table))

    def _marker_sql(self) -> sql.Composed:
        return sql.SQL("{}.{}").format(
            sql.Identifier(self.schema), sql.Identifier(self.marker_table)
        )

    def _own(self, branch: BranchRef) -> str:
        if branch.participant != self.name:
            raise InvalidRequest(
                f"branch {branch.branch_id} belongs to participant {branch.participant!r}, "
                f"not {self.name!r}"
            )
        return gid_for(branch)

    # -- driver-side check ------------------------------------------------------------------

    def partition_columns(self) -> tuple[str, ...] | None:
        """Upsert: rows of one key must reach one branch (see the base class)."""
        return self.key if self.mode == "upsert" else None

    def single_branch(self) -> bool:
        """Complete mode: one branch deletes the old rows and writes the new ones."""
        return self.mode == "complete"

    def _table_schema(self, schema: pa.Schema) -> pa.Schema:
        """The columns stored in the table: the data without the delete flag."""
        if self.delete_when is None:
            return schema
        return schema.remove(schema.get_field_index(self.delete_when))

    def check(self, schema: pa.Schema) -> None:
        """Server settings, marker table, and the data table (created or compared)."""
        problems = []
        for col in self.key:
            if col not in schema.names:
                problems.append(f"key column {col!r} is not in the data (columns: {schema.names})")
        if self.delete_when is not None:
            if self.delete_when not in schema.names:
                problems.append(
                    f"delete_when column {self.delete_when!r} is not in the data "
                    f"(columns: {schema.names})"
                )
            elif not is_bool(schema.field(self.delete_when)):
                problems.append(
                    f"delete_when column {self.delete_when!r} is "
                    f"{schema.field(self.delete_when).type}, not boolean: true deletes the "
                    "row with that key, false or null upserts it"
                )
        if problems:
            raise ParticipantError(f"{self.describe()}: " + "; ".join(problems))
        schema = self._table_schema(schema)
        for field in schema:
            try:
                pg_type_for(field, self.nested)
            except UnsupportedType as exc:
                raise ParticipantError(f"{self.describe()}: {exc}") from None
        self._idempotent("check the target", lambda conn: target.check_table(self, conn, schema))

    # -- the branch -------------------------------------------------------------------------

    def _handle(self, gid: str, rows: int, state: str) -> dict[str, str]:
        return {"kind": self.kind, "participant": self.name, "gid": gid,
                "rows": str(rows), "state": state}

    def _marker_select(self) -> sql.Composed:
        return sql.SQL("SELECT attempt FROM {} WHERE sink = %s AND lineage = %s AND "
                       "checkpoint = %s AND participant = %s AND partition = %s"
                       ).format(self._marker_sql())

    def _marker_attempt(self, conn: psycopg.Connection[Any], branch: BranchRef) -> int | None:
        """The attempt whose data landed for this branch, or None (no marker)."""
        try:
            row = conn.execute(self._marker_select(), _marker_key(branch)).fetchone()
        except pgerr.UndefinedTable:
            return None
        return None if row is None else int(row[0])

    def _is_prepared(self, conn: psycopg.Connection[Any], gid: str) -> bool:
        row = conn.execute(
            "SELECT 1 FROM pg_prepared_xacts WHERE gid = %s AND database = current_database()",
            (gid,),
        ).fetchone()
        return row is not None

    def _probe(self, conn: psycopg.Connection[Any], branch: BranchRef, gid: str
               ) -> tuple[int | None, bool, list[str]]:
        """Before a prepare, in one round trip: the marker's attempt (None: none), whether
        ``gid`` is prepared, and the gids other attempts of the branch hold prepared."""
        held = sql.SQL("ARRAY(SELECT gid FROM pg_prepared_xacts WHERE database = "
                       "current_database() AND left(gid, length(%s)) = %s)")
        prefix = (gid_prefix(branch.sink),) * 2
        try:
            row = conn.execute(sql.SQL("SELECT ({}), {}").format(self._marker_select(), held),
                               (*_marker_key(branch), *prefix)).fetchone()
        except pgerr.UndefinedTable:  # no marker table yet: no marker
            gids = conn.execute(sql.SQL("SELECT {}").format(held), prefix).fetchone()
            row = None if gids is None else (None, gids[0])
        assert row is not None
        others = [g for g in row[1] if (o := parse_gid(g)) is not None
                  and o.attempt != branch.attempt
                  and (o.lineage, o.batch_id, o.participant, o.partition)
                  == (branch.lineage, branch.batch_id, branch.participant, branch.partition)]
        return (None if row[0] is None else int(row[0])), gid in row[1], others

    def prepare(
        self, branch: BranchRef, schema: pa.Schema, batches: Iterable[pa.RecordBatch]
    ) -> Handle:
        gid = self._own(branch)
        try:
            conn = self._conn_ok()
            # Before any data is consumed: is it there already (a redo), or held elsewhere?
            marker, prepared, others = self._idempotent(
                "read the branch state", lambda c: self._probe(c, branch, gid))
        except TargetProblem:
            raise  # permanent: not a NO vote to retry
        except ParticipantError as exc:
            raise PrepareRefused(str(exc)) from exc
        except psycopg.Error as exc:
            raise PrepareRefused(f"{self.describe()}: {describe_error(exc)}") from exc
        if marker is not None:
            return self._handle(gid, 0, "already-committed")
        if prepared:
            return self._handle(gid, 0, "already-prepared")
        if others:
            raise PrepareRefused(
                f"{self.describe()}: branch {branch.branch_id} of batch "
                f"{branch.batch_id} is still prepared by an earlier attempt "
                f"({', '.join(others)}); resolve it first (twophase resolve)"
            )
        data: Iterable[pa.RecordBatch] = batches  # streamed into COPY, never held whole
        if self.key and self.mode != "append":
            data = list(batches)  # every key of the batch is checked before writing
            problems = batch_key_problems(data, self.key)
            if problems:
                raise PrepareRefused(
                    f"{self.describe()}: batch {branch.batch_id} refused before writing: "
                    + "; ".join(problems) + ". In mode=" + repr(self.mode) + " each key "
                    "must appear once per batch (which duplicate should win is not "
                    "defined); deduplicate before the sink, e.g. dropDuplicates(key) or a "
                    "groupBy(key) aggregation"
                )
        conn = self._conn_ok()
        rows = 0
        stage = "begin"
        try:
            conn.execute(sql.SQL("BEGIN; SET LOCAL lock_timeout = {}").format(  # one round trip
                sql.Literal(f"{self.LOCK_TIMEOUT_MS}ms")))
            stage = "copy"
            rows = self._write_rows(conn, gid, schema, data)
            stage = "marker"
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (sink, lineage, checkpoint, participant, partition, attempt)"
                    " VALUES (%s, %s, %s, %s, %s, %s)"
                ).format(self._marker_sql()),
                (branch.sink, branch.lineage, branch.batch_id, branch.participant,
                 branch.partition, branch.attempt),
            )
            stage = "prepare"
            conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        except pgerr.UniqueViolation as exc:
            self._rollback(conn)
            if stage == "marker":
                return self._handle(gid, 0, "already-committed")
            raise PrepareRefused(
                f"{self.describe()}: rows refused: {describe_error(exc)}"
            ) from exc
        except pgerr.UndefinedTable as exc:
            self._rollback(conn)
            raise PrepareRefused(
                f"{self.describe()}: {describe_error(exc)} (run check(schema) on the driver "
                "first: it creates the table and the marker table)"
            ) from exc
        except psycopg.Error as exc:
            self._rollback(conn)
            # A lost connection during PREPARE is ambiguous: it may have reached the server.
            if (
                stage == "prepare"
                and transient(exc)
                and self._idempotent("read the branch state", lambda c: self._is_prepared(c, gid))
            ):
                return self._handle(gid, rows, "prepared")
            kind = classify(exc)
            if kind in (Failure.AUTHENTICATION, Failure.AUTHORIZATION):
                raise refused(self.describe(), exc, kind, stage) from None
            raise PrepareRefused(
                f"{self.describe()}: rows refused during {stage}: {describe_error(exc)}"
            ) from exc
        except BaseException:
            self._rollback(conn)
            raise
        return self._handle(gid, rows, "prepared")

    def _rollback(self, conn: psycopg.Connection[Any]) -> None:
        """Undo an open transaction; a broken connection rolls back in the server anyway."""
        try:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                conn.execute("ROLLBACK")
        except psycopg.Error:
            self._drop_conn()

    def _write_rows(
        self,
        conn: psycopg.Connection[Any],
        gid: str,
        schema: pa.Schema,
        batches: Iterable[pa.RecordBatch],
    ) -> int:
        """The mode's statements, inside the open transaction; returns the rows sent."""
        table = self._table_sql()
        if self.mode == "append":
            return self._copy(conn, table, schema, iter(batches))
        if self.mode == "complete":
            conn.execute(sql.SQL("DELETE FROM {}").format(table))
            return self._copy(conn, table, schema, iter(batches))
        stage = sql.SQL("{}.{}").format(sql.Identifier(self.schema),
                                        sql.Identifier(stage_name(gid)))
        columns = self._table_schema(schema).names
        conn.execute(stage_sql(table, stage, columns, self.delete_when))
        rows = self._copy(conn, stage, schema, iter(batches))
        if self.delete_when is not None:
            conn.execute(delete_sql(table, stage, self.key, self.delete_when))
        conn.execute(upsert_sql(table, stage, columns, self.key, self.delete_when))
        conn.execute(sql.SQL("DROP TABLE {}").format(stage))
        return rows

    def _copy(
        self,
        conn: psycopg.Connection[Any],
        target: sql.Composable,
        schema: pa.Schema,
        batches: Iterator[pa.RecordBatch],
    ) -> int:
        stmt = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
            target, sql.SQL(", ").join(sql.Identifier(n) for n in schema.names)
        )
        rows = 0
        with conn.cursor() as cur, cur.copy(stmt) as copy:
            for batch in batches:
                if not batch.schema.equals(schema):
                    raise PrepareRefused(
                        f"{self.describe()}: a batch has schema {batch.schema} but the branch "
                        f"was declared with {schema}"
                    )
                for chunk in csv_chunks(batch):
                    copy.write(memoryview(chunk))
                rows += batch.num_rows
        return rows

    def commit(self, branch: BranchRef, handle: Handle | None) -> None:
        gid = self._own(branch)
        self._check_handle(gid, handle)

        def run(conn: psycopg.Connection[Any]) -> None:
            try:
                conn.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
                return
            except pgerr.UndefinedObject:
                pass
            if self._marker_attempt(conn, branch) is not None:
                return  # committed earlier (this attempt, or another that landed the data)
            raise ParticipantError(
                f"{self.describe()}: cannot commit {gid!r}: it is not prepared and no marker "
                "shows the branch committed (it was aborted or never prepared)"
            )

        self._idempotent(f"commit {gid!r}", run)

    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        gid = self._own(branch)
        self._check_handle(gid, handle)

        def run(conn: psycopg.Connection[Any]) -> None:
            try:
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
                return
            except pgerr.UndefinedObject:
                pass
            if self._marker_attempt(conn, branch) == branch.attempt:
                raise ParticipantError(
                    f"{self.describe()}: cannot abort {gid!r}: this attempt's branch is "
                    "already committed"
                )

        self._idempotent(f"abort {gid!r}", run)

    def _check_handle(self, gid: str, handle: Handle | None) -> None:
        if handle is not None and handle.get("gid", gid) != gid:
            raise ParticipantError(
                f"{self.describe()}: handle names {handle.get('gid')!r} but the branch is {gid!r}"
            )

    def prune_markers(self, sink: str, lineage: str, below: int) -> int:
        """Delete the marker rows of (sink, lineage) below batch ``below`` (needs DELETE
        on the marker table; the driver logs a refusal and goes on)."""
        def run(conn: psycopg.Connection[Any]) -> int:
            try:
                cur = conn.execute(sql.SQL(
                    "DELETE FROM {} WHERE sink = %s AND lineage = %s AND checkpoint < %s"
                ).format(self._marker_sql()), (sink, lineage, below))
            except pgerr.UndefinedTable:
                return 0
            return max(0, cur.rowcount)

        return self._idempotent("prune markers", run)

    def status(self, branch: BranchRef) -> BranchStatus:
        gid = self._own(branch)

        def run(conn: psycopg.Connection[Any]) -> BranchStatus:
            if self._marker_attempt(conn, branch) is not None:
                return BranchStatus.COMMITTED
            if self._is_prepared(conn, gid):
                return BranchStatus.PREPARED
            return BranchStatus.ABSENT

        return self._idempotent(f"read the status of {gid!r}", run)

    def in_doubt(self, sink: str) -> list[BranchRef]:
        prefix = gid_prefix(sink)

        def run(conn: psycopg.Connection[Any]) -> list[BranchRef]:
            rows = conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
                " AND left(gid, length(%s)) = %s ORDER BY gid",
                (prefix, prefix),
            ).fetchall()
            found = [parse_gid(r[0]) for r in rows]
            return sorted(b for b in found if b is not None and b.participant == self.name)

        return self._idempotent(f"list prepared transactions of sink {sink!r}", run)

    def read_back(self, column: str) -> ReadBack:
        """``column`` of the table, and every twophase prepared transaction in the
        database: a leftover of any sink or participant holds locks and blocks VACUUM."""

        def run(conn: psycopg.Connection[Any]) -> ReadBack:
            rows = conn.execute(
                sql.SQL("SELECT {} FROM {}").format(sql.Identifier(column), self._table_sql())
            ).fetchall()
            gids = conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
                " AND left(gid, length(%s)) = %s",
                (GID_ROOT, GID_ROOT),
            ).fetchall()
            return ReadBack(tuple(r[0] for r in rows), prepared=len(gids))

        with self._connect() as conn:  # its own session: the verifier keeps no connection
            return run(conn)


def _marker_key(branch: BranchRef) -> tuple[Any, ...]:
    """The marker row's key of ``branch`` (every attempt's)."""
    return (branch.sink, branch.lineage, branch.batch_id, branch.participant, branch.partition)
