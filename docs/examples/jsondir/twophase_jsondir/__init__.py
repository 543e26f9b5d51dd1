"""JSON-lines files in a directory, exactly once: a complete twophase participant.

Each branch is prepared as ``_prepared/<sink>+<lineage>+<batch>+<attempt>+<name>+<p>.jsonl``
(written, fsynced, invisible to readers of ``*.jsonl`` in the directory) and committed by
an atomic rename to ``<sink>+<lineage>+<batch>+<name>+<p>.jsonl``. The committed name has
no attempt in it: it is the idempotency marker of the branch, whatever attempt wrote it.
``+`` is in no name twophase accepts (twophase.names), so the fields split back apart.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from twophase.participant import (
    BranchRef,
    BranchStatus,
    Descriptor,
    Handle,
    Participant,
    ReadBack,
    Rebuildable,
    Verifiable,
)

__all__ = ["JsonDirParticipant"]


class JsonDirParticipant(Participant, Rebuildable, Verifiable):
    kind = "jsondir"

    def __init__(self, path: str, *, name: str | None = None) -> None:
        super().__init__(name or "jsondir")
        self.path = Path(path)

    # -- names: every field is validated by BranchRef (no "/" or ".." can reach a path)
    def _prepared(self, b: BranchRef) -> Path:
        return self.path / "_prepared" / (
            f"{b.sink}+{b.lineage}+{b.batch_id}+{b.attempt}+{b.participant}+{b.partition}.jsonl")

    def _committed(self, b: BranchRef) -> Path:
        return self.path / f"{b.sink}+{b.lineage}+{b.batch_id}+{b.participant}+{b.partition}.jsonl"

    # -- the five required hooks
    def prepare(self, branch: BranchRef, schema: pa.Schema,
                batches: Iterable[pa.RecordBatch]) -> Handle:
        if self._committed(branch).exists():  # the marker: committed by an earlier run
            return {"file": self._prepared(branch).name}
        target = self._prepared(branch)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for batch in batches:
                for row in batch.to_pylist():
                    f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)  # durable and whole, or absent
        _fsync_dir(target.parent)
        return {"file": target.name}

    def commit(self, branch: BranchRef, handle: Handle | None) -> None:
        if self._committed(branch).exists():
            return  # already done is success
        os.replace(self._prepared(branch), self._committed(branch))
        _fsync_dir(self.path)

    def abort(self, branch: BranchRef, handle: Handle | None) -> None:
        self._prepared(branch).unlink(missing_ok=True)

    def status(self, branch: BranchRef) -> BranchStatus:
        if self._committed(branch).exists():
            return BranchStatus.COMMITTED
        if self._prepared(branch).exists():
            return BranchStatus.PREPARED
        return BranchStatus.ABSENT

    def in_doubt(self, sink: str) -> list[BranchRef]:
        found = []
        for f in sorted((self.path / "_prepared").glob(f"{sink}+*.jsonl")):
            s, lineage, batch, attempt, participant, partition = f.name[:-6].split("+")
            if s == sink and participant == self.name:
                found.append(BranchRef(s, lineage, int(batch), int(attempt), participant,
                                       int(partition)))
        return found

    # -- optional: rebuildable by `twophase resolve` from the coordinator's record
    def descriptor(self) -> Descriptor | None:
        return {"kind": self.kind, "name": self.name, "target": str(self.path), "options": {}}

    @classmethod
    def from_descriptor(cls, descriptor: Descriptor, secrets: Mapping[str, str]) -> Any:
        return cls(descriptor["target"], name=descriptor["name"])

    # -- optional: verifiable by `twophase chaos` (it counts every row after the kills)
    def read_back(self, column: str) -> ReadBack:
        values = tuple(json.loads(line)[column] for f in sorted(self.path.glob("*.jsonl"))
                       for line in f.read_text(encoding="utf-8").splitlines())
        staged = self.path / "_prepared"
        return ReadBack(values=values, prepared=len(list(staged.glob("*.jsonl"))),
                        temp=len(list(staged.glob("*.tmp"))))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
