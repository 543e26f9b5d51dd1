"""Exactly-once into an Apache Iceberg table (pyiceberg), one snapshot per micro-batch.

A table commits once per batch (:class:`~twophase.participant.BatchParticipant`): each
task writes its branch's rows as Parquet data files under the table's data folder, named
after (sink, lineage, batch, attempt, participant, partition) and referenced by no
snapshot, so no reader sees them; it votes a handle naming them. After the COMMIT
decision the driver calls :meth:`IcebergParticipant.commit_batch` once: one fast-append
snapshot adding every branch's files, whose summary carries the marker
``twophase.sink`` / ``twophase.lineage`` / ``twophase.batch`` / ``twophase.attempt``.
The marker is read back from the table's snapshot history, so a second commit of the
batch (a retry, a recovery, ``twophase resolve``) is a no-op.

A commit that loses the optimistic race on the catalog (another writer's snapshot
landed first: ``CommitFailedException``) is retried here, after reading the marker
again: pyiceberg's own retry (which re-applies the snapshot without looking) is switched
off for our commits, because the winner may have been this very batch committed by
another process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
    Verifiable,
)
from twophase.protocol import TxnKey
from twophase.sinks.batchfiles import (
    DATA_DIR,
    RUN_FILE_NAME,
    parse_ranges,
    part_path,
    ranges,
    seal_part,
)

if TYPE_CHECKING:
    import pyarrow as pa
    from pyarrow import fs as pafs
    from pyiceberg.catalog import Catalog
    from pyiceberg.table import Table

__all__ = ["MARKER_KEYS", "IcebergParticipant"]

log = logging.getLogger(__name__)

MODES: Final = ("append", "complete")
POLICIES: Final = ("fail", "add_columns")
MARKER_KEYS: Final = ("twophase.sink", "twophase.lineage", "twophase.batch",
                      "twophase.attempt", "twophase.participant", "twophase.partitions")
_IDENT: Final = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_TRANSFORM: Final = re.compile(r"^(?P<t>identity|day|month|year|hour)\((?P<c>[^()]+)\)$")
_SECRET_KEYS: Final = re.compile(r"(secret|password|token|credential|session)", re.I)
_URL_PASSWORD: Final = re.compile(r"://[^/@:]*:[^/@]*@")  # a catalog uri with a password
_HANDLE_CHARS: Final = 4000  # a handle value holds at most 4096 characters
_COMMIT_TRIES: Final = 20
_UNKNOWN: Final = -1  # a batch committed by an attempt whose snapshot has expired
_NO_RETRY: Final = {"commit.retry.num-retries": "0"}


def _split_table(table: str) -> tuple[str, ...]:
    parts = tuple(table.split(".")) if isinstance(table, str) else ()
    if len(parts) < 2 or not all(_IDENT.match(p) for p in parts):
        raise InvalidRequest(
            f"invalid Iceberg table {table!r}: use 'namespace.name' (each part 1-128 "
            "characters from A-Z a-z 0-9 _ -; nested namespaces as 'a.b.name')"
        )
    return parts


def _partition_fields(partition_by: Iterable[str] | None) -> tuple[tuple[str, str], ...]:
    """``["country", "day(ts)"]`` -> ``(("identity", "country"), ("day", "ts"))``."""
    out = []
    for spec in partition_by or ():
        m = _TRANSFORM.match(spec.strip()) if isinstance(spec, str) else None
        transform, column = (m["t"], m["c"].strip()) if m else ("identity", str(spec).strip())
        if not _IDENT.match(column):
            raise InvalidRequest(
                f"invalid partition field {spec!r}: name a column, or identity(col), "
                "day(col), month(col), year(col), hour(col)"
            )
        out.append((transform, column))
    return tuple(out)


@dataclass(frozen=True)
class _Marker:
    """What the snapshot history says about one sink's batches."""

    attempts: dict[tuple[str, int], tuple[int, frozenset[int] | None]]
    """(lineage, batch) -> (attempt, partitions) of the snapshot that committed it"""
    top: dict[str, int]  # lineage -> highest committed batch
    snapshots: dict[tuple[str, int], int]  # (lineage, batch) -> snapshots carrying it

    def committed(self, lineage: str, batch: int) -> int | None:
        """The attempt that committed the batch, ``_UNKNOWN`` when only a later batch of
        the lineage shows it committed (its own snapshot expired), None when not."""
        if (lineage, batch) in self.attempts:
            return self.attempts[(lineage, batch)][0]
        if self.top.get(lineage, -1) > batch:
            return _UNKNOWN
        return None

    def referenced(self, lineage: str, batch: int, attempt: int, partition: int) -> bool:
        """True when the snapshot of the batch took this branch's files (or may have:
        its snapshot expired), so they are the table's and never deleted."""
        done = self.committed(lineage, batch)
        if done == _UNKNOWN:
            return True
        parts = self.attempts[(lineage, batch)][1] if done is not None else None
        return done == attempt and (parts is None or partition in parts)


class IcebergParticipant(BatchParticipant, Rebuildable, Verifiable):
    """Rows of each micro-batch appended to (or replacing, ``mode="complete"``) an
    Iceberg table, once, as one snapshot.

    ``catalog`` are pyiceberg's ``load_catalog`` properties (``{"type": "sql", "uri":
    ..., "warehouse": ...}``, ``s3.endpoint`` and keys for object storage); its optional
    ``"name"`` key names the catalog (default ``"default"``).
    """

    kind = "iceberg"

    def __init__(
        self,
        table: str,
        catalog: Mapping[str, str],
        *,
        name: str | None = None,
        mode: str = "append",
        on_schema_change: str = "fail",
        partition_by: Iterable[str] | None = None,
        target_file_bytes: int = 128 * 1024 * 1024,
    ) -> None:
        self.identifier = _split_table(table)
        self.table = table
        if mode not in MODES:
            raise InvalidRequest(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        if on_schema_change not in POLICIES:
            raise InvalidRequest(
                f"on_schema_change must be one of {', '.join(POLICIES)}; got {on_schema_change!r}"
            )
        if not isinstance(catalog, Mapping) or not catalog:
            raise InvalidRequest(
                "catalog must be pyiceberg's catalog properties, e.g. {'type': 'sql', "
                "'uri': 'sqlite:////path/catalog.db', 'warehouse': 'file:///path/wh'}"
            )
        if not isinstance(target_file_bytes, int) or target_file_bytes < 1024:
            raise InvalidRequest(f"target_file_bytes must be >= 1024, got {target_file_bytes!r}")
        self.catalog_props = {str(k): str(v) for k, v in catalog.items()}
        self.catalog_name = validate_name("catalog name", self.catalog_props.pop("name", "default"))
        self.mode = mode
        self.on_schema_change = on_schema_change
        self.partition_by = _partition_fields(partition_by)
        self.target_file_bytes = target_file_bytes
        super().__init__(name if name is not None else f"iceberg-{table}"[:64])
        self._catalog: Catalog | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_catalog"] = None  # opened again where it is used
        return state

    def describe(self) -> str:
        return f"iceberg participant {self.name!r} (table {self.table})"

    def required_modules(self) -> tuple[str, ...]:
        return ("pyiceberg", "pyarrow.parquet")

    # ------------------------------------------------------------------ plumbing
    def _cat(self) -> Catalog:
        if self._catalog is None:
            from pyiceberg.catalog import load_catalog

            try:
                self._catalog = load_catalog(self.catalog_name, **self.catalog_props)
            except Exception as exc:
                raise ParticipantError(
                    f"{self.describe()}: cannot open the catalog ({type(exc).__name__}: {exc}); "
                    "check the catalog properties (type, uri, warehouse)"
                ) from exc
        return self._catalog

    def _load(self) -> Table:
        from pyiceberg.exceptions import NoSuchTableError

        try:
            return self._cat().load_table(self.identifier)
        except NoSuchTableError:
            raise ParticipantError(
                f"{self.describe()}: the table does not exist; the sink creates it before "
                "the first batch (check), or create it yourself"
            ) from None

    @staticmethod
    def _fs(tbl: Table) -> tuple[pafs.FileSystem, str]:
        """The table's file system (pyarrow, configured like the catalog's FileIO) and
        the path of its data folder on it."""
        from pyiceberg.io.pyarrow import PyArrowFileIO

        io = PyArrowFileIO(tbl.io.properties)
        scheme, netloc, path = io.parse_location(tbl.location())
        return io.fs_by_scheme(scheme, netloc), path.rstrip("/") + "/data"

    def _batch_dir(self, tbl: Table, sink: str, lineage: str, batch: int) -> tuple[
            pafs.FileSystem, str, str]:
        """(file system, folder path on it, folder URI) of one batch's branch files.
        The names were validated by BranchRef/TxnKey, so they are safe path parts."""
        fs, data = self._fs(tbl)
        rel = f"{DATA_DIR}-{sink}/{lineage}/{batch:020d}"
        return fs, f"{data}/{rel}", f"{tbl.location().rstrip('/')}/data/{rel}"

    @staticmethod
    def _list(fs: pafs.FileSystem, folder: str, recursive: bool = False) -> list[str]:
        from pyarrow import fs as pafs_mod

        sel = pafs_mod.FileSelector(folder, allow_not_found=True, recursive=recursive)
        try:
            return [i.path for i in fs.get_file_info(sel) if i.type == pafs_mod.FileType.File]
        except FileNotFoundError:
            return []

    def _branch_files(self, tbl: Table, sink: str, lineage: str, batch: int, attempt: int,
                      partition: int) -> _Found:
        """Every prepare run of one branch's attempt found by name."""
        fs, folder, _ = self._batch_dir(tbl, sink, lineage, batch)
        found = _Found(fs, folder)
        for path in self._list(fs, folder):
            base = path.rsplit("/", 1)[-1]
            temp = base.startswith(".") and base.endswith(".tmp")
            m = RUN_FILE_NAME.match(base[1:-4] if temp else base)
            if not m or m["participant"] != self.name or int(m["partition"]) != partition \
                    or int(m["attempt"]) != attempt:
                continue
            if temp:
                found.temps.append(base)
                continue
            run = found.runs.setdefault(m["run"], _Run())
            if m["seq"] is None:
                run.done = base
            else:
                run.files.append(base)
        return found

    def _markers(self, tbl: Table, sink: str) -> _Marker:
        attempts: dict[tuple[str, int], tuple[int, frozenset[int] | None]] = {}
        top: dict[str, int] = {}
        count: dict[tuple[str, int], int] = {}
        for snap in tbl.metadata.snapshots:
            s = snap.summary
            if s is None or s["twophase.sink"] != sink or \
                    s["twophase.participant"] not in (None, self.name):
                continue
            lineage, batch, attempt = (s["twophase.lineage"], s["twophase.batch"],
                                       s["twophase.attempt"])
            if lineage is None or batch is None or attempt is None:
                continue
            key = (str(lineage), int(batch))
            parts = s["twophase.partitions"]
            attempts.setdefault(key, (int(attempt),
                                      None if parts is None else parse_ranges(str(parts))))
            count[key] = count.get(key, 0) + 1
            top[key[0]] = max(top.get(key[0], -1), key[1])
        return _Marker(attempts, top, count)

    # ------------------------------------------------------------------ check
    def probe(self) -> None:
        """The catalog answers (run on the driver and on every executor before the
        first batch); the table and its folder are checked by ``check``."""
        try:
            self._cat().list_namespaces()
        except Exception as exc:
            kind = classify(exc)
            raise TargetProblem(
                self.describe(),
                f"cannot reach the catalog: {kind.value}: "
                f"{str(exc).strip().splitlines()[0][:300]}",
                "check the catalog properties (type, uri, warehouse, credentials) and that "
                "this host can reach the catalog",
                host=socket.gethostname(), kind=kind,
            ) from None

    def check(self, schema: pa.Schema) -> None:
        """Create the namespace and table from the stream's schema when missing; refuse
        an existing table that does not fit (or evolve it, ``add_columns``)."""
        from pyiceberg.exceptions import NoSuchTableError

        cat = self._cat()
        try:
            tbl = cat.load_table(self.identifier)
        except NoSuchTableError:
            tbl = self._create(schema)
        self._check_spec(tbl)
        self._fit(tbl, schema)

    def _create(self, schema: pa.Schema) -> Table:
        from pyiceberg.exceptions import NamespaceAlreadyExistsError
        from pyiceberg.partitioning import PartitionField
        from pyiceberg.schema import Schema
        from pyiceberg.transforms import parse_transform
        from pyiceberg.types import NestedField

        cat = self._cat()
        with contextlib.suppress(NamespaceAlreadyExistsError):  # a concurrent creator
            cat.create_namespace_if_not_exists(self.identifier[:-1])
        names = set(schema.names)
        for _, column in self.partition_by:
            if column not in names:
                raise InvalidRequest(
                    f"{self.describe()}: partition_by names column {column!r}, which the "
                    f"stream does not have (its columns: {', '.join(schema.names)})"
                )
        tbl = cat.create_table_if_not_exists(self.identifier, schema=schema)
        if self.partition_by and tbl.spec().is_unpartitioned() and not tbl.metadata.snapshots:
            ice: Schema = tbl.schema()
            fields = []
            for i, (transform, column) in enumerate(self.partition_by):
                src: NestedField = ice.find_field(column)
                name = column if transform == "identity" else f"{column}_{transform}"
                fields.append(PartitionField(source_id=src.field_id, field_id=1000 + i,
                                             transform=parse_transform(transform), name=name))
            with tbl.update_spec() as update:
                for field in fields:
                    update.add_field(ice.find_column_name(field.source_id) or "",
                                     field.transform, field.name)
            tbl = cat.load_table(self.identifier)
        return tbl

    def _check_spec(self, tbl: Table) -> None:
        if not self.partition_by:
            return
        ice = tbl.schema()
        have = tuple(
            (str(f.transform) if str(f.transform) != "identity" else "identity",
             ice.find_column_name(f.source_id))
            for f in tbl.spec().fields
        )
        if have != self.partition_by:
            shown = ", ".join(f"{t}({c})" for t, c in have) or "unpartitioned"
            raise InvalidRequest(
                f"{self.describe()}: the table is partitioned by [{shown}], not by "
                f"partition_by={[f'{t}({c})' for t, c in self.partition_by]}; pass the "
                "table's own spec (or none: an existing table keeps its spec)"
            )

    def _fit(self, tbl: Table, schema: pa.Schema) -> None:
        from pyiceberg.io.pyarrow import _check_pyarrow_schema_compatible

        ice = tbl.schema()
        have = {f.name for f in ice.fields}
        extra = [n for n in schema.names if n not in have]
        missing = [f.name for f in ice.fields if f.required and f.name not in schema.names]
        if extra and self.on_schema_change == "add_columns" and not missing:
            import pyarrow

            # rows already in the table lack the new columns: they are optional, even
            # when the stream's are not (a literal, e.g.): Iceberg refuses a required one
            widened = pyarrow.schema([f.with_nullable(True) if f.name in extra else f
                                      for f in schema])
            with tbl.update_schema() as update:
                update.union_by_name(widened)
            tbl = self._load()
            ice = tbl.schema()
            extra = []
        problems = []
        if extra:
            problems.append(f"columns not in the table: {', '.join(extra)}")
        if missing:
            problems.append(f"required table columns the stream lacks: {', '.join(missing)}")
        if not problems:
            try:
                _check_pyarrow_schema_compatible(ice, schema,
                                                 format_version=tbl.metadata.format_version)
            except ValueError as exc:
                problems.append(f"column types differ:\n{exc}")
        if problems:
            raise InvalidRequest(
                f"{self.describe()}: the stream does not fit the existing table: "
                + "; ".join(problems)
                + ". Fix: select and cast the stream's columns to the table's, or pass "
                "on_schema_change='add_columns' to add new columns, or write to a new table"
            )

    # ------------------------------------------------------------------ prepare
    def prepare(
        self, branch: BranchRef, schema: pa.Schema, batches: Iterable[pa.RecordBatch]
    ) -> Handle:
        if branch.participant != self.name:
            raise PrepareRefused(
                f"branch {branch.branch_id} belongs to participant {branch.participant!r}, "
                f"not {self.name!r}"
            )
        tbl = self._load()
        if self._markers(tbl, branch.sink).committed(branch.lineage, branch.batch_id) \
                is not None:
            return {"files": "[]", "rows": "0", "bytes": "0", "committed": "yes"}
        fs, folder, _ = self._batch_dir(tbl, branch.sink, branch.lineage, branch.batch_id)
        run = uuid.uuid4().hex[:12]
        stem = f"{self.name}-{branch.partition:05d}-{branch.attempt}-{run}"
        writer = _BranchWriter(fs, folder, stem, self.target_file_bytes,
                               self._grouper(tbl, schema), _writer_options(tbl))
        try:
            for batch in batches:
                if not batch.schema.equals(schema):
                    raise PrepareRefused(
                        f"a batch has schema {batch.schema} but the branch declared {schema}")
                writer.write(batch)
            names, rows, size = writer.close()
        except Exception as exc:
            writer.discard()
            if isinstance(exc, PrepareRefused):
                raise
            raise PrepareRefused(f"{self.describe()}: cannot write data files: "
                                 f"{type(exc).__name__}: {exc}") from exc
        files = json.dumps(names, separators=(",", ":"))
        if len(files) > _HANDLE_CHARS:
            files = "*"  # too many to name in a vote: commit reads the run's .done record
        return {"run": run, "files": files, "rows": str(rows), "bytes": str(size)}

    def _grouper(self, tbl: Table, schema: pa.Schema) -> _Grouper | None:
        spec = tbl.spec()
        if spec.is_unpartitioned():
            return None
        ice = tbl.schema()
        fields = []
        for f in spec.fields:
            column = ice.find_column_name(f.source_id)
            transform = str(f.transform)
            if column is None or column not in schema.names or \
                    transform not in ("identity", "day", "month", "year", "hour"):
                raise PrepareRefused(
                    f"{self.describe()}: partition field {f.name} ({transform} of "
                    f"{column}) cannot be written by twophase: identity, day, month, year "
                    "and hour of a stream column are supported"
                )
            fields.append((transform, column))
        return _Grouper(tuple(fields))

    # ------------------------------------------------------------------ commit
    def commit_batch(self, key: TxnKey, handles: Mapping[int, Handle]) -> None:
        from pyiceberg.exceptions import CommitFailedException

        delay = 0.05
        for _ in range(_COMMIT_TRIES):
            tbl = self._load()
            done = self._markers(tbl, key.sink).committed(key.lineage, key.batch_id)
            if done is not None:
                if done not in (key.attempt, _UNKNOWN):
                    log.info("%s: batch %d of %s was committed by attempt %d, not %d",
                             self.describe(), key.batch_id, key.lineage, done, key.attempt)
                return
            uris = self._commit_files(tbl, key, handles)
            try:
                self._commit_snapshot(tbl, key, uris, handles)
                return
            except CommitFailedException as exc:
                log.info("%s: batch %d lost a commit race (%s); reading the marker again",
                         self.describe(), key.batch_id, exc)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        raise ParticipantError(
            f"{self.describe()}: batch {key.batch_id} lost the commit race "
            f"{_COMMIT_TRIES} times in a row (other writers commit to the table "
            "continuously); the driver finishes the batch again"
        )

    def _commit_files(self, tbl: Table, key: TxnKey, handles: Mapping[int, Handle]) -> list[str]:
        _, _, uri = self._batch_dir(tbl, key.sink, key.lineage, key.batch_id)
        uris = []
        for partition, handle in sorted(handles.items()):
            voted = handle.get("files") if handle else None
            if voted is not None and voted != "*":
                names = json.loads(voted)
            else:  # a recovery without the vote, or too many to vote: found by name
                found = self._branch_files(tbl, key.sink, key.lineage, key.batch_id,
                                           key.attempt, partition)
                names = found.complete(handle.get("run") if handle else None)
                if names is None:
                    raise ParticipantError(
                        f"{self.describe()}: branch {self.name}/{partition} of batch "
                        f"{key.batch_id} (attempt {key.attempt}) has no complete prepared "
                        "run to commit (its files are gone); the batch must be redone")
            for name in names:
                if not isinstance(name, str) or not RUN_FILE_NAME.match(name) or \
                        name.endswith(".done"):
                    raise ParticipantError(f"{self.describe()}: a handle names {name!r}, "
                                           "which is not a branch data file")
                uris.append(f"{uri}/{name}")
        return uris

    def _commit_snapshot(self, tbl: Table, key: TxnKey, uris: list[str],
                         partitions: Iterable[int]) -> None:
        from pyiceberg.io.pyarrow import parquet_file_to_data_file
        from pyiceberg.table import Table as TableCls
        from pyiceberg.table import TableProperties, Transaction

        props = {
            "twophase.sink": key.sink, "twophase.lineage": key.lineage,
            "twophase.batch": str(key.batch_id), "twophase.attempt": str(key.attempt),
            "twophase.participant": self.name, "twophase.partitions": ranges(partitions),
        }
        # pyiceberg's own retry would re-apply this snapshot after a lost race without
        # reading our marker; the loop in commit_batch does that instead
        md = tbl.metadata.model_copy(update={"properties": {**tbl.metadata.properties,
                                                            **_NO_RETRY}})
        once = TableCls(tbl.name(), md, tbl.metadata_location, tbl.io, tbl.catalog)
        tx = Transaction(once)
        if tx.table_metadata.name_mapping() is None:  # our files carry no field ids
            mapping: dict[str, Any] = {TableProperties.DEFAULT_NAME_MAPPING:
                                       tx.table_metadata.schema().name_mapping.model_dump_json()}
            tx.set_properties(mapping)
        meta = tx.table_metadata
        with ThreadPoolExecutor(max_workers=8) as pool:
            data_files = list(pool.map(lambda u: parquet_file_to_data_file(tbl.io, meta, u),
                                       uris))
        update = tx.update_snapshot(snapshot_properties=props)
        if self.mode == "complete":
            with update.overwrite() as ow:
                if tbl.current_snapshot() is not None:
                    for task in tbl.scan().plan_files():
                        ow.delete_data_file(task.file)
                for df in data_files:
                    ow.append_data_file(df)
        else:
            with update.fast_append() as fa:
                for df in data_files:
                    fa.append_data_file(df)
        tx.commit_transaction()

    # ------------------------------------------------------------------ status, abort
    def status(self, branch: BranchRef) -> BranchStatus:
        tbl = self._load()
        marks = self._markers(tbl, branch.sink)
        if marks.referenced(branch.lineage, branch.batch_id, branch.attempt, branch.partition):
            return BranchStatus.COMMITTED
        done = marks.committed(branch.lineage, branch.batch_id)
        mine = self._branch_files(tbl, branch.sink, branch.lineage, branch.batch_id,
                                  branch.attempt, branch.partition)
        if mine.runs or mine.temps:
            return BranchStatus.PREPARED  # (of a superseded attempt: abort sweeps them)
        # committed by another attempt of the batch: this one's share is there already
        return BranchStatus.COMMITTED if done not in (None, branch.attempt) \
            else BranchStatus.ABSENT

    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        tbl = self._load()
        marks = self._markers(tbl, branch.sink)
        if marks.referenced(branch.lineage, branch.batch_id, branch.attempt, branch.partition):
            return  # the files are the table's now
        found = self._branch_files(
            tbl, branch.sink, branch.lineage, branch.batch_id, branch.attempt, branch.partition)
        for run in found.runs.values():  # the data files first, the .done record last
            for base in [*run.files, *([run.done] if run.done else [])]:
                _delete(found.fs, f"{found.folder}/{base}")
        for base in found.temps:
            _delete(found.fs, f"{found.folder}/{base}")

    def in_doubt(self, sink: str) -> list[BranchRef]:
        validate_name("sink name", sink)
        tbl = self._load()
        marks = self._markers(tbl, sink)
        return sorted(set(self._unreferenced(tbl, sink, marks)))

    def _unreferenced(self, tbl: Table, sink: str, marks: _Marker) -> Iterator[BranchRef]:
        fs, data = self._fs(tbl)
        root = f"{data}/{DATA_DIR}-{sink}"
        for path in self._list(fs, root, recursive=True):
            parts = path[len(root) + 1:].split("/")
            if len(parts) != 3 or not parts[1].isdigit():
                continue
            m = RUN_FILE_NAME.match(parts[2])
            if not m or m["participant"] != self.name:
                continue
            lineage, batch, attempt = parts[0], int(parts[1]), int(m["attempt"])
            if marks.referenced(lineage, batch, attempt, int(m["partition"])):
                continue
            yield BranchRef(sink, lineage, batch, attempt, self.name, int(m["partition"]))

    # ------------------------------------------------------------------ operators
    def descriptor(self) -> Descriptor:
        secret = sorted(k for k, v in self.catalog_props.items()
                        if _SECRET_KEYS.search(k) or _URL_PASSWORD.search(v))
        options: dict[str, Any] = {
            "mode": self.mode, "on_schema_change": self.on_schema_change,
            "partition_by": ",".join(f"{t}({c})" for t, c in self.partition_by),
            "catalog_name": self.catalog_name,
            "target_file_bytes": self.target_file_bytes,
            "secrets": ",".join(secret),
        }
        for k, v in self.catalog_props.items():
            if k not in secret:
                options[f"catalog.{k}"] = v
        return {"kind": self.kind, "name": self.name, "target": self.table, "options": options}

    @classmethod
    def from_descriptor(
        cls, descriptor: Descriptor, secrets: Mapping[str, str]
    ) -> IcebergParticipant:
        from twophase.participant import required_secret

        o = descriptor["options"]
        catalog = {k.removeprefix("catalog."): str(v) for k, v in o.items()
                   if k.startswith("catalog.")}
        catalog["name"] = str(o.get("catalog_name", "default"))
        for key in filter(None, str(o.get("secrets", "")).split(",")):
            catalog[key] = required_secret(descriptor["name"], secrets, key)
        return cls(
            descriptor["target"], catalog, name=descriptor["name"], mode=o["mode"],
            on_schema_change=o["on_schema_change"],
            partition_by=[p for p in str(o.get("partition_by", "")).split(",") if p],
            target_file_bytes=int(o.get("target_file_bytes", 128 * 1024 * 1024)),
        )

    def read_back(self, column: str) -> ReadBack:
        tbl = self._load()
        values: tuple[Any, ...] = ()
        if tbl.current_snapshot() is not None:
            values = tuple(tbl.scan(selected_fields=(column,)).to_arrow()
                           .column(column).to_pylist())
        marks_all = [s.summary for s in tbl.metadata.snapshots if s.summary is not None
                     and s.summary["twophase.participant"] == self.name]
        sinks = {str(s["twophase.sink"]) for s in marks_all}
        prepared = temp = 0
        extra = 0
        fs, data = self._fs(tbl)
        for sink in sinks:
            marks = self._markers(tbl, sink)
            extra += sum(n - 1 for n in marks.snapshots.values())
            prepared += len(set(self._unreferenced(tbl, sink, marks)))
        for path in self._list(fs, data, recursive=True):
            base = path.rsplit("/", 1)[-1]
            if f"/{DATA_DIR}-" in path and base.startswith(".") and base.endswith(".tmp"):
                temp += 1
        return ReadBack(values=values, prepared=prepared, temp=temp, commits=len(marks_all),
                        extra_commits=extra)


@dataclass
class _Run:
    """One prepare run's files; ``done`` names its record once the run completed."""

    files: list[str] = field(default_factory=list)
    done: str | None = None


@dataclass
class _Found:
    fs: pafs.FileSystem
    folder: str
    runs: dict[str, _Run] = field(default_factory=dict)
    temps: list[str] = field(default_factory=list)

    def complete(self, run: str | None) -> list[str] | None:
        """The data files of ``run`` (or of the first complete run when the vote is
        unknown: every complete run holds the branch's same rows), from its record."""
        ids = [run] if run else sorted(self.runs)
        for rid in ids:
            r = self.runs.get(rid)
            if r is not None and r.done is not None:
                with self.fs.open_input_stream(f"{self.folder}/{r.done}") as f:
                    names: list[str] = json.loads(f.read())["files"]
                return names
        return None


def _writer_options(tbl: Table) -> dict[str, Any]:
    """The table's Parquet settings (codec, level, page sizes), as pyiceberg's own
    writer reads them from the table properties (default zstd)."""
    from pyiceberg.io.pyarrow import _get_parquet_writer_kwargs

    return _get_parquet_writer_kwargs(tbl.properties)


def _delete(fs: pafs.FileSystem, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.delete_file(path)


class _Grouper:
    """Splits a record batch by the table's partition values (identity and time
    transforms): Iceberg wants each data file within one partition."""

    def __init__(self, fields: tuple[tuple[str, str], ...]) -> None:
        self.fields = fields

    def split(self, batch: pa.RecordBatch) -> Iterator[tuple[tuple[Any, ...], pa.RecordBatch]]:
        import pyarrow as pa

        cols = {}
        for i, (transform, column) in enumerate(self.fields):
            cols[f"k{i}"] = _transform(transform, batch.column(column))
        cols["row"] = pa.array(range(batch.num_rows), type=pa.int64())
        keys = [f"k{i}" for i in range(len(self.fields))]
        groups = pa.table(cols).group_by(keys, use_threads=False).aggregate([("row", "list")])
        for g in groups.to_pylist():
            yield tuple(g[k] for k in keys), batch.take(pa.array(g["row_list"], pa.int64()))


def _transform(transform: str, arr: pa.Array) -> pa.Array:
    """Iceberg's partition transforms, enough to group rows (the data file's partition
    value itself is derived by pyiceberg from the file's statistics)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if transform == "identity":
        return arr
    if transform == "hour":
        us = pc.cast(pc.cast(arr, pa.timestamp("us", tz="UTC")), pa.int64())
        return pc.divide(us, 3_600_000_000)
    day = arr if pa.types.is_date(arr.type) else pc.cast(
        pc.cast(arr, pa.timestamp("us", tz="UTC")), pa.date32())
    if transform == "day":
        return day
    return pc.year(day) if transform == "year" else pc.add(pc.multiply(pc.year(day), 12),
                                                            pc.month(day))


class _BranchWriter:
    """Streams one branch's rows into Parquet files, one open file per partition value,
    rolled at ``target`` bytes. A local file is written under a ``.tmp`` name and renamed
    when whole (a kill leaves litter, never a torn data file); an object store shows an
    object only once its upload completed."""

    def __init__(self, fs: pafs.FileSystem, folder: str, stem: str, target: int,
                 grouper: _Grouper | None, options: dict[str, Any]) -> None:
        self.fs, self.folder, self.stem, self.target = fs, folder, stem, target
        self.options = options
        self.grouper = grouper
        self.local = fs.type_name == "local"
        self.open: dict[tuple[Any, ...], tuple[Any, Any, str]] = {}
        self.names: list[str] = []
        self.rows = self.bytes = 0
        self.seq = 0
        if self.local:
            fs.create_dir(folder, recursive=True)

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        self.rows += batch.num_rows
        parts = self.grouper.split(batch) if self.grouper else [((), batch)]
        for key, part in parts:
            if key not in self.open:
                self._start(key, part.schema)
            stream, writer, _ = self.open[key]
            writer.write_batch(part)
            if stream.tell() >= self.target:
                self._finish(key)

    def _start(self, key: tuple[Any, ...], schema: pa.Schema) -> None:
        import pyarrow.parquet as pq

        name = f"{self.stem}-{self.seq:05d}.parquet"
        self.seq += 1
        stream = self.fs.open_output_stream(part_path(self.folder, name, self.local))
        self.open[key] = (stream, pq.ParquetWriter(stream, schema, **self.options), name)

    def _finish(self, key: tuple[Any, ...]) -> None:
        stream, writer, name = self.open.pop(key)
        writer.close()
        self.bytes += stream.tell()
        stream.close()
        seal_part(self.fs, self.folder, name, self.local)
        self.names.append(name)

    def close(self) -> tuple[list[str], int, int]:
        for key in list(self.open):
            self._finish(key)
        record = json.dumps({"files": self.names, "rows": self.rows}).encode()
        done = f"{self.stem}.done"
        if self.local:
            with open(f"{self.folder}/.{done}.tmp", "wb") as f:
                f.write(record)
                f.flush()
                os.fsync(f.fileno())
            self.fs.move(f"{self.folder}/.{done}.tmp", f"{self.folder}/{done}")
        else:
            with self.fs.open_output_stream(f"{self.folder}/{done}") as out:
                out.write(record)
        if self.local:
            fd = os.open(self.folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return self.names, self.rows, self.bytes

    def discard(self) -> None:
        for stream, writer, name in self.open.values():
            for closer in (writer.close, stream.close):
                with contextlib.suppress(Exception):  # failing already; the files go next
                    closer()
            _delete(self.fs, f"{self.folder}/.{name}.tmp" if self.local
                    else f"{self.folder}/{name}")
        self.open.clear()
        for name in self.names:
            _delete(self.fs, f"{self.folder}/{name}")
        self.names.clear()

