"""The Delta participant: prepare, one table version per batch, status, abort, the
sweeps (the package's docstring tells the whole story)."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from twophase.errors import (
    InvalidRequest,
    ParticipantError,
    PrepareRefused,
    TargetProblem,
    classify,
)
from twophase.names import validate_name
from twophase.participant import (
    BatchParticipant,
    BranchRef,
    BranchStatus,
    Descriptor,
    Handle,
    ReadBack,
    Rebuildable,
    SparkWritten,
    Verifiable,
)
from twophase.protocol import TxnKey
from twophase.sinks.batchfiles import (
    DATA_DIR,
    FILE_NAME,
    parse_ranges,
    ranges,
    write_dir,
    write_dirs,
)
from twophase.sinks.delta.arrow import (
    arrow_schema_of,
    conform,
    delta_schema,
    partitionable,
    pyarrow_module,
    split_by_partition,
)
from twophase.sinks.delta.writer import HANDLE_CHARS, BranchWriter, from_footer

if TYPE_CHECKING:
    import pyarrow as pa
    from pyarrow import fs as pafs

__all__ = ["DeltaParticipant", "app_id", "delta_schema"]

log = logging.getLogger(__name__)

MODES: Final = ("append", "complete")
POLICIES: Final = ("fail", "add_columns")
_COMMIT_TRIES: Final = 20
_SECRET_KEYS: Final = re.compile(r"(secret|password|token|credential|session)", re.I)
_META = ("twophase.sink", "twophase.lineage", "twophase.batch", "twophase.attempt",
         "twophase.participant", "twophase.partitions")
_OPEN = threading.local()  # this thread's open tables: (path, options) -> DeltaTable
Commits = dict[tuple[str, int], list[tuple[int, frozenset[int]]]]
"""(lineage, batch) -> (attempt, partitions taken) of every twophase commit of it."""


def app_id(sink: str, lineage: str) -> str:
    """Delta's ``txnAppId`` of a sink's query: one version sequence per lineage."""
    return f"twophase-{sink}-{lineage}"


class DeltaParticipant(BatchParticipant, Rebuildable, Verifiable, SparkWritten):
    """Rows of each micro-batch appended to (or replacing, ``mode="complete"``) a Delta
    table, once, as one table version.

    ``path``: a local folder or ``s3://bucket/prefix``; ``storage_options`` as deltalake
    takes them (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_REGION``, ``AWS_ALLOW_HTTP``, ...).

    ``native``: None, the default, lets Spark's own Parquet writer write the data files
    when every participant of the sink can take them (no row through Python; an
    unpartitioned table in a local folder); True also beside Python participants,
    refused where it cannot be; False always writes them from Python.
    """

    kind = "delta"

    def __init__(
        self,
        path: str,
        *,
        storage_options: Mapping[str, str] | None = None,
        name: str | None = None,
        mode: str = "append",
        on_schema_change: str = "fail",
        partition_by: Sequence[str] | str | None = None,
        target_file_bytes: int = 128 * 1024 * 1024,
        native: bool | None = None,
    ) -> None:
        if native not in (None, False, True):
            raise InvalidRequest(f"native must be None (automatic), True or False, got "
                                 f"{native!r}")
        self.native = native
        self._native_why: str | None = None  # why not native, once known ("" when it can)
        if not isinstance(path, str) or not path or "\x00" in path:
            raise InvalidRequest(f"invalid Delta table path {path!r}")
        if "://" in path and not path.startswith(("s3://", "s3a://", "file://")):
            raise InvalidRequest(
                f"Delta table path {path!r}: twophase writes local paths and s3:// URIs"
            )
        if mode not in MODES:
            raise InvalidRequest(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        if on_schema_change not in POLICIES:
            raise InvalidRequest(
                f"on_schema_change must be one of {', '.join(POLICIES)}; got {on_schema_change!r}"
            )
        if not isinstance(target_file_bytes, int) or target_file_bytes < 1024:
            raise InvalidRequest(f"target_file_bytes must be >= 1024, got {target_file_bytes!r}")
        if isinstance(partition_by, str):
            partition_by = [partition_by]
        self.partition_by = None if partition_by is None else tuple(
            validate_name("partition column", c) for c in partition_by)
        if self.partition_by is not None and len(set(self.partition_by)) != len(self.partition_by):
            raise InvalidRequest(f"partition_by names a column twice: {list(self.partition_by)}")
        self.remote = path.startswith(("s3://", "s3a://"))
        self.path = path if self.remote else os.path.abspath(path.removeprefix("file://"))
        self.storage_options = {str(k): str(v) for k, v in (storage_options or {}).items()}
        self.mode = mode
        self.on_schema_change = on_schema_change
        self.target_file_bytes = target_file_bytes
        base = self.path.rstrip("/").rsplit("/", 1)[-1] or "table"
        super().__init__(name if name is not None else f"delta-{base}"[:64])

    def describe(self) -> str:
        return f"delta participant {self.name!r} (table {self.path})"

    def required_modules(self) -> tuple[str, ...]:
        return ("deltalake", "pyarrow.parquet")

    # ------------------------------------------------------------------ plumbing
    def _table(self) -> Any:
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        # An open table catches up by reading only the log entries after its version; a
        # fresh open replays the log from the last checkpoint (up to 100 entries), which
        # on a long stream costs more than the batch. One cache per thread: a DeltaTable
        # is not shared across threads.
        cache: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = _OPEN.__dict__.setdefault(
            "tables", {})
        key = (self.path, tuple(sorted(self.storage_options.items())))
        dt = cache.get(key)
        if dt is not None:
            try:
                dt.update_incremental()
                return dt
            except Exception:  # replaced or gone: open it afresh
                cache.pop(key, None)
        try:
            dt = DeltaTable(self.path, storage_options=self.storage_options or None)
        except TableNotFoundError:
            raise ParticipantError(
                f"{self.describe()}: the table does not exist; the sink creates it before "
                "the first batch (check), or create it yourself"
            ) from None
        if len(cache) >= 16:
            cache.clear()
        cache[key] = dt
        return dt

    def _fs(self) -> tuple[pafs.FileSystem, str]:
        """A pyarrow file system for the table's files and the table root on it."""
        from pyarrow import fs as pafs_mod

        if not self.remote:
            return pafs_mod.LocalFileSystem(), self.path
        from deltalake.fs import DeltaStorageHandler

        handler = DeltaStorageHandler(self.path, self.storage_options or None)
        return pafs_mod.PyFileSystem(handler), ""

    @staticmethod
    def _rel(sink: str, lineage: str, batch: int) -> str:
        """A batch's folder relative to the table root (fields validated by BranchRef)."""
        return f"{DATA_DIR}-{sink}/{lineage}/{batch:020d}"

    @staticmethod
    def _join(root: str, rel: str) -> str:
        return f"{root.rstrip('/')}/{rel}" if root else rel

    def _list(self, fs: pafs.FileSystem, folder: str, recursive: bool = False) -> list[str]:
        from pyarrow import fs as pafs_mod

        sel = pafs_mod.FileSelector(folder, allow_not_found=True, recursive=recursive)
        try:
            return [i.path for i in fs.get_file_info(sel) if i.type == pafs_mod.FileType.File]
        except (FileNotFoundError, OSError):
            return []

    def _branch_files(self, sink: str, lineage: str, batch: int, attempt: int,
                      partition: int) -> tuple[pafs.FileSystem, str, list[str], list[str]]:
        """(fs, folder, data file names, torn temp names) of one branch's attempt."""
        fs, root = self._fs()
        folder = self._join(root, self._rel(sink, lineage, batch))
        names, temps = [], []
        for path in self._list(fs, folder):
            base = path.rsplit("/", 1)[-1]
            m = FILE_NAME.match(base)
            if m and m["participant"] == self.name and int(m["partition"]) == partition \
                    and int(m["attempt"]) == attempt:
                names.append(base)
            elif base.startswith(".") and base.endswith(".tmp") and \
                    base[1:].startswith(f"{self.name}-{partition:05d}-{attempt}-"):
                temps.append(base)
        return fs, folder, sorted(names), temps

    def _history(self, dt: Any, sink: str) -> Commits:
        """Every twophase commit of ``sink`` in the log's commit infos, oldest first."""
        out: Commits = {}
        for info in reversed(dt.history()):
            if info.get("twophase.sink") != sink or \
                    info.get("twophase.participant") != self.name:
                continue
            key = (str(info["twophase.lineage"]), int(info["twophase.batch"]))
            took = parse_ranges(str(info.get("twophase.partitions", "")))
            out.setdefault(key, []).append((int(info["twophase.attempt"]), took))
        return out

    def _taken(self, dt: Any, history: Commits, sink: str, lineage: str, batch: int,
               attempt: int, partition: int) -> bool | None:
        """Whether the batch's commit took this branch's files: True or False, or None
        when the batch is not in the table. A batch whose commit info is gone from the
        log (expired) counts as taken: the files may be the table's, never deleted."""
        if not self._committed(dt, sink, lineage, batch):
            return None
        commits = history.get((lineage, batch))
        if commits is None:
            return True
        return any(a == attempt and partition in took for a, took in commits)

    @staticmethod
    def _committed(dt: Any, sink: str, lineage: str, batch: int) -> bool:
        version = dt.transaction_version(app_id(sink, lineage))
        return version is not None and version >= batch

    # ------------------------------------------------------------------ check
    def probe(self) -> None:
        """The table's folder (or bucket) can be written: a probe file created and
        removed where the branch files go (run on the driver and on every executor)."""
        fs, root = self._fs()
        folder = self._join(root, f"{DATA_DIR}-probe")
        path = f"{folder}/probe-{uuid.uuid4().hex}"
        try:
            if not self.remote:
                fs.create_dir(folder, recursive=True)
            with fs.open_output_stream(path) as out:
                out.write(b"")
            fs.delete_file(path)
        except Exception as exc:
            kind = classify(exc)
            raise TargetProblem(
                self.describe(),
                f"cannot write a file in the table's folder: {kind.value}: "
                f"{str(exc).strip().splitlines()[0][:300]}",
                "pass a path (or bucket and storage_options) this user can write on the "
                "driver and on every executor",
                host=socket.gethostname(), target=self.path, kind=kind,
            ) from None

    def check(self, schema: pa.Schema) -> None:
        """Create the table from the stream's schema when missing; refuse an existing
        table that does not fit (or add the stream's new columns, ``add_columns``)."""
        from deltalake import DeltaTable

        want = delta_schema(schema)
        if not DeltaTable.is_deltatable(self.path, storage_options=self.storage_options or None):
            try:
                DeltaTable.create(self.path, schema=want, mode="ignore",
                                  partition_by=list(self.partition_by or ()) or None,
                                  storage_options=self.storage_options or None)
            except Exception as exc:
                raise InvalidRequest(
                    f"{self.describe()}: cannot create the table ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0]}); check the path and storage_options"
                ) from None
        dt = self._table()
        have = arrow_schema_of(dt)
        extra = [f for f in want if f.name not in have.names]
        missing = [f.name for f in have if f.name not in want.names and not f.nullable]
        if extra and self.on_schema_change == "add_columns" and not missing:
            from deltalake import Field
            from deltalake import Schema as DeltaSchema

            fields = DeltaSchema.from_arrow(pyarrow_module().schema(extra)).fields
            dt.alter.add_columns([Field(f.name, f.type, nullable=True) for f in fields])
            dt = self._table()
            have, extra = arrow_schema_of(dt), []
        problems = []
        if extra:
            problems.append(f"columns not in the table: {', '.join(f.name for f in extra)}")
        if missing:
            problems.append(f"non-nullable table columns the stream lacks: {', '.join(missing)}")
        differ = [f"{f.name} (table {have.field(f.name).type}, stream {f.type})"
                  for f in want if f.name in have.names and have.field(f.name).type != f.type]
        if differ:
            problems.append("column types differ: " + ", ".join(differ))
        parts = list(dt.metadata().partition_columns)
        if self.partition_by is not None and list(self.partition_by) != parts:
            problems.append(f"the table is partitioned by {parts or 'nothing'}, the sink by "
                            f"{list(self.partition_by) or 'nothing'}")
        bad = [f"{c} ({want.field(c).type})" for c in parts
               if c in want.names and not partitionable(want.field(c).type)]
        if bad:
            problems.append("partition columns must be integers, strings, booleans or "
                            f"dates: {', '.join(bad)}")
        lacking = [c for c in parts if c not in want.names]
        if lacking:
            problems.append(f"partition columns the stream lacks: {', '.join(lacking)}")
        if problems:
            raise InvalidRequest(
                f"{self.describe()}: the stream does not fit the existing table: "
                + "; ".join(problems)
                + ". Fix: select and cast the stream's columns to the table's, or pass "
                "on_schema_change='add_columns' to add new columns, or partition_by= as the "
                "table is, or write to a new table"
            )

    # ------------------------------------------------------------------ native path
    def native_format(self) -> str | None:
        """Parquet, unless ``native=False``, or (automatic) a subclass with its own
        ``prepare``, or a table Spark's plain Parquet writer cannot fill: with generated
        columns, or on object storage. A partitioned table is written with
        ``partitionBy`` (:meth:`native_partition_by`)."""
        if self.native is False or (self.native is None and
                                    type(self).prepare is not DeltaParticipant.prepare):
            return None
        if self._native_why is None:
            self._native_why = self._native_misfit()
        if self._native_why and self.native:
            raise InvalidRequest(
                f"{self.describe()}: native=True, but {self._native_why}. Fix: drop "
                "native=True (the Python path writes it)")
        return None if self._native_why else "parquet"

    def _native_misfit(self) -> str:
        from twophase.sinks.delta.native import native_misfit

        return native_misfit(self)

    def native_preferred(self) -> bool:
        return self.native is True

    def native_partition_by(self) -> list[str]:
        """The table's partition columns (the sink's ``partition_by`` before it exists)."""
        from deltalake import DeltaTable

        if DeltaTable.is_deltatable(self.path):
            return list(self._table().metadata().partition_columns)
        return list(self.partition_by or ())

    def native_location(self, key: TxnKey) -> str:
        folder = self._join(self.path, self._rel(key.sink, key.lineage, key.batch_id))
        return f"{folder}/{write_dir(self.name, key.attempt)}"

    def adopt(self, key: TxnKey, partitions: int) -> dict[int, Handle]:
        from twophase.sinks.delta.native import adopt

        return adopt(self, self._table(), key, partitions)

    def _write_dir(self, branch: BranchRef) -> str | None:
        """A native write folder of the branch's attempt, when one was left (local only)."""
        where = self.native_location(branch.key)
        return where if not self.remote and os.path.isdir(where) else None

    # ------------------------------------------------------------------ prepare
    def prepare(
        self, branch: BranchRef, schema: pa.Schema, batches: Iterable[pa.RecordBatch]
    ) -> Handle:
        if branch.participant != self.name:
            raise PrepareRefused(
                f"branch {branch.branch_id} belongs to participant {branch.participant!r}, "
                f"not {self.name!r}"
            )
        dt = self._table()
        if self._committed(dt, branch.sink, branch.lineage, branch.batch_id):
            return {"files": "[]", "rows": "0", "committed": "yes"}  # the marker: no write
        target = arrow_schema_of(dt)
        parts = list(dt.metadata().partition_columns)
        fs, root = self._fs()
        folder = self._join(root, self._rel(branch.sink, branch.lineage, branch.batch_id))
        stem = f"{self.name}-{branch.partition:05d}-{branch.attempt}"
        seq = itertools.count()  # one sequence for the branch: its files' names differ
        writers: dict[tuple[str | None, ...], BranchWriter] = {}

        def writer_for(values: dict[str, str | None]) -> BranchWriter:
            key = tuple(values.values())
            if key not in writers:
                writers[key] = BranchWriter(fs, folder, stem, self.target_file_bytes,
                                             not self.remote, seq, values)
            return writers[key]

        try:
            for batch in batches:
                rows_in = conform(batch, target)
                for values, piece in split_by_partition(rows_in, parts):
                    writer_for(values).write(piece)
            files = [f for w in writers.values() for f in w.close()]
        except BaseException:
            for w in writers.values():
                w.discard()
            raise
        files.sort()
        listed = json.dumps(files, separators=(",", ":"))
        rows = sum(f[2] for f in files)
        # too many files to vote: the batch commit finds them by name instead
        return {"files": listed if len(listed) <= HANDLE_CHARS else "*", "rows": str(rows)}

    # ------------------------------------------------------------------ commit
    def commit_batch(self, key: TxnKey, handles: Mapping[int, Handle]) -> None:
        from deltalake.exceptions import CommitFailedError
        from deltalake.transaction import CommitProperties, Transaction

        delay = 0.05
        for _ in range(_COMMIT_TRIES):
            dt = self._table()
            if self._committed(dt, key.sink, key.lineage, key.batch_id):
                return  # by this attempt, or (the log says which) another process
            actions = self._actions(key, handles, list(dt.metadata().partition_columns))
            props = CommitProperties(
                custom_metadata=dict(zip(_META, (key.sink, key.lineage, str(key.batch_id),
                                                 str(key.attempt), self.name,
                                                 ranges(handles)), strict=True)),
                app_transactions=[Transaction(app_id(key.sink, key.lineage), key.batch_id)],
                max_commit_retries=0,  # our loop re-reads the marker before trying again
            )
            try:
                dt.create_write_transaction(
                    actions, "overwrite" if self.mode == "complete" else "append",
                    arrow_schema_of(dt), partition_by=list(dt.metadata().partition_columns),
                    commit_properties=props)
                return
            except CommitFailedError as exc:
                log.info("%s: batch %d lost a commit race (%s); reading the marker again",
                         self.describe(), key.batch_id, exc)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        raise ParticipantError(
            f"{self.describe()}: batch {key.batch_id} lost the commit race "
            f"{_COMMIT_TRIES} times in a row (other writers commit to the table "
            "continuously); the driver finishes the batch again"
        )

    def _actions(self, key: TxnKey, handles: Mapping[int, Handle], parts: list[str]
                 ) -> list[Any]:
        from deltalake.transaction import AddAction

        from twophase.sinks.delta.native import with_values

        rel = self._rel(key.sink, key.lineage, key.batch_id)
        now = int(time.time() * 1000)
        actions = []
        for partition, handle in sorted(handles.items()):
            voted = handle.get("files") if handle else None
            if voted is not None and voted != "*":
                files = [tuple(f) for f in json.loads(voted)]
            else:  # a recovery without the vote, or too many to vote: found by name
                fs, folder, names, _ = self._branch_files(key.sink, key.lineage,
                                                          key.batch_id, key.attempt, partition)
                files = with_values(fs, folder, self.name, partition, key.attempt,
                                    [from_footer(fs, folder, n) for n in names], parts)
            for name, size, _rows, values, stats in files:
                if not isinstance(name, str) or not FILE_NAME.match(name):
                    raise ParticipantError(f"{self.describe()}: a handle names {name!r}, "
                                           "which is not a branch data file")
                actions.append(AddAction(f"{rel}/{name}", int(size), dict(values), now, True,
                                         str(stats)))
        return actions

    # ------------------------------------------------------------------ status, abort
    def status(self, branch: BranchRef) -> BranchStatus:
        dt = self._table()
        history = self._history(dt, branch.sink)
        taken = self._taken(dt, history, branch.sink, branch.lineage, branch.batch_id,
                            branch.attempt, branch.partition)
        if taken:
            return BranchStatus.COMMITTED
        mine = self._branch_files(branch.sink, branch.lineage, branch.batch_id,
                                  branch.attempt, branch.partition)[2]
        if mine or self._write_dir(branch):
            return BranchStatus.PREPARED  # (of a superseded attempt: abort sweeps them)
        by = {a for a, _ in history.get((branch.lineage, branch.batch_id), ())}
        if taken is False and branch.attempt not in by:
            # another attempt committed the batch; this one left nothing: its share of
            # the batch is in the table already (a replay writes nothing)
            return BranchStatus.COMMITTED
        return BranchStatus.ABSENT

    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        dt = self._table()
        if self._taken(dt, self._history(dt, branch.sink), branch.sink, branch.lineage,
                       branch.batch_id, branch.attempt, branch.partition):
            return  # the files are the table's now
        from twophase.sinks.delta.native import values_name

        fs, folder, names, temps = self._branch_files(
            branch.sink, branch.lineage, branch.batch_id, branch.attempt, branch.partition)
        # the values record first: left alone, it would be litter no sweep finds
        for base in [values_name(self.name, branch.partition, branch.attempt), *names, *temps]:
            with contextlib.suppress(FileNotFoundError):
                fs.delete_file(f"{folder}/{base}")
        where = self._write_dir(branch)
        if where:  # a native write not adopted: nothing in it was voted on
            fs.delete_dir(where)

    def in_doubt(self, sink: str) -> list[BranchRef]:
        validate_name("sink name", sink)
        dt = self._table()
        return sorted(set(self._unreferenced(dt, sink, self._history(dt, sink))))

    def _unreferenced(self, dt: Any, sink: str, history: Commits) -> Iterator[BranchRef]:
        fs, root = self._fs()
        top = self._join(root, f"{DATA_DIR}-{sink}")
        for path in self._list(fs, top, recursive=True):
            parts = path[len(top) + 1:].split("/")
            if len(parts) != 3 or not parts[1].isdigit():
                continue
            m = FILE_NAME.match(parts[2])
            if not m or m["participant"] != self.name:
                continue
            lineage, batch, attempt = parts[0], int(parts[1]), int(m["attempt"])
            if self._taken(dt, history, sink, lineage, batch, attempt, int(m["partition"])):
                continue  # the table's files
            yield BranchRef(sink, lineage, batch, attempt, self.name, int(m["partition"]))
        for lineage, batch, name, attempt in write_dirs(fs, top):
            if name == self.name and not self._taken(dt, history, sink, lineage, batch,
                                                     attempt, 0):
                yield BranchRef(sink, lineage, batch, attempt, self.name, 0)  # its first

    # ------------------------------------------------------------------ operators
    def descriptor(self) -> Descriptor:
        secret = sorted(k for k in self.storage_options if _SECRET_KEYS.search(k))
        options: dict[str, Any] = {
            "mode": self.mode, "on_schema_change": self.on_schema_change,
            "target_file_bytes": self.target_file_bytes, "secrets": ",".join(secret),
        }
        if self.partition_by is not None:
            options["partition_by"] = ",".join(self.partition_by)
        for k, v in self.storage_options.items():
            if k not in secret:
                options[f"storage.{k}"] = v
        return {"kind": self.kind, "name": self.name, "target": self.path, "options": options}

    @classmethod
    def from_descriptor(
        cls, descriptor: Descriptor, secrets: Mapping[str, str]
    ) -> DeltaParticipant:
        from twophase.participant import required_secret

        o = descriptor["options"]
        storage = {k.removeprefix("storage."): str(v) for k, v in o.items()
                   if k.startswith("storage.")}
        for key in filter(None, str(o.get("secrets", "")).split(",")):
            storage[key] = required_secret(descriptor["name"], secrets, key)
        parts = o.get("partition_by")
        return cls(descriptor["target"], storage_options=storage, name=descriptor["name"],
                   mode=o["mode"], on_schema_change=o["on_schema_change"],
                   partition_by=None if parts is None else [c for c in str(parts).split(",") if c],
                   target_file_bytes=int(o.get("target_file_bytes", 128 * 1024 * 1024)),
                   native=False)  # a rebuilt participant only commits, aborts and reads

    def read_back(self, column: str) -> ReadBack:
        dt = self._table()
        values = tuple(dt.to_pyarrow_table(columns=[column]).column(column).to_pylist())
        sinks = {str(info["twophase.sink"]) for info in dt.history()
                 if info.get("twophase.participant") == self.name}
        commits = extra = prepared = 0
        for sink in sinks:
            history = self._history(dt, sink)
            commits += sum(len(a) for a in history.values())
            extra += sum(len(a) - 1 for a in history.values())
            prepared += len(set(self._unreferenced(dt, sink, history)))
        fs, root = self._fs()
        temp = sum(1 for p in self._list(fs, root or "", recursive=True)
                   if f"/{DATA_DIR}-" in f"/{p}" and p.rsplit("/", 1)[-1].startswith(".")
                   and p.endswith(".tmp"))
        return ReadBack(values=values, prepared=prepared, temp=temp, commits=commits,
                        extra_commits=extra)
