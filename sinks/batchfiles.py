"""What the table participants (Iceberg, Delta) share about a batch's data files: their
names and the marker's record of which branches a batch commit took.

A branch's files live in ``<table>/.../twophase-<sink>/<lineage>/<batch>/`` and
are named ``<participant>-<partition>-<attempt>-<seq>.parquet`` (no ``~``: some S3 clients sign
it differently from the server), so they are found by name
(the sweep of attempts nobody will commit) without any vote. Every field comes from a
validated :class:`~twophase.participant.BranchRef`, so the names are safe path parts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import pyarrow.fs as pafs

__all__ = ["DATA_DIR", "FILE_NAME", "RUN_FILE_NAME", "parse_ranges", "ranges"]

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
