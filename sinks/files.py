"""Staged-file participant: write hidden, fsync, commit by atomic rename.

Prepare writes the branch's rows to ``path/_twophase_staging/<name>.attempt-<n>.<ext>``
(a folder whose name starts with ``_``, which Spark's and pyarrow's dataset readers skip),
then fsyncs the file and the staging folder: the prepared branch survives a crash of the
process and of the machine. Commit is ``os.replace`` of the staged file onto its final
name directly in ``path``, then an fsync of ``path``: a rename within one file system is
atomic, so a reader sees the whole file or nothing. The final file doubles as the
idempotency marker: its name is keyed by (lineage, checkpoint, participant, partition),
not by attempt, so a redo of a committed branch finds it and writes nothing.

File names are built only from validated :class:`~twophase.participant.BranchRef` parts;
nothing a user passes becomes a path component other than ``path`` itself.

``path="s3://bucket/prefix"`` selects the object-store backend: the same class (the
constructor returns the subclass in :mod:`twophase.sinks.s3`), the same names, handles
and encodings, with a multipart upload in place of the staged file.
"""

from __future__ import annotations

import io
import os
import re
import socket
import uuid
from collections.abc import Iterable, Mapping
from contextlib import suppress
from pathlib import Path
from typing import IO, Any, Final

import pyarrow as pa
import pyarrow.parquet as pq

from twophase.errors import InvalidRequest, TargetProblem, classify
from twophase.jsoncodec import json_rows
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
    SparkWritten,
    Verifiable,
)
from twophase.protocol import TxnKey
from twophase.sinks.batchfiles import fsync_dir, spark_parts
from twophase.sinks.file_schema import POLICIES, folder_misfits, held_schema

__all__ = ["NATIVE_NAME", "STAGED_NAME", "STAGING_DIR", "StagedFileParticipant", "checked_native"]

STAGING_DIR: Final = "_twophase_staging"
_FORMATS: Final = {"parquet": "parquet", "jsonl": "jsonl"}
STAGED_NAME: Final = re.compile(  # a staged file's (or object's) name: its branch
    r"^(?P<sink>[A-Za-z0-9_.-]+)~part-(?P=sink)~(?P<lineage>[A-Za-z0-9-]+)-"
    r"(?P<checkpoint>\d{20})-"
    r"(?P<participant>[A-Za-z0-9_.-]+)-(?P<partition>\d{5,})\.attempt-(?P<attempt>\d+)\.(?P<ext>\w+)$"
)

NATIVE_NAME: Final = re.compile(  # the folder Spark's writer fills for one attempt
    r"^(?P<sink>[A-Za-z0-9_.-]+)~spark-(?P=sink)~(?P<lineage>[A-Za-z0-9-]+)-"
    r"(?P<checkpoint>\d{20})-(?P<participant>[A-Za-z0-9_.-]+)\.attempt-(?P<attempt>\d+)$"
)


def _sanitize(name: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "_", name).strip(".")[:58]
    return cleaned or "files"


def _is_temp(name: str) -> bool:
    """A prepare's temp file (``.<staged name>.<uuid>.tmp``), renamed once complete."""
    return name.startswith(".") and name.endswith(".tmp")


def _check_mode(mode: str, on_schema_change: str) -> None:
    """The output mode and schema-change policy a files participant (local folder or
    object storage) accepts."""
    if mode != "append":
        raise InvalidRequest(
            f"a files participant only appends (mode='append'), got mode={mode!r}: a "
            "folder cannot be replaced atomically with other files being read. For "
            "outputMode('update') or ('complete') each batch's rows land as their own "
            "files (named by batch id), so the folder holds every batch's output; "
            "keep the latest per key when reading, or use a PostgreSQL participant "
            "with mode='upsert' or 'complete'"
        )
    if on_schema_change not in POLICIES:
        raise InvalidRequest(
            f"on_schema_change must be one of {', '.join(POLICIES)}; "
            f"got {on_schema_change!r}"
        )



def checked_native(native: bool | None, format: str) -> bool | None:
    """The ``native`` option of a files participant (local or ``s3://``), refused unless
    None (automatic), True or False; True only with Parquet."""
    if native not in (None, False, True):
        raise InvalidRequest(f"native must be None (automatic), True or False, got "
                             f"{native!r}")
    if native and format != "parquet":
        raise InvalidRequest(f"native=True needs format='parquet' (Spark's JSON writer "
                             f"encodes values differently), got format={format!r}")
    return native

class StagedFileParticipant(Participant, Rebuildable, Verifiable, SparkWritten):
    """Rows of each branch become one Parquet or JSON-lines file in ``path``.

    ``native`` (Parquet, in a local folder or, when Spark loads Hadoop's S3A, on S3):
    None, the default, lets Spark's own Parquet writer write the branch files when every
    participant of the sink can take them (the native data path, no row through Python);
    True also beside Python participants (the batch persisted once for both); False
    always writes them from Python."""

    kind = "files"

    def __new__(cls, *args: Any, **kwargs: Any) -> StagedFileParticipant:
        """``path="s3://..."`` builds the object-store backend (same class, a subclass)."""
        path = args[0] if args else kwargs.get("path")
        if cls is StagedFileParticipant and isinstance(path, str) and path.startswith("s3://"):
            from twophase.sinks.s3 import S3StagedFileParticipant

            return super().__new__(S3StagedFileParticipant)
        return super().__new__(cls)

    def __init__(
        self,
        path: str,
        format: str = "parquet",
        *,
        name: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        mode: str = "append",
        on_schema_change: str = "fail",
        native: bool | None = None,
    ) -> None:
        self.native = checked_native(native, format)
        if storage_options is not None:
            raise InvalidRequest("storage_options apply to s3:// paths only; a local path "
                                 "takes none (drop storage_options or use s3://bucket/prefix)")
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise InvalidRequest("path must be a non-empty directory path")
        if "\x00" in str(path):
            raise InvalidRequest("path must not contain NUL characters")
        self.path = Path(os.path.abspath(os.fspath(path)))
        self._init_common(format, mode, on_schema_change, name, self.path.name)

    def _init_common(
        self, format: str, mode: str, on_schema_change: str, name: str | None, default: str
    ) -> None:
        """What a local folder and an object-store prefix check and set alike; the
        default name is ``files-<default>`` made safe."""
        if format not in _FORMATS:
            raise InvalidRequest(f"format must be 'parquet' or 'jsonl', got {format!r}")
        _check_mode(mode, on_schema_change)
        self.mode = mode
        self.on_schema_change = on_schema_change
        self.format = format
        self.ext = _FORMATS[format]
        Participant.__init__(
            self, name if name is not None else f"files-{_sanitize(default)}")

    def describe(self) -> str:
        return f"files participant {self.name!r} ({self.format} in {self.path})"

    def descriptor(self) -> Descriptor:
        return {"kind": self.kind, "name": self.name, "target": str(self.path),
                "options": {"path": str(self.path), "format": self.format,
                            "on_schema_change": self.on_schema_change}}

    # -- the native data path (SparkWritten) --------------------------------------------------

    def native_format(self) -> str | None:
        """Parquet in a local (shared) folder, unless ``native=False``; by default not for
        a subclass with its own ``prepare`` (it writes rows its own way: only
        ``native=True`` bypasses it)."""
        native = getattr(self, "native", False)
        if native is False or self.format != "parquet":
            return None
        if native is None and type(self).prepare is not StagedFileParticipant.prepare:
            return None
        return "parquet"

    def native_preferred(self) -> bool:
        return getattr(self, "native", None) is True

    def native_name(self, key: TxnKey) -> str:
        """The folder (under the staging folder) Spark's writer fills for attempt ``key``."""
        return (f"{key.sink}~spark-{key.sink}~{key.lineage}-{key.batch_id:020d}-"
                f"{self.name}.attempt-{key.attempt}")

    def native_location(self, key: TxnKey) -> str:
        return str(self.staging / self.native_name(key))

    def adopt(self, key: TxnKey, partitions: int) -> dict[int, Handle]:
        """Spark's ``part-NNNNN-...parquet`` files (one per task, NNNNN its partition)
        renamed to the staged names; zero-row files and Spark's ``_SUCCESS``/``.crc``
        litter dropped with the folder, which goes last (after the staging folder's
        fsync: until then ``status`` reads the attempt as PREPARED and an abort sweeps it)."""
        import shutil

        where = Path(self.native_location(key))
        handles: dict[int, Handle] = {}
        try:
            names = sorted(os.listdir(where))
        except OSError as exc:
            raise ParticipantError(f"{self.describe()}: Spark's write left no folder "
                                   f"{where.name}: {exc}") from exc
        for partition, n in spark_parts(names, partitions, self.describe()):
            ref = BranchRef(*key, participant=self.name, partition=partition)
            src = where / n
            rows = pq.read_metadata(src).num_rows
            if not rows:
                continue
            if self.final_path(ref).exists():  # the marker: committed by an earlier run
                handles[partition] = self._handle(ref, 0, "already-committed")
                continue
            os.replace(src, self.staged_path(ref))
            handles[partition] = self._handle(ref, rows, "prepared")
        fsync_dir(self.staging)
        shutil.rmtree(where)
        return handles

    @classmethod
    def from_descriptor(
        cls, descriptor: Descriptor, secrets: Mapping[str, str]
    ) -> StagedFileParticipant:
        o = descriptor["options"]
        if str(o["path"]).startswith("s3://"):  # its storage options and secrets
            from twophase.sinks.s3 import S3StagedFileParticipant

            return S3StagedFileParticipant.from_descriptor(descriptor, secrets)
        return cls(str(o["path"]), str(o.get("format", "parquet")), name=descriptor["name"],
                   on_schema_change=str(o.get("on_schema_change", "fail")),
                   native=False)  # a rebuilt participant only commits, aborts and reads

    # -- names ------------------------------------------------------------------------------

    @property
    def staging(self) -> Path:
        return self.path / STAGING_DIR

    def _own(self, branch: BranchRef) -> None:
        if branch.participant != self.name:
            raise InvalidRequest(
                f"branch {branch.branch_id} belongs to participant {branch.participant!r}, "
                f"not {self.name!r}"
            )

    def final_name(self, branch: BranchRef) -> str:
        """The committed file's name (an object key's last part on S3)."""
        self._own(branch)
        # The sink is in the name: two sinks sharing a folder never take each other's
        # files for "already committed" (and so never drop rows).
        return (
            f"part-{branch.sink}~{branch.lineage}-{branch.batch_id:020d}-"
            f"{branch.participant}-{branch.partition:05d}.{self.ext}"
        )

    def staged_name(self, branch: BranchRef) -> str:
        # The sink is part of the staged name so in_doubt(sink) can find its leftovers.
        stem = self.final_name(branch).removesuffix(f".{self.ext}")
        return f"{branch.sink}~{stem}.attempt-{branch.attempt}.{self.ext}"

    def final_path(self, branch: BranchRef) -> Path:
        return self.path / self.final_name(branch)

    def staged_path(self, branch: BranchRef) -> Path:
        return self.staging / self.staged_name(branch)

    def _handle(self, branch: BranchRef, rows: int, state: str) -> dict[str, str]:
        return {
            "kind": self.kind,
            "participant": self.name,
            "staged": self.staged_name(branch),
            "final": self.final_name(branch),
            "rows": str(rows),
            "state": state,
        }

    # -- driver-side check ------------------------------------------------------------------

    def check(self, schema: pa.Schema) -> None:
        """Create the folders and prove they are writable; JSON lines need JSON-able types."""
        self.probe()
        self._check_format(schema)
        self._check_folder_schema(schema)

    def probe(self) -> None:
        """The folder and its staging folder exist or can be created, and a file can be
        created and removed there (run on the driver and on every executor)."""
        doing = "create the folder"
        try:
            self.staging.mkdir(parents=True, exist_ok=True)
            doing = "write a file in"
            probe = self.staging / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise self._unwritable(exc, doing) from None

    def _unwritable(self, exc: OSError, doing: str) -> TargetProblem:
        return TargetProblem(
            self.describe(),
            f"cannot {doing} {self.staging}: {exc.strerror or exc}",
            "pass a path this user can create and write on the driver and on every "
            "executor (check that its parent exists, its permissions, that it is not "
            "read-only; on a cluster use a folder every host shares or an s3:// path)",
            host=socket.gethostname(), kind=classify(exc),
        )

    def _check_format(self, schema: pa.Schema) -> None:
        if self.format == "jsonl":
            try:
                empty = pa.RecordBatch.from_pylist([], schema=schema)
                list(json_rows(empty))
            except (ValueError, pa.ArrowException) as exc:
                raise ParticipantError(f"{self.describe()}: {exc}") from exc

    def _check_folder_schema(self, schema: pa.Schema) -> None:
        """``on_schema_change``: the batch against the committed files (local folders)."""
        try:
            held = held_schema(self._visible_files(), self.format)
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise ParticipantError(
                f"{self.describe()}: cannot read the schema of the files already there: {exc}"
            ) from exc
        problems = folder_misfits(held, schema, self.on_schema_change)
        if problems:
            raise ParticipantError(
                f"{self.describe()}: the batch does not fit the files already in the "
                "folder: " + "; ".join(problems)
            )

    def _visible_files(self) -> list[Path]:
        """Committed files of this format in ``path``, as a dataset reader lists them."""
        if not self.path.exists():
            return []
        return sorted(
            f for f in self.path.iterdir()
            if f.is_file() and not f.name.startswith(("_", ".")) and f.suffix == f".{self.ext}"
        )

    # -- the branch -------------------------------------------------------------------------

    def prepare(
        self, branch: BranchRef, schema: pa.Schema, batches: Iterable[pa.RecordBatch]
    ) -> Handle:
        final, staged = self.final_path(branch), self.staged_path(branch)
        if final.exists():
            return self._handle(branch, 0, "already-committed")
        try:
            self.staging.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._unwritable(exc, "create the folder") from None
        self._remove_torn(branch, every_attempt=True)  # left by a killed earlier attempt
        tmp = staged.with_name(f".{staged.name}.{uuid.uuid4().hex}.tmp")
        try:
            rows = self._write(tmp, schema, batches)
            os.replace(tmp, staged)  # a half-written file never carries the staged name
            fsync_dir(self.staging)
        except (OSError, ValueError, pa.ArrowException) as exc:
            with suppress(OSError):
                tmp.unlink()
            raise PrepareRefused(f"{self.describe()}: rows refused: {exc}") from exc
        except BaseException:
            with suppress(OSError):
                tmp.unlink()
            raise
        return self._handle(branch, rows, "prepared")

    def _write(self, tmp: Path, schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> int:
        with open(tmp, "xb") as raw:
            rows = self._encode(raw, schema, batches)
            raw.flush()
            os.fsync(raw.fileno())
        return rows

    def _encode(self, raw: IO[bytes] | io.RawIOBase, schema: pa.Schema,
                batches: Iterable[pa.RecordBatch]) -> int:
        """Write the branch's rows to ``raw`` in the format; the row count."""
        rows = 0
        if self.format == "parquet":
            with pq.ParquetWriter(raw, schema) as writer:
                for batch in batches:
                    self._same_schema(batch, schema)
                    writer.write_batch(batch)
                    rows += batch.num_rows
        else:
            for batch in batches:
                self._same_schema(batch, schema)
                raw.write(b"".join(line + b"\n" for line in json_rows(batch)))
                rows += batch.num_rows
        return rows

    def _same_schema(self, batch: pa.RecordBatch, schema: pa.Schema) -> None:
        if not batch.schema.equals(schema):
            raise InvalidRequest(
                f"a batch has schema {batch.schema} but the branch declared {schema}"
            )

    def commit(self, branch: BranchRef, handle: Handle | None) -> None:
        final, staged = self.final_path(branch), self.staged_path(branch)
        try:
            os.replace(staged, final)
        except FileNotFoundError:
            if final.exists():
                return  # committed before (this attempt, or a redo found it there)
            raise ParticipantError(
                f"{self.describe()}: cannot commit {staged.name}: neither the staged nor the "
                "final file exists (the branch was aborted or never prepared)"
            ) from None
        except OSError as exc:
            raise ParticipantError(
                f"{self.describe()}: cannot commit {staged.name}: {exc}"
            ) from exc
        # The new name must be durable; the staged name vanishing need not be: should it
        # reappear after a crash, status() still says COMMITTED (the final file exists).
        fsync_dir(self.path)

    def _remove_torn(self, branch: BranchRef, *, every_attempt: bool) -> None:
        """Delete temp files of a prepare killed mid-write. They were never prepared
        (never renamed to the staged name), so no reader or status sees them, but
        nothing else would ever delete them."""
        staged = self.staged_path(branch)
        stem = staged.name
        if every_attempt:
            stem = stem[: stem.rindex(".attempt-")] + ".attempt-*." + self.ext
        for torn in self.staging.glob(f".{stem}.*.tmp"):
            with suppress(FileNotFoundError):
                torn.unlink()

    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        staged = self.staged_path(branch)
        self._remove_torn(branch, every_attempt=False)
        self._remove_native(branch)
        try:
            staged.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ParticipantError(f"{self.describe()}: cannot abort {staged.name}: {exc}") from exc
        fsync_dir(self.staging)

    def _remove_native(self, branch: BranchRef) -> None:
        """Delete the folder a native write of ``branch``'s attempt left (a write or an
        adopt killed midway): nothing in it was ever voted on."""
        import shutil

        where = self.staging / self.native_name(branch.key)
        if where.is_dir():
            shutil.rmtree(where, ignore_errors=True)
            fsync_dir(self.staging)

    def status(self, branch: BranchRef) -> BranchStatus:
        if self.final_path(branch).exists():
            return BranchStatus.COMMITTED
        if self.staged_path(branch).exists():
            return BranchStatus.PREPARED
        if (self.staging / self.native_name(branch.key)).is_dir():
            return BranchStatus.PREPARED  # a native write of its attempt, not yet adopted
        return BranchStatus.ABSENT

    def in_doubt(self, sink: str) -> list[BranchRef]:
        try:
            names = os.listdir(self.staging)
        except FileNotFoundError:
            return []
        found: list[BranchRef] = []
        for n in names:
            w = NATIVE_NAME.match(n)
            if w and w["sink"] == sink and w["participant"] == self.name:
                with suppress(ValueError):  # a native write's folder: its first branch
                    ref = BranchRef(sink, w["lineage"], int(w["checkpoint"]),
                                    int(w["attempt"]), self.name, 0)
                    if self.native_name(ref.key) == n:
                        found.append(ref)
                continue
            m = STAGED_NAME.match(n)
            if not m or m["sink"] != sink or m["participant"] != self.name or m["ext"] != self.ext:
                continue
            with suppress(ValueError):
                ref = BranchRef(
                    sink=sink,
                    lineage=m["lineage"],
                    batch_id=int(m["checkpoint"]),
                    attempt=int(m["attempt"]),
                    participant=m["participant"],
                    partition=int(m["partition"]),
                )
                if self.staged_path(ref).name == n:  # the parse is the name's only reading
                    found.append(ref)
        return sorted(found)

    def read_back(self, column: str) -> ReadBack:
        """``column`` of the visible files read through a pyarrow dataset, as Spark would
        read the folder; staged files (any sink's) are the prepared leftovers, and temp
        files of a prepare killed mid-write are counted apart: they were never prepared."""
        import pyarrow.dataset as ds

        if not self.path.exists():
            return ReadBack(())
        files = sorted(
            str(f) for f in self.path.iterdir()
            if f.is_file() and not f.name.startswith(("_", "."))
        )
        values: list[Any] = []
        if files:
            fmt = "parquet" if self.format == "parquet" else "json"
            values = ds.dataset(files, format=fmt).to_table(columns=[column]) \
                .column(column).to_pylist()
        staged = [f for f in self.staging.iterdir() if f.is_file()] \
            if self.staging.exists() else []
        temp = sum(1 for f in staged if _is_temp(f.name))
        writes = [d for d in self.staging.iterdir() if d.is_dir() and NATIVE_NAME.match(d.name)] \
            if self.staging.exists() else []  # a native write not adopted: prepared
        return ReadBack(tuple(values), prepared=len(staged) - temp + len(writes), temp=temp)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()
