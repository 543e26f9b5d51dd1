"""What the table participants (Iceberg, Delta) share about a batch's data files: their
names and the marker's record of which branches a batch commit took.

A branch's files live in ``<table>/.../twophase-<sink>/<lineage>/<batch>/`` and
are named ``<participant>-<partition>-<attempt>-<seq>.parquet`` (no ``~``: some S3 clients sign
it differently from the server), so they are found by name
(the sweep of attempts nobody will commit) without any vote. Every field comes from a
validated :class:`~twophase.participant.BranchRef`, so the names are safe path parts.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import unquote

if TYPE_CHECKING:
    import pyarrow.fs as pafs

__all__ = [
    "DATA_DIR",
    "FILE_NAME",
    "HIVE_NULL",
    "RUN_FILE_NAME",
    "SPARK_PART",
    "WRITE_DIR",
    "hive_values",
    "parse_ranges",
    "ranges",
    "spark_parts",
    "write_dir",
    "write_dirs",
    "write_record",
]

DATA_DIR: Final = "twophase"
"""Branch files live under ``<DATA_DIR>-<sink>/<lineage>/<batch>/``."""
FILE_NAME: Final = re.compile(
    r"^(?P<participant>[A-Za-z0-9_.-]+)-(?P<partition>\d{5,})-(?P<attempt>\d+)-"
    r"(?P<seq>\d{5,})\.parquet$"
)


RUN_FILE_NAME: Final = re.compile(
    r"^(?P<participant>[A-Za-z0-9_.-]+)-(?P<partition>\d{5,})-(?P<attempt>\d+)-"
    r"(?P<run>[0-9a-f]{12})(?:-(?P<seq>\d{5,})\.parquet|\.done)$"
)
"""The same with a prepare *run* (Iceberg): ``<participant>-<partition>-<attempt>-<run>-
<seq>.parquet`` and the run's record ``...-<run>.done`` (its files, written last). Each
prepare writes its own run, so a second prepare of a branch and attempt (a Spark task
retry, a speculative copy) never touches files a vote names, which the driver may be
committing at that moment."""


def ranges(parts: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``: the partitions a batch commit took, short at any
    partition count (a snapshot property, a Delta commit's metadata)."""
    out: list[str] = []
    run: list[int] = []
    for p in sorted(set(parts)):
        if run and p == run[-1] + 1:
            run.append(p)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [p]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def parse_ranges(text: str) -> frozenset[int]:
    """The inverse of :func:`ranges`."""
    out: set[int] = set()
    for item in filter(None, text.split(",")):
        lo, _, hi = item.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def part_path(folder: str, name: str, local: bool) -> str:
    """Where a data file is written while it grows: on local disk a hidden ``.tmp`` name
    (a kill leaves litter, never a torn data file); an object store shows an object only
    once its upload completed, so there it is written under its own name."""
    return f"{folder}/.{name}.tmp" if local else f"{folder}/{name}"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a folder's entries (a rename, a new file) durable on local disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal_part(fs: pafs.FileSystem, folder: str, name: str, local: bool) -> None:
    """Make a closed data file durable under its name (local disk: fsync, then rename)."""
    if not local:
        return
    tmp = part_path(folder, name, local)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fs.move(tmp, f"{folder}/{name}")


# -- the native data path (docs/decisions.md 2026-11-26): Spark's write folder of an attempt
WRITE_DIR: Final = re.compile(r"^_spark-(?P<participant>[A-Za-z0-9_.-]+)-(?P<attempt>\d+)$")
SPARK_PART: Final = re.compile(r"^part-(?P<partition>\d{5,})-.*\.parquet$")  # Spark's file


def spark_parts(names: Iterable[str], partitions: int, describe: str
                ) -> Iterator[tuple[int, str]]:
    """(partition, file name) of each data file Spark's writer left in a write folder,
    in name order; Spark's other files (``_SUCCESS``, checksums) are passed over. The
    native path writes one file per task, so a second file for a partition, or one past
    the plan's ``partitions``, is refused (it would be a twophase bug)."""
    from twophase.errors import ParticipantError

    seen: set[int] = set()
    for n in sorted(names):
        m = SPARK_PART.match(n)
        if not m:
            continue
        partition = int(m["partition"])
        if partition >= partitions or partition in seen:
            raise ParticipantError(
                f"{describe}: Spark wrote {n} for partition {partition} of {partitions} "
                "(one file per task expected: maxRecordsPerFile and partitionBy are not "
                "used by the native path; a twophase bug)")
        seen.add(partition)
        yield partition, n


def write_dir(participant: str, attempt: int) -> str:
    """The folder (in the batch's folder) Spark's writer fills for one attempt; it starts
    with ``_``, so no dataset reader of the data folder takes its files."""
    return f"_spark-{participant}-{attempt}"


def write_dirs(fs: pafs.FileSystem, root: str) -> Iterator[tuple[str, int, str, int]]:
    """(lineage, batch, participant, attempt) of every write folder under a sink's root."""
    from pyarrow import fs as pafs_mod

    sel = pafs_mod.FileSelector(root, allow_not_found=True, recursive=True)
    try:
        infos = fs.get_file_info(sel)
    except FileNotFoundError:
        return
    for info in infos:
        if info.type != pafs_mod.FileType.Directory:
            continue
        parts = info.path[len(root) + 1:].split("/")
        m = WRITE_DIR.match(parts[-1]) if len(parts) == 3 else None
        if m and parts[1].isdigit():
            yield parts[0], int(parts[1]), m["participant"], int(m["attempt"])


def write_record(fs: pafs.FileSystem, folder: str, name: str, record: dict[str, Any],
                 local: bool) -> None:
    """A small JSON record beside a batch's files (an Iceberg run's ``.done``, a native
    Delta branch's partition values), durable under its name: on local
    disk written under a ``.tmp`` name, fsynced and renamed; an object store shows an
    object only once its upload completed. The folder's fsync is the caller's (one for
    many records)."""
    data = json.dumps(record).encode()
    if local:
        tmp = f"{folder}/.{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        fs.move(tmp, f"{folder}/{name}")
    else:
        with fs.open_output_stream(f"{folder}/{name}") as out:
            out.write(data)


HIVE_NULL: Final = "__HIVE_DEFAULT_PARTITION__"  # Spark's folder name for a null value


def hive_values(segs: Sequence[str], columns: Sequence[str]) -> list[str | None] | None:
    """The values of the folders Spark's ``partitionBy`` filled (``segs``: one
    ``col=value`` per column of ``columns``, in order), each unescaped as Spark escapes it
    (``%XX``), ``__HIVE_DEFAULT_PARTITION__`` or empty read as null; None when the folders
    are not those columns' (the native tables' adopt refuses such a file)."""
    if len(segs) != len(columns) or not all("=" in seg for seg in segs):
        return None
    if [unquote(seg.partition("=")[0]) for seg in segs] != list(columns):
        return None
    values = [unquote(seg.partition("=")[2]) for seg in segs]
    return [None if v in (HIVE_NULL, "") else v for v in values]
