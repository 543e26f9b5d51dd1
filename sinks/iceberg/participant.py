"""The Iceberg participant: prepare, one snapshot per batch, status, abort, the sweeps
(the package's docstring tells the whole story)."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

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
    RUN_FILE_NAME,
    parse_ranges,
    ranges,
    write_dir,
    write_dirs,
)
from twophase.sinks.iceberg.marker import (
    COMMIT_TRIES,
    HANDLE_CHARS,
    MODES,
    POLICIES,
    SECRET_KEYS,
    UNKNOWN,
    URL_PASSWORD,
    Marker,
    commit_base,
    partition_fields,
    split_table,
)
from twophase.sinks.iceberg.native import native_misfit, spark_columns
from twophase.sinks.iceberg.schema import check_spec, create, fit
from twophase.sinks.iceberg.writer import (
    BranchWriter,
    Found,
    Grouper,
    Run,
    delete_file,
    writer_options,
)

if TYPE_CHECKING:
    import pyarrow as pa
    from pyarrow import fs as pafs
    from pyiceberg.catalog import Catalog
    from pyiceberg.table import Table

__all__ = ["IcebergParticipant"]

log = logging.getLogger(__name__)




class IcebergParticipant(BatchParticipant, Rebuildable, Verifiable, SparkWritten):
    """Rows of each micro-batch appended to (or replacing, ``mode="complete"``) an
    Iceberg table, once, as one snapshot.

    ``catalog`` are pyiceberg's ``load_catalog`` properties (``{"type": "sql", "uri":
    ..., "warehouse": ...}``, ``s3.endpoint`` and keys for object storage); its optional
    ``"name"`` key names the catalog (default ``"default"``).

    ``native``: None, the default, lets Spark's own Parquet writer write the data files
    when every participant of the sink can take them (no row through Python; a table on
    the local file system, unpartitioned or by identity and time transforms); True also
    beside Python participants, refused where it cannot be; False always from Python.
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
        native: bool | None = None,
    ) -> None:
        if native not in (None, False, True):
            raise InvalidRequest(f"native must be None (automatic), True or False, got "
                                 f"{native!r}")
        self.native = native
        self._native_why: str | None = None  # why not native, once known ("" when it can)
        self.identifier = split_table(table)
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
        self.partition_by = partition_fields(partition_by)
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
                      partition: int) -> Found:
        """Every prepare run of one branch's attempt found by name."""
        fs, folder, _ = self._batch_dir(tbl, sink, lineage, batch)
        found = Found(fs, folder)
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
            run = found.runs.setdefault(m["run"], Run())
            if m["seq"] is None:
                run.done = base
            else:
                run.files.append(base)
        return found

    def _markers(self, tbl: Table, sink: str) -> Marker:
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
        return Marker(attempts, top, count)

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
            tbl = create(self, schema)
        check_spec(self, tbl)
        fit(self, tbl, schema)

    # ------------------------------------------------------------------ native path
    def native_format(self) -> str | None:
        """Parquet, unless ``native=False``, or (automatic) a subclass with its own
        ``prepare``, or a table Spark's Parquet writer cannot fill: a partition transform
        Spark does not compute as Iceberg does (bucket), or not on the local file system."""
        if self.native is False or (self.native is None and
                                    type(self).prepare is not IcebergParticipant.prepare):
            return None
        if self._native_why is None:
            self._native_why = native_misfit(self)
            if self._native_why and self.native is None:  # once: the choice is cached
                log.info("%s: not on the native path (%s); the Python path takes its rows",
                         self.describe(), self._native_why)
        if self._native_why and self.native:
            raise InvalidRequest(
                f"{self.describe()}: native=True, but {self._native_why}. Fix: drop "
                "native=True (the Python path writes it)")
        return None if self._native_why else "parquet"

    def native_preferred(self) -> bool:
        return self.native is True

    def native_options(self) -> Mapping[str, str]:
        """The table's Parquet codec (pyiceberg's default, zstd)."""
        codec = self._load().properties.get("write.parquet.compression-codec", "zstd")
        return {"compression": "none" if codec == "uncompressed" else codec}

    def native_columns(self) -> Mapping[str, str]:
        return spark_columns(self, self._load())  # derived: the files keep the source columns

    def native_partition_by(self) -> Sequence[str]:
        return list(self.native_columns())

    def native_location(self, key: TxnKey) -> str:
        tbl = self._load()
        _, _, uri = self._batch_dir(tbl, key.sink, key.lineage, key.batch_id)
        return f"{uri}/{write_dir(self.name, key.attempt)}"

    def adopt(self, key: TxnKey, partitions: int) -> dict[int, Handle]:
        from twophase.sinks.iceberg.native import adopt

        return adopt(self, self._load(), key, partitions)

    def _write_dir(self, tbl: Table, branch: BranchRef) -> str | None:
        """The path of the write folder a native write of the branch's attempt left, if
        one exists (only local tables have them)."""
        fs, folder, _ = self._batch_dir(tbl, branch.sink, branch.lineage, branch.batch_id)
        if fs.type_name != "local":
            return None
        where = f"{folder}/{write_dir(self.name, branch.attempt)}"
        return where if os.path.isdir(where) else None

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
        writer = BranchWriter(fs, folder, stem, self.target_file_bytes,
                               self._grouper(tbl, schema), writer_options(tbl))
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
        if len(files) > HANDLE_CHARS:
            files = "*"  # too many to name in a vote: commit reads the run's .done record
        return {"run": run, "files": files, "rows": str(rows), "bytes": str(size)}

    def _grouper(self, tbl: Table, schema: pa.Schema) -> Grouper | None:
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
        return Grouper(tuple(fields))

    # ------------------------------------------------------------------ commit
    def commit_batch(self, key: TxnKey, handles: Mapping[int, Handle]) -> None:
        from pyiceberg.exceptions import CommitFailedException

        delay = 0.05
        for _ in range(COMMIT_TRIES):
            tbl = self._load()
            done = self._markers(tbl, key.sink).committed(key.lineage, key.batch_id)
            if done is not None:
                if done not in (key.attempt, UNKNOWN):
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
            f"{COMMIT_TRIES} times in a row (other writers commit to the table "
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
        from pyiceberg.table import TableProperties, Transaction

        props = {
            "twophase.sink": key.sink, "twophase.lineage": key.lineage,
            "twophase.batch": str(key.batch_id), "twophase.attempt": str(key.attempt),
            "twophase.participant": self.name, "twophase.partitions": ranges(partitions),
        }
        tx = Transaction(commit_base(tbl, trim=self.mode != "complete"))
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
        if mine.runs or mine.temps or self._write_dir(tbl, branch):
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
                delete_file(found.fs, f"{found.folder}/{base}")
        for base in found.temps:
            delete_file(found.fs, f"{found.folder}/{base}")
        where = self._write_dir(tbl, branch)
        if where:  # a native write not adopted: nothing in it was voted on
            found.fs.delete_dir(where)

    def in_doubt(self, sink: str) -> list[BranchRef]:
        validate_name("sink name", sink)
        tbl = self._load()
        marks = self._markers(tbl, sink)
        return sorted(set(self._unreferenced(tbl, sink, marks)))

    def _unreferenced(self, tbl: Table, sink: str, marks: Marker) -> Iterator[BranchRef]:
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
        for lineage, batch, name, attempt in write_dirs(fs, root):
            if name == self.name and not marks.referenced(lineage, batch, attempt, 0):
                yield BranchRef(sink, lineage, batch, attempt, self.name, 0)  # its first

    # ------------------------------------------------------------------ operators
    def descriptor(self) -> Descriptor:
        secret = sorted(k for k, v in self.catalog_props.items()
                        if SECRET_KEYS.search(k) or URL_PASSWORD.search(v))
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
            native=False,  # a rebuilt participant only commits, aborts and reads
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


